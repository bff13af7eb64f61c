"""Index recall by page: where each scorer ranks the page holding a needle's answer.

Two steps, so the slow part (full-cache prefills) runs once:

    python benchmarks/diagnostics/page_recall.py dump 4096 100 passkey,multikey,locker_kjv,locker_pydoc n4k.pt
    python benchmarks/diagnostics/page_recall.py rank n4k.pt --calibration CAL_DIR

`dump` prefills Gemma3-270m prompts with the full cache (5 depths per format)
and saves, per global layer, the post-RoPE keys and the last 32 queries, plus
the answer's token positions. Formats (`flashmem_eval.benchkit.probe`): the retrieval benchmark's `passkey` and
`multikey` (KJV haystack), and a needle the benchmark does not use ("the locker
code assigned to NAME is CODE", question "Answer: ...") in the KJV text
(`locker_kjv`) and in the Python reference (`locker_pydoc`).

`rank` scores 4-sink-offset pages of P tokens (P = 16 and 64) with the last
query (the one whose logits emit the first answer token; every decode step
selects alone), pooled over the GQA group as the cache pools (softmax over pages
per query head, then the mean), and prints per layer and scorer how often the
needle's page is within the top 1/2/4/8: `exact` (log-sum-exp of the true
scores), `mean` / `mean8` (mean key, fp32 / int8), `quest` (min/max bound),
`lowrank` / `learned` (per-token projections of a `flashmem calibrate` folder,
int8 keys, log-sum-exp per page), and `rerank4` (the recipe's two stages: the
int8 mean key picks 4k candidate pages, their exact keys keep k; counted as a
hit at top k when the needle's page is among those k).

    python benchmarks/diagnostics/page_recall.py rank n8k.pt --sinks 20
    python benchmarks/diagnostics/page_recall.py dump 8192 1 passkey,locker_kjv n8k_smollm2.pt --model smollm2
    python benchmarks/diagnostics/page_recall.py coverage n8k_smollm2.pt

`--model` dumps another model's managed layers (KV heads ranked one by one);
`coverage` prints, per layer, how much of the last query's attention the sinks
(20) and the recent window (112) hold alone, and with 48 pages added: the 48
best, the recipe's and the int8 mean key's.

`--sinks` sets where pages start (the recipe keeps 20 sink tokens; the 4K table
in docs/measurements.md was ranked with 4).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flashmem.calibration import load_calibration
from flashmem_eval.benchkit import probe

QUERIES = 32
TOPS = (1, 2, 4, 8, 16, 32)
RERANK = 4
CODECS = ("int4", "int2", "sign")  # lsa_rerank_codec's codes (compress/key_code.py)


def dump(length: int, seeds: list[int], fmts: list[str], out: str, model_name: str = "gemma3-270m") -> None:
    from flashmem_eval import harness as H
    from flashmem_eval.suites import global_layers

    torch.set_num_threads(1)
    ld = H.load(model_name)
    tok, model = ld.tokenizer, ld.model
    rows = []
    for seed in seeds:
        for fmt in fmts:
            for depth in (0.1, 0.3, 0.5, 0.7, 0.9):
                context, question, answer = probe(tok, fmt, length, depth, seed)
                enc = tok(context, add_special_tokens=True, return_offsets_mapping=True)
                ctx, q = enc["input_ids"], tok(question, add_special_tokens=False)["input_ids"]
                at = context.find(answer)
                ntok = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < at + len(answer) and b > at]
                pre = H.prefill_full(model, torch.tensor([ctx + q]), obs_window=QUERIES)
                layers = {
                    li: {
                        "K": pre.cache.layers[li].keys[0].half().clone(),  # [Hkv, T, d]
                        "Q": pre.captured[li]["query"][0].half().clone(),  # [Hq, 32, d]
                        "s": pre.captured[li]["scaling"],
                    }
                    for li in global_layers(model)
                }
                rows.append(
                    {"fmt": fmt, "seed": seed, "depth": depth, "ntok": ntok, "nctx": len(ctx), "layers": layers}
                )
                print(fmt, seed, depth, len(ctx), flush=True)
    torch.save(rows, out)


def coded(K: torch.Tensor, codec: str, block: int = 64) -> torch.Tensor:
    """Keys K [T, d] as the re-rank code of `codec` decodes them, coded per block of
    `block` tokens (the recipe's sealed blocks; a last partial block coded alone)."""
    from flashmem.compress import key_code

    parts = [key_code.decode(key_code.encode(K[i : i + block], codec)) for i in range(0, K.shape[0], block)]
    return torch.cat(parts)


def q8(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
    return (x / s).round().clamp(-127, 127) * s


def rank(files: list[str], calibration: str | None, sinks: int = 4) -> None:
    rows = sum((torch.load(f) for f in files), [])
    cal = load_calibration(calibration) if calibration else None
    res: dict[tuple, list[int]] = {}
    for row in rows:
        for li, lay in row["layers"].items():
            n_kv = lay["K"].shape[0]
            group = lay["Q"].shape[0] // n_kv
            for kvh in range(n_kv):  # each KV head ranks its pages with its GQA group's queries
                K, s = lay["K"][kvh].float(), lay["s"]
                Q = lay["Q"][kvh * group : (kvh + 1) * group].float()
                Kh = K[sinks : row["nctx"]]
                for P in (16, 64):
                    n = Kh.shape[0] // P
                    needle = sorted({(t - sinks) // P for t in row["ntok"] if sinks <= t and (t - sinks) // P < n})
                    if not needle:
                        continue
                    pages = Kh[: n * P].reshape(n, P, -1)

                    def rec(
                        name: str, logits: torch.Tensor, li: int = li, kvh: int = kvh, P: int = P, needle: list = needle
                    ) -> None:
                        """logits: [Hq, nq, n] page scores; the last query's pooled page mass ranks."""
                        mass = torch.softmax(logits[:, -1:], -1).mean(1).sum(0)
                        res.setdefault((li, kvh, P, name), []).append(int((mass > mass[needle].max()).sum()))

                    tokens = (Q @ Kh[: n * P].T * s).reshape(*Q.shape[:2], n, P)
                    rec("exact", torch.logsumexp(tokens, -1))
                    rec("mean", Q @ pages.mean(1).T * s)
                    rec("mean8", Q @ q8(pages.mean(1)).T * s)
                    # two stages: hit at k when the needle's page is in the exact top k of the
                    # index's top RERANK * k (stored as a rank: the smallest k that hits)
                    idx_mass = torch.softmax((Q @ q8(pages.mean(1)).T * s)[:, -1:], -1).mean(1).sum(0)
                    ex_mass = torch.softmax(torch.logsumexp(tokens, -1)[:, -1:], -1).mean(1).sum(0)
                    first = n
                    for k in range(1, n + 1):
                        cand = idx_mass.topk(min(n, RERANK * k)).indices
                        win = cand[ex_mass[cand].topk(min(k, len(cand))).indices]
                        if any(p in needle for p in win.tolist()):
                            first = k - 1
                            break
                    res.setdefault((li, kvh, P, f"rerank{RERANK}"), []).append(first)
                    for codec in CODECS:  # the same two stages, the candidates scored by their keys' code
                        Kc = coded(Kh[: n * P], codec)
                        tc = (Q @ Kc.T * s).reshape(*Q.shape[:2], n, P)
                        c_mass = torch.softmax(torch.logsumexp(tc, -1)[:, -1:], -1).mean(1).sum(0)
                        first = n
                        for k in range(1, n + 1):
                            cand = idx_mass.topk(min(n, RERANK * k)).indices
                            win = cand[c_mass[cand].topk(min(k, len(cand))).indices]
                            if any(p in needle for p in win.tolist()):
                                first = k - 1
                                break
                        res.setdefault((li, kvh, P, f"rr{RERANK}-{codec}"), []).append(first)
                    lo, hi = pages.amin(1), pages.amax(1)
                    rec("quest", torch.maximum(Q[..., None, :] * lo, Q[..., None, :] * hi).sum(-1) * s)
                    layer = cal.layer(li) if cal is not None else None
                    if layer is not None:
                        for name, qk, kk in (
                            ("lowrank", "key_basis", "key_basis"),
                            ("learned", "query_proj", "key_proj"),
                        ):
                            a, b = layer[qk][kvh], layer[kk][kvh]
                            tok = ((Q @ a.T) @ q8(Kh[: n * P] @ b.T).T * s).reshape(*Q.shape[:2], n, P)
                            rec(name, torch.logsumexp(tok, -1))
    for key in sorted(res):
        v = res[key]
        tops = " ".join(f"top{k} {sum(x < k for x in v)}" for k in TOPS)
        print(
            f"layer {key[0]:2d} kv head {key[1]} page {key[2]:2d} {key[3]:8s} median {statistics.median(v):5.1f} {tops} of {len(v)}"
        )


def coverage(files: list[str], sinks: int = 20, window: int = 112, k: int = 48, page: int = 16) -> None:
    """Per layer, the last query's attention mass (GQA group mean, KV heads and prompts
    averaged) on the sinks and the recent `window` tokens alone, and with k pages more:
    the k best by exact mass, the recipe's (int8 mean key picks RERANK * k, exact mass
    keeps k), the int8 mean key's k."""
    rows = sum((torch.load(f) for f in files), [])
    acc: dict[int, dict[str, list[float]]] = {}
    for row in rows:
        end = row["nctx"] - window
        for li, lay in row["layers"].items():
            n_kv = lay["K"].shape[0]
            group = lay["Q"].shape[0] // n_kv
            for kvh in range(n_kv):
                K, s = lay["K"][kvh].float(), lay["s"]
                Q = lay["Q"][kvh * group : (kvh + 1) * group, -1].float()  # [g, d]
                p = torch.softmax(Q @ K.T * s, -1)  # [g, T]
                n = (end - sinks) // page
                pe = sinks + n * page
                pm = p[:, sinks:pe].reshape(len(Q), n, page).sum(-1)  # [g, n]
                fixed = p[:, :sinks].sum(-1) + p[:, pe:].sum(-1)
                pooled = pm.mean(0)
                idx = torch.softmax(Q @ q8(K[sinks:pe].reshape(n, page, -1).mean(1)).T * s, -1).mean(0)
                cand = idx.topk(min(n, RERANK * k)).indices
                picks = {
                    "best": pooled.topk(k).indices,
                    "recipe": cand[pooled[cand].topk(k).indices],
                    "mean8": idx.topk(k).indices,
                }
                for codec in CODECS:  # the recipe with its candidates scored by a code of their keys
                    Kc = coded(K[sinks:pe], codec)
                    pc = torch.softmax(Q @ Kc.T * s, -1).reshape(len(Q), n, page).sum(-1).mean(0)
                    picks[f"recipe-{codec}"] = cand[pc[cand].topk(k).indices]
                a = acc.setdefault(li, {})
                a.setdefault("fixed", []).append(float(fixed.mean()))
                for name, sel in picks.items():
                    a.setdefault(name, []).append(float((fixed + pm[:, sel].sum(-1)).mean()))
    for li in sorted(acc):
        cells = " ".join(f"{name} {statistics.mean(v):.2f}" for name, v in acc[li].items())
        print(f"layer {li:2d} sinks+window {cells}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="full-cache prefills: keys, last queries and the needle's positions, to OUT")
    d.add_argument("length", type=int, help="context tokens, e.g. 4096")
    d.add_argument("seeds", help="comma-separated prompt seeds, e.g. 100")
    d.add_argument("formats", help="comma-separated flashmem_eval.benchkit.probe formats, e.g. passkey,locker_kjv")
    d.add_argument("out", help="the .pt file to write")
    d.add_argument("--model", default="gemma3-270m", help="a flashmem.load_model name")
    r = sub.add_parser("rank", help="where each scorer ranks the needle's page, from dumped files")
    r.add_argument("files", nargs="+", help=".pt files of `dump`")
    r.add_argument("--calibration", default=None, help="a `flashmem calibrate` folder (adds lowrank / learned)")
    r.add_argument("--sinks", type=int, default=4, help="tokens before the first page (the recipe keeps 20)")
    c = sub.add_parser("coverage", help="attention mass on sinks + window, and with 48 pages added")
    c.add_argument("files", nargs="+", help=".pt files of `dump`")
    a = ap.parse_args(argv)
    if a.cmd == "dump":
        dump(a.length, [int(x) for x in a.seeds.split(",")], a.formats.split(","), a.out, a.model)
    elif a.cmd == "rank":
        rank(a.files, a.calibration, a.sinks)
    else:
        coverage(a.files)


if __name__ == "__main__":
    main()
