"""Index recall on needle prompts: where each block scorer ranks the needle's block.

For Gemma3-270m passkey / multi-key prompts (seeds and depths of your choice;
the numbers quoted in results/README.md used seed 100 and depths 0.1..0.9,
which the retrieval benchmark does not use), a full-cache prefill of context +
question records each global layer's keys and the last 32 queries; offline,
64-token blocks (after 4 sinks) are ranked by

* ``oracle``: the true attention mass the 32 queries give each block;
* ``lse_exact``: each query's exact log-sum-exp over a block's keys (the best
  any one-number-per-block summary could do), pooled as the cache pools;
* ``mean`` (mean_key), ``gauss`` (gaussian), ``quest``: the cache's own
  scorers (flashmem.index); ``mean16/32`` and ``gauss16/32``: the same
  summaries over 16/32-token sub-blocks (more index memory), block score =
  log-sum-exp over its sub-blocks.

Printed per prompt and layer: how many blocks rank above the needle's block
(0 = the needle's block is first). One JSON line per prompt.

    python benchmarks/diagnostics/needle_recall.py 4096 100
"""

from __future__ import annotations

import argparse
import json

import torch

from flashmem.index import SCORERS
from flashmem_eval import harness as H
from flashmem_eval.suites import global_layers, make_probe

B = 64


def scores(name, Kb, Qf, s, sub):
    """The index scorer `name` on sub-blocks of `sub` tokens: Kb [nb, B, d], Qf [nq, d]
    -> q.k-scale scores [nq, nb] (sub == B) or [nq, nb, B // sub]."""
    nb, blk, d = Kb.shape
    scorer = SCORERS[name]()
    keys = Kb.reshape(nb * blk // sub, 1, sub, d)  # sub-blocks as the batch
    summ = scorer.summarize(keys, torch.ones(keys.shape[0], sub, dtype=torch.bool))  # [n, 1, v, d]
    out = scorer.score(Qf[None, None], summ[:, 0][None, None], s)[0, 0]  # [nq, n]
    return out if sub == blk else out.reshape(len(Qf), nb, blk // sub)


def ranks_of(score, needle):  # score [nq, n] per-query logits (already scaled) -> pooled-mass rank
    m = torch.softmax(score, -1).mean(0)
    return int((m > m[needle].max()).sum())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("length", type=int, help="context tokens, e.g. 4096")
    ap.add_argument("seeds", help="comma-separated prompt seeds, e.g. 100")
    ap.add_argument("--model", default="gemma3-270m", help="a flashmem.load_model name")
    a = ap.parse_args(argv)
    L, seeds = a.length, [int(s) for s in a.seeds.split(",")]
    torch.set_num_threads(1)
    ld = H.load(a.model)
    tok, model = ld.tokenizer, ld.model
    gl = global_layers(model)
    for seed in seeds:
        for task in ("passkey", "multikey"):
            for d in (0.1, 0.3, 0.5, 0.7, 0.9):
                p = make_probe(tok, task, L, d, seed)
                enc = tok(p.context, add_special_tokens=True, return_offsets_mapping=True)
                ctx = enc["input_ids"]
                q = tok(p.question, add_special_tokens=False)["input_ids"]
                pos = p.context.find(p.answer)
                ntok = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < pos + len(p.answer) and b > pos]
                pre = H.prefill_full(model, torch.tensor([ctx + q]), obs_window=32)
                out = {"seed": seed, "task": task, "depth": d}
                for li in gl:
                    K = pre.cache.layers[li].keys[0, 0].float()  # [T, d] (one KV head)
                    Q = pre.captured[li]["query"][0].float()  # [Hq, 32, d]
                    s = pre.captured[li]["scaling"]
                    Qf = Q.reshape(-1, Q.shape[-1])
                    nb = (len(ctx) - 4) // B
                    Kb = K[4 : 4 + nb * B].reshape(nb, B, -1)
                    needle = sorted({(t - 4) // B for t in ntok if 4 <= t < 4 + nb * B})
                    if not needle:
                        continue
                    att = torch.softmax(Qf @ K[: len(ctx) + len(q)].T * s, -1)[:, 4 : 4 + nb * B]
                    att = att.reshape(len(Qf), nb, B).sum(-1)
                    r = {"oracle": int((att.mean(0) > att.mean(0)[needle].max()).sum())}
                    for name, key in (("mean_key", "mean"), ("gaussian", "gauss"), ("quest", "quest")):
                        r[key] = ranks_of(s * scores(name, Kb, Qf, s, B), needle)
                    for sub in (16, 32):
                        for name, key in (("mean_key", "mean"), ("gaussian", "gauss")):
                            sc = s * scores(name, Kb, Qf, s, sub)  # [nq, nb, B // sub]
                            r[f"{key}{sub}"] = ranks_of(torch.logsumexp(sc, -1), needle)
                    lse = torch.logsumexp((Qf @ Kb.reshape(-1, Kb.shape[-1]).T * s).reshape(len(Qf), nb, B), -1)
                    r["lse_exact"] = ranks_of(lse, needle)
                    out[f"L{li}"] = r
                print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
