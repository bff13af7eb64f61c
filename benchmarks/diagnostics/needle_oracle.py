"""Answers with the needle's blocks forced into every selection, against the cache selecting on its own.

Runs flashmem (`FlashMemoryConfig.for_budget(budget, length, group=4)`) on two
Gemma3-270m passkey prompts (depths 0.3 and 0.1) and answers the question; with
`oracle` the blocks holding the needle sentence replace one pick of every
selection during the question and the answer (the prefill is untouched), with
`none` the cache selects on its own. An answer with `oracle` that `none` misses
is a miss of the index. One JSON line per prompt.

    python benchmarks/diagnostics/needle_oracle.py 8192 0.125 100 oracle
    python benchmarks/diagnostics/needle_oracle.py 8192 0.125 100 none
"""

from __future__ import annotations

import argparse
import json

import torch

from flashmem import FlashMemoryConfig
from flashmem_eval import harness as H
from flashmem_eval.suites import make_probe


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("length", type=int, help="context tokens, e.g. 8192")
    ap.add_argument("budget", type=float, help="resident fraction, e.g. 0.125")
    ap.add_argument("seed", type=int, help="prompt seed")
    ap.add_argument("mode", choices=("oracle", "none"), help="force the needle's blocks, or not")
    ap.add_argument("--model", default="gemma3-270m", help="a flashmem.load_model name")
    a = ap.parse_args(argv)
    L, budget, seed, mode = a.length, a.budget, a.seed, a.mode
    torch.set_num_threads(1)
    ld = H.load(a.model)
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


if __name__ == "__main__":
    main()
