"""Whether a task prompt's full-cache answer survives a near-lossless coding of the whole cache.

    python benchmarks/diagnostics/coded_full_cache.py vartrack kjv 4096 23 --wording 3
        [--codes none,bf16,int8-keys,int8-values,int8,int8-keys-kc,int8-kc] [--model smollm2]
    python benchmarks/diagnostics/coded_full_cache.py --from results/X.json [--from ...] --codes int8
        [--json-out FILE]

One prompt of `flashmem_eval.tasks` (family, haystack, length, seed, wording), fed as the
`tasks` suite feeds it (the context through the cache in chunks, then the question, greedy),
with the full cache. Each code rounds every token's K and/or V as attention reads them, so
the prompt and the answer both see them coded:

- `none`: the full cache as it is;
- `bf16`, `fp16`: K and V rounded to that dtype;
- `int8-keys`, `int8-values`, `int8`: K, V or both in the int8 working set's per-token code
  (`flashmem/compress/page_code.py`: one fp32 scale per token and KV head);
- `int8-keys-kc`, `int8-kc`: K coded per channel instead, over each 16-token page (one fp32
  scale per page, KV head and channel: KIVI's key code; the working set has no such code), V
  as it was (`int8-kc`: per token).

Printed per code: the score, the output's start and each found item's decision margin
(`flashmem_eval.tasks.item_gaps`). flashmem's int8 working set codes only its selected pages
so; an answer that the full cache loses when every token is coded that way is one that
flashmem's codec can lose whatever it selects, and a small margin says the full cache's
answer was a near tie to begin with. One JSON line per code for the record.

`--from`: every prompt of tasks runs (`flashmem_eval.task_suite`) whose full-cache row found an
item and carries its margins (`task_suite margins`), answered with each code; printed, per code
and per margin band of the full cache's items (`flashmem_eval.report.MARGIN_EDGES`), the items
the coded cache finds too: how much of what flashmem loses any small change to attention loses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flashmem.compress import page_code
from flashmem_eval import harness as H
from flashmem_eval.tasks import item_gaps, make_task, score_output


def _int8(x: torch.Tensor) -> torch.Tensor:
    return page_code.decode(*page_code.encode(x), x.dtype)


def _int8_channels(x: torch.Tensor, page: int = 16) -> torch.Tensor:
    """x [b, h, T, d] in KIVI's key code: int8 per channel over each page of `page` tokens
    (one fp32 scale per page, KV head and channel; the last page may be partial)."""
    t = x.shape[-2]
    pad = (-t) % page
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad))
    g = xp.unflatten(-2, (-1, page)).transpose(-1, -2)  # [b, h, pages, d, page]
    return _int8(g).transpose(-1, -2).flatten(-3, -2)[..., :t, :]


def _cast(dtype: torch.dtype) -> Any:
    return lambda x: x.to(dtype).to(x.dtype)


CODES: dict[str, tuple[Any, Any]] = {  # name: (code of K, code of V); None: left as it is
    "none": (None, None),
    "bf16": (_cast(torch.bfloat16), _cast(torch.bfloat16)),
    "fp16": (_cast(torch.float16), _cast(torch.float16)),
    "int8-keys": (_int8, None),
    "int8-values": (None, _int8),
    "int8": (_int8, _int8),
    "int8-keys-kc": (_int8_channels, None),
    "int8-kc": (_int8_channels, _int8),
}


def coded_attention(code_k: Any, code_v: Any) -> Any:
    """An attention function (transformers' AttentionInterface) that codes K [b, h, T, d] and
    V [b, h, T, d] before SDPA."""

    def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any) -> Any:
        key = key if code_k is None else code_k(key)
        value = value if code_v is None else code_v(value)
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    return attend


def coded_answer(
    model: Any, ctx: torch.Tensor, q: torch.Tensor, name: str, max_new: int, stop: list[int]
) -> tuple[list[int], list[float]]:
    """The full cache's greedy answer with CODES[name]: the context ctx [1, n] in chunks, then
    the question q [1, m] -> (the answer's ids, each token's decision margin)."""
    impl = model.config._attn_implementation
    AttentionInterface.register(f"coded-{name}", coded_attention(*CODES[name]))
    # SDPA's masks too: without one registered under the name, a chunk of several tokens
    # after the context (the question) gets no mask, and SDPA's is_causal then aligns it
    # to the first keys, not the last
    AttentionMaskInterface.register(f"coded-{name}", sdpa_mask)
    H.restore_attn(model, f"coded-{name}")
    try:
        cache = H.prefill_full(model, ctx).cache  # in chunks, as the tasks suite's full cache
        gaps: list[float] = []
        gen = H.greedy(model, cache, q, max_new, stop, gaps)
    finally:
        H.restore_attn(model, impl)
    return gen, gaps


def from_runs(ld: H.Loaded, files: list[str], codes: list[str], json_out: str | None) -> None:
    """The `--from` mode: each answered prompt of the runs in `files`, with each code."""
    from flashmem_eval.report import margin_label, tally_by_margin

    tok, model = ld.tokenizer, ld.model
    fulls: dict[tuple, dict[str, Any]] = {}
    for f in files:
        for r in json.loads(Path(f).read_text())["rows"]:
            if r.get("suite") == "tasks" and r.get("method") == "full" and r.get("item_gaps") and any(r["hits"]):
                fulls.setdefault((r["family"], r["haystack"], r["length"], r["seed"], r["wording"]), r)
    if not fulls:
        raise SystemExit(f"--from: no full-cache row with margins and an item found in {files}")
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    kept: dict[str, list[list[int]] | None] = dict.fromkeys(codes)
    rows = []
    for (fam, hay, L, seed, w), full in sorted(fulls.items()):
        p = make_task(tok, fam, L, seed, hay=hay, wording=w)
        ctx, q = H.prompt_ids(tok, p)
        for name in codes:
            gen, _ = coded_answer(model, ctx, q, name, p.max_new, stop)
            text = tok.decode(gen, skip_special_tokens=True)
            hits = score_output(text, p)[1]
            kept[name] = tally_by_margin(kept[name], full["item_gaps"], hits)
            row = {"family": fam, "hay": hay, "length": L, "seed": seed, "wording": w, "code": name}
            rows.append(
                {**row, "hits": hits, "full_hits": full["hits"], "full_item_gaps": full["item_gaps"], "output": text}
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"{len(fulls)} prompts; the full cache's items the coded cache finds too, by the full cache's margin:")
    for name in codes:
        cells = [f"{margin_label(i)}: {k}/{n}" for i, (n, k) in enumerate(kept[name] or [])]
        print(f"{name:12s} " + "; ".join(cells))
    if json_out:
        summary = {
            c: [{"band": margin_label(i), "full": n, "kept": k} for i, (n, k) in enumerate(kept[c] or [])]
            for c in codes
        }
        Path(json_out).write_text(
            json.dumps({"files": files, "codes": codes, "summary": summary, "rows": rows}, indent=1)
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family", nargs="?")
    ap.add_argument("hay", nargs="?", help="kjv or stdlib-doc")
    ap.add_argument("length", type=int, nargs="?")
    ap.add_argument("seed", type=int, nargs="?")
    ap.add_argument("--wording", type=int, default=0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--codes", default=",".join(CODES))
    ap.add_argument("--from", dest="runs", action="append", default=[], help="a tasks run's JSON (repeatable)")
    ap.add_argument("--json-out", default=None, help="with --from: the rows and the summary")
    a = ap.parse_args(argv)
    codes = a.codes.split(",")
    bad = [c for c in codes if c not in CODES]
    if bad:
        ap.error(f"--codes: {bad[0]!r} is not known; allowed: {', '.join(CODES)}")
    if not a.runs and a.seed is None:
        ap.error("give a prompt (family hay length seed) or --from a tasks run")
    torch.set_num_threads(1)
    ld = H.load(a.model)
    if a.runs:
        from_runs(ld, a.runs, codes, a.json_out)
        return
    tok, model = ld.tokenizer, ld.model
    p = make_task(tok, a.family, a.length, a.seed, hay=a.hay, wording=a.wording)
    ctx, q = H.prompt_ids(tok, p)
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    print(f"items {p.items}; context {ctx.shape[1]} tokens")
    for name in codes:
        gen, gaps = coded_answer(model, ctx, q, name, p.max_new, stop)
        text = tok.decode(gen, skip_special_tokens=True)
        score, hits = score_output(text, p)
        margins = item_gaps(tok, gen, gaps, p)
        print(f"{name:12s} {score:.2f} margins {margins} {text[:100]!r}")
        row = {"family": a.family, "hay": a.hay, "length": a.length, "seed": a.seed, "wording": a.wording}
        print(json.dumps({**row, "code": name, "score": score, "hits": hits, "item_gaps": margins, "output": text}))


if __name__ == "__main__":
    main()
