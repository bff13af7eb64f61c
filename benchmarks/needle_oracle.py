"""Is the index the bottleneck? Force the needle's block(s) into every selection.

Runs flashmem (the benchmark's budget mapping, default recipe) on two Gemma3-270m
passkey prompts (depths 0.3 and 0.1) and answers the question; with `oracle`
the blocks holding the needle sentence replace one pick of every selection
during the question and the answer (the prefill is untouched), with `none` the
cache selects on its own.

    python benchmarks/needle_oracle.py 8192 0.125 100 oracle
    python benchmarks/needle_oracle.py 8192 0.125 100 none
"""

import json
import sys

import torch

from flashmem import FlashMemoryConfig
from flashmem_eval import harness as H
from flashmem_eval.suites import make_probe

torch.set_num_threads(1)
L, budget, seed, mode = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ld = H.load("gemma3-270m")
tok, model = ld.tokenizer, ld.model
impl = model.config._attn_implementation
FORCE: list[int] = []


def forced(layer_idx, idx, scores):
    """The cache's selection hook: the needle's blocks replace the first pick."""
    if FORCE and mode == "oracle":
        for j in [j for j in FORCE if j < scores.shape[-1]]:
            if not (idx == j).any():
                idx[..., 0] = j
        idx = idx.sort(-1).values
    return idx


for task, d in [("passkey", 0.3), ("passkey", 0.1)]:
    p = make_probe(tok, task, L, d, seed)
    enc = tok(p.context, add_special_tokens=True, return_offsets_mapping=True)
    ctx = torch.tensor([enc["input_ids"]])
    q = torch.tensor([tok(p.question, add_special_tokens=False)["input_ids"]])
    s0, e0 = p.context.find("The pass key is"), p.context.find("is the pass key.") + 16
    ntok = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < e0 and b > s0]
    cfg = FlashMemoryConfig.for_budget(budget, ctx.shape[1], group=4)
    needle = sorted({(t - cfg.sink_tokens) // cfg.hca_chunk_size for t in ntok})
    FORCE.clear()  # the prefill selects on its own
    cache, _, _ = H.prefill_flashmem(model, ctx, cfg)
    cache.selection_hook = forced  # set after the prefill; FORCE stays empty during it anyway
    FORCE.extend(needle)
    gen = H.greedy(model, cache, q, 8, [])
    H.restore_attn(model, impl)
    print(
        json.dumps(
            {
                "mode": mode,
                "task": task,
                "depth": d,
                "needle_blocks": needle,
                "answer": p.answer,
                "out": tok.decode(gen)[:30],
            }
        ),
        flush=True,
    )
    cache.close()
