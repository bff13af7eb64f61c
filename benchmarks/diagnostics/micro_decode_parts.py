"""Micro-benchmarks behind the decode-path choices (docs/measurements.md, "Decode cost
of the int8 working set, cut"), one torch thread, CPU:

    python benchmarks/diagnostics/micro_decode_parts.py

- scoring candidate keys: copied out of the arena into page order, then one matmul,
  against one batched matmul over the arena's blocks where they lie;
- rows of a new working set: `index_copy_` into a fresh tensor against `index_select`;
- int8 coding: `page_code.encode_and_decode` (the code's) against the |x| / clamp form.
Prints ms per call (best of 3 rounds of 20) and the ratios.
"""

from __future__ import annotations

import argparse
import time

import torch

from flashmem.compress import page_code
from flashmem.store.memory import cut_pages


def ms(f, n: int = 20) -> float:
    f()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return 1e3 * best


def scoring() -> None:
    print("scoring every page's keys (B=64, d=64, 16-token pages): copy + matmul vs in place")
    for blocks, heads, nq in [(128, 3, 3), (512, 4, 1), (1024, 4, 1)]:
        a, b = scoring_case(blocks, heads, nq)
        print(f"  {blocks * 64:>6} tokens x {heads} heads, {nq} queries: {a:7.2f} vs {b:6.2f} ms ({a / b:.1f}x)")


def scoring_case(blocks: int, heads: int, nq: int) -> tuple[float, float]:
    arena = torch.randn(blocks + 50, 1, heads, 64, 64)  # a memory store's arena, 50 spare slots
    qg = torch.randn(1, heads, nq, 64)
    pages = torch.arange(blocks * 4).expand(1, heads, -1)

    def copied() -> torch.Tensor:
        ck = cut_pages(arena, pages // 4, pages % 4, 4)
        return torch.matmul(qg, ck.reshape(1, heads, -1, 64).transpose(-1, -2))

    def in_place() -> torch.Tensor:
        lg = torch.matmul(qg[None], arena[:blocks].transpose(-1, -2))
        return lg.permute(1, 2, 3, 0, 4).reshape(1, heads, nq, -1)

    assert torch.equal(copied(), in_place())
    return ms(copied), ms(in_place)


def rows() -> None:
    R, W = 4 * 744, 1024
    src = torch.randint(-100, 100, (R, W)).to(torch.int8)
    perm = torch.randperm(R)
    a = ms(lambda: torch.empty(R, W, dtype=torch.int8).index_copy_(0, perm, src))
    b = ms(lambda: src.index_select(0, perm))
    print(f"rows of an int8 working set ({R} pages of 16 x 64): index_copy_ {a:.2f} vs index_select {b:.2f} ms")


def coding() -> None:
    x = torch.randn(1, 4, 10900, 64)

    def old() -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True).div_(127.0)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        r = (x * inv).round_().clamp_(-127, 127)
        return r.to(torch.int8), r.mul_(scale)

    a, b = ms(old), ms(lambda: page_code.encode_and_decode(x, torch.float32))
    assert torch.equal(old()[0], page_code.encode(x)[0])
    print(f"int8 coding of 10,900 tokens x 4 heads x 64: |x| and clamp {a:.2f} vs max(max, -min) {b:.2f} ms")


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    scoring()
    rows()
    coding()


if __name__ == "__main__":
    main()
