"""The int8 key copy's re-rank, query-major against token-major, in place in one cache.

    python benchmarks/diagnostics/rerank_layout_ab.py [--tokens 8192] [--budget 0.125] [--rounds 40]

SmolLM2-135M prefilled with the default text through the recipe (a CPU model: the int8 key
copy, `lsa_rerank_mirror`), one decode step, then every layer's copy scores the same random
queries (a GQA group of 3) and turns the logits into page masses (`token_page_mass`) with the
copy's own layout (query-major: one run of tokens per query) and with the layout it had
before 2026-12-03 (token-major: `_int_mm` of the keys by the queries, a mixed-dtype scale,
the softmax along dim -2), alternating, `--rounds` times. Prints the median per step (all
layers) and the largest difference between the two masses. docs/measurements.md, "The key
copy's scores laid out by query".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashmem
from flashmem.cache.rerank_codes import HOST, KeyMirror, _int8_rows
from flashmem.index.rerank import token_page_mass


def token_major_logits(m: KeyMirror, qg: torch.Tensor, scaling: float) -> torch.Tensor:
    """KeyMirror.logits as it was: [b, h, nq, T], the transpose of a contiguous [b, h, T, nq]."""
    assert m.k is not None and m.scale is not None
    T = m.tokens
    keys = m.k[:, :, :T]
    b, h, nq, d = qg.shape
    qi, qs = _int8_rows(qg.to(HOST).float())
    cols = max(8, -(-nq // 8) * 8)
    qpad = torch.zeros(b, h, d, cols, dtype=torch.int8)
    qpad[..., :nq] = qi.transpose(-1, -2)
    dots = torch.empty(b, h, T, cols, dtype=torch.int32)
    for i in range(b):
        for j in range(h):
            torch._int_mm(keys[i, j], qpad[i, j], out=dots[i, j])
    out = torch.mul(dots[..., :nq], m.scale[:, :, :T, None]).mul_((qs * scaling)[:, :, None, :])
    return out.transpose(-1, -2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.125)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from flashmem.texts import load_text

    model, tok = flashmem.load_model("smollm2")
    ids = tok(load_text("default")[: args.tokens * 8], return_tensors="pt").input_ids[:, : args.tokens]
    cfg = flashmem.FlashMemoryConfig.for_budget(args.budget, args.tokens, model)
    if cfg.lsa_rerank_mirror != "int8":
        raise SystemExit(f"the recipe at {args.budget} and {args.tokens} tokens has no int8 key copy")
    with flashmem.attach(model, cfg) as cache, torch.no_grad():
        nxt = flashmem.prefill(model, cache, ids, chunk=8192)[:, -1].argmax(-1, keepdim=True)
        model(nxt, cache=cache, use_cache=True)
        mirrors = [layer.ranker.codes for layer in cache.flash_layers]
        assert all(isinstance(m, KeyMirror) for m in mirrors)
        m0 = mirrors[0]
        assert isinstance(m0, KeyMirror) and m0.k is not None
        qg = torch.randn(1, m0.k.shape[1], 3, m0.k.shape[-1], generator=torch.Generator().manual_seed(0)) * 3
        valid = torch.ones(1, 1, m0.tokens, dtype=torch.bool)
        ways = {"query-major": KeyMirror.logits, "token-major": token_major_logits}

        def step(f) -> float:  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            for m in mirrors:
                token_page_mass(f(m, qg, 0.125), valid, cfg.page_tokens, 1.0)
            return time.perf_counter() - t0

        times: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in list(ways)[:: 1 if r % 2 else -1]:
                times[name].append(step(ways[name]))
        a = token_page_mass(KeyMirror.logits(m0, qg, 0.125), valid, cfg.page_tokens, 1.0)
        b = token_page_mass(token_major_logits(m0, qg, 0.125), valid, cfg.page_tokens, 1.0)
    for name, ts in times.items():
        print(
            f"{name}: median {1e3 * statistics.median(ts):.2f} ms per step ({len(mirrors)} layers, {m0.tokens} tokens)"
        )
    print(f"largest difference in page mass: {float((a - b).abs().max()):.2e}")


if __name__ == "__main__":
    main()
