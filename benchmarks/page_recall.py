"""Index recall by page: where each scorer ranks the page holding a needle's answer.

Two steps, so the slow part (full-cache prefills) runs once:

    python benchmarks/page_recall.py dump 4096 100 passkey,multikey,locker_kjv,locker_pydoc n4k.pt
    python benchmarks/page_recall.py rank n4k.pt --calibration CAL_DIR

`dump` prefills Gemma3-270m prompts with the full cache (5 depths per format)
and saves, per global layer, the post-RoPE keys and the last 32 queries, plus
the answer's token positions. Formats: the retrieval benchmark's `passkey` and
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

    python benchmarks/page_recall.py rank n8k.pt --sinks 20
    python benchmarks/page_recall.py dump 8192 1 passkey,locker_kjv n8k_smollm2.pt --model smollm2
    python benchmarks/page_recall.py coverage n8k_smollm2.pt

`--model` dumps another model's managed layers (KV heads ranked one by one);
`coverage` prints, per layer, how much of the last query's attention the sinks
(20) and the recent window (112) hold alone, and with 48 pages added: the 48
best, the recipe's and the int8 mean key's.

`--sinks` sets where pages start (the recipe keeps 20 sink tokens; the 4K table
in docs/measurements.md was ranked with 4).
"""

from __future__ import annotations

import pydoc_data.topics as topics
import random
import re
import statistics
import sys

import torch

from flashmem.calibration import load_calibration
from flashmem.texts import haystack, insert_needles
from flashmem_eval.suites import score_answer

QUERIES = 32
TOPS = (1, 2, 4, 8, 16, 32)
RERANK = 4


def pydoc_text() -> str:
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def probe(tok, fmt: str, length: int, depth: float, seed: int, salt: str = "") -> tuple[str, str, str]:
    """(context, question, answer); `salt` varies the held-out prompts' random draws."""
    from flashmem_eval.suites import make_probe

    if fmt in ("passkey", "multikey"):
        p = make_probe(tok, fmt, length, depth, seed)
        return p.context, p.question, p.answer
    rng = random.Random(f"{fmt}{seed}{depth}{salt}")
    if fmt in LATE_FORMATS:
        return late_probe(tok, fmt, length, depth, rng)
    name = rng.choice(["Maria", "Tomas", "Ingrid", "Kwame", "Yuki"])
    code = str(rng.randint(100000, 999999))
    needle = f"Note from the archivist: the locker code assigned to {name} is {code}."
    question = (
        f"\n\nQuestion: what is the locker code assigned to {name}? Answer: the locker code assigned to {name} is"
    )
    if fmt == "locker_pydoc":
        text = pydoc_text()
        start = rng.randrange(0, len(text) - length * 6)
        ids = tok(text[start : start + length * 5], add_special_tokens=False)["input_ids"][: length - 80]
        hay = tok.decode(ids)
    else:
        hay = haystack(tok, length - 80, seed=rng.randrange(10**6))
    return insert_needles(hay, [(needle, depth)], own_paragraph=True), question, code


# Formats added after the recipe was chosen (2026-12-01), never used to pick it: other
# answer types (a word, a code of letters and digits, a date), an inline needle, the
# question before the text, and the New Testament / stdlib docstrings as haystacks.
LATE_FORMATS = ("word_nt", "code_stdlib", "date_pydoc", "qfirst_kjv")
_WORDS = ["cardamom", "saffron", "tamarind", "fennel", "juniper", "sumac", "anise", "sorrel"]
_MONTHS = ["January", "March", "April", "June", "August", "October", "November"]


def late_probe(tok, fmt: str, length: int, depth: float, rng: random.Random) -> tuple[str, str, str]:
    """(context, question, answer) of a LATE_FORMATS prompt of about `length` tokens."""
    lead = ""
    if fmt == "word_nt":
        answer = rng.choice(_WORDS)
        needle = f"And the gardener said that the secret ingredient of the harvest soup was {answer}."
        question = "\n\nWhat was the secret ingredient of the harvest soup? The secret ingredient was"
        hay_name, own = "kjv-nt", False
    elif fmt == "code_stdlib":
        letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
        answer = f"{rng.choice(letters)}{rng.choice(letters)}{rng.randint(10, 99)}-{rng.randint(100, 999)}"
        needle = f"(Maintenance note: the vault of the east archive opens with the combination {answer}.)"
        question = "\n\nQuestion: which combination opens the vault of the east archive? Answer: the combination is"
        hay_name, own = "stdlib-doc", True
    elif fmt == "date_pydoc":
        name = rng.choice(["Heron", "Basalt", "Lumen", "Quarry", "Tundra"])
        answer = f"{rng.randint(2, 28)} {rng.choice(_MONTHS)}"
        needle = f"The committee finally scheduled the launch of Project {name} for {answer} {rng.randint(2031, 2049)}."
        question = f"\n\nOn what date is the launch of Project {name} scheduled? It is scheduled for"
        hay_name, own = "pydoc", True
    else:  # qfirst_kjv: the question comes before the text, only a short cue after it
        answer = str(rng.randint(100000, 999999))
        lead = "Read the text below, then report the serial number stamped on the brass lantern.\n\n"
        needle = f"The brass lantern had the serial number {answer} stamped on its base."
        question = "\n\nThe serial number stamped on the brass lantern is"
        hay_name, own = "kjv", True
    n = length - 80 - len(tok(lead, add_special_tokens=False)["input_ids"])
    if hay_name == "pydoc":
        text = pydoc_text()
        start = rng.randrange(0, len(text) - n * 6)
        hay = tok.decode(tok(text[start : start + n * 5], add_special_tokens=False)["input_ids"][:n])
    else:
        hay = haystack(tok, n, seed=rng.randrange(10**6), name=hay_name)
    return lead + insert_needles(hay, [(needle, depth)], own_paragraph=own), question, answer


def score(output: str, answer: str) -> bool:
    """A number: the output's first number is it; otherwise the output contains it as whole
    words, any case ("5 March" is not in "15 March")."""
    if answer.isdigit():
        return score_answer(output, answer)
    return re.search(rf"(?<!\w){re.escape(answer.lower())}(?!\w)", output.lower()) is not None


def dump(length: int, seeds: list[int], fmts: list[str], out: str, model_name: str = "gemma3-270m") -> None:
    from flashmem_eval import harness as H
    from flashmem_eval.suites import _global_layers

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
                    for li in _global_layers(model)
                }
                rows.append(
                    {"fmt": fmt, "seed": seed, "depth": depth, "ntok": ntok, "nctx": len(ctx), "layers": layers}
                )
                print(fmt, seed, depth, len(ctx), flush=True)
    torch.save(rows, out)


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
                a = acc.setdefault(li, {})
                a.setdefault("fixed", []).append(float(fixed.mean()))
                for name, sel in picks.items():
                    a.setdefault(name, []).append(float((fixed + pm[:, sel].sum(-1)).mean()))
    for li in sorted(acc):
        cells = " ".join(f"{name} {statistics.mean(v):.2f}" for name, v in acc[li].items())
        print(f"layer {li:2d} sinks+window {cells}")


if __name__ == "__main__":
    if sys.argv[1] == "coverage":
        coverage([f for f in sys.argv[2:] if f.endswith(".pt")])
    elif sys.argv[1] == "dump":
        model_name = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "gemma3-270m"
        dump(
            int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], sys.argv[4].split(","), sys.argv[5], model_name
        )
    else:
        cal = sys.argv[sys.argv.index("--calibration") + 1] if "--calibration" in sys.argv else None
        sinks = int(sys.argv[sys.argv.index("--sinks") + 1]) if "--sinks" in sys.argv else 4
        rank([f for f in sys.argv[2:] if f.endswith(".pt")], cal, sinks)
