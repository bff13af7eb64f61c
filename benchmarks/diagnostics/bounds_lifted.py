"""The flashmem CLI with stop 65's bounds on a step's transients lifted back, for an A/B against
the same command run as is: decode steps attended in one run whatever their keys' bytes
(`assembly.DECODE_KV_BYTES`), and a prompt chunk's index scores and mask blocks at the
accelerator's 64 MiB on a CPU too (`scratch.CPU_TRANSIENT_BYTES`, `selection.SCORE_BLOCK_BYTES_CPU`).

    OMP_NUM_THREADS=1 python benchmarks/diagnostics/bounds_lifted.py bench fidelity --model smollm2 \\
      --methods full,flashmem --budgets 1/6,1/8 --lengths 4096 --seeds 2,3 --n-cont 256 --threads 1 --json-out ...
"""

from __future__ import annotations

import argparse
import sys

from flashmem.cache import assembly, scratch
from flashmem.cli.main import main as flashmem_main
from flashmem.index import selection

BOUNDS = [(assembly, "DECODE_KV_BYTES"), (scratch, "CPU_TRANSIENT_BYTES"), (selection, "SCORE_BLOCK_BYTES_CPU")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the flashmem command and its options")
    args = ap.parse_args(argv)
    saved = [getattr(mod, name) for mod, name in BOUNDS]
    assembly.DECODE_KV_BYTES = 1 << 62
    scratch.CPU_TRANSIENT_BYTES = assembly.MASK_BYTES
    selection.SCORE_BLOCK_BYTES_CPU = selection.SCORE_BLOCK_BYTES
    try:
        flashmem_main(args.args)
        return 0
    finally:  # module constants: put back for whatever runs next in this process
        for (mod, name), value in zip(BOUNDS, saved):
            setattr(mod, name, value)


if __name__ == "__main__":
    sys.exit(main())
