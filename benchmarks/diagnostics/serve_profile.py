"""Where a loaded `flashmem serve` worker's time goes, sampled by py-spy (not instrumented):

    python benchmarks/diagnostics/serve_profile.py [--clients 8] [--max-tokens 64] [--seconds 45]
        [--dtype bfloat16] [--max-batch 1] [--out r.json]

Starts the server as `benchmarks/serve_load.py --mode batch` starts its batched one (SmolLM2,
configs/cpu-small.yaml in fp32, one torch thread, no prefix reuse; `--max-batch 1` for the
unbatched one), keeps `--clients` clients sending its chat prompts with `ignore_eos` (every answer
`--max-tokens` long, so the batch stays full), and once they run, records the server's threads
with `py-spy record` for `--seconds`. Prints and writes the share of the samples spent inside
each named part (inclusive: a part's callees count in it), and the worker's rows per forward
and ms per forward from `/metrics` over the same seconds. py-spy (`pip install py-spy`) reads
the process from outside, so the server runs as it would unprofiled; it needs ptrace rights.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "diagnostics"))

from batch_rounds import cpu_name  # noqa: E402

import serve_load  # noqa: E402

# (label, function as py-spy names it ("*X": any name ending in X), file): shares are of every
# sample of the server process; a part's callees count in it
PARTS = [
    ("worker rounds (Engine._round)", "Engine._round", "engine.py"),
    ("  the model's forwards", "*ForCausalLM.forward", ""),
    ("    linear layers (Linear.forward, the LM head included)", "Linear.forward", "linear.py"),
    ("    RMSNorm", "*RMSNorm.forward", ""),
    ("    rotary embedding", "apply_rotary_pos_emb", ""),
    ("    cache: rows' new K/V handed over (BatchedCache.update)", "BatchedCache.update", "batched.py"),
    ("    cache: a batch's attention (rows_attention)", "rows_attention", "batched.py"),
    ("      the short rows' shared step (_attend_short)", "_attend_short", "batched.py"),
    ("        their padded K/V (_padded_kv)", "_padded_kv", "batched.py"),
    ("        their bookkeeping and appends (FlashLayer.finish_step)", "FlashLayer.finish_step", "flash_layer.py"),
    ("        their parts named, pages held (_row_parts)", "_row_parts", "batched.py"),
    (
        "    cache: a row's own layer steps (FlashLayer.step: prompt chunks; every step unbatched)",
        "FlashLayer.step",
        "flash_layer.py",
    ),
    ("    cache: SDPA calls (sdpa.attention)", "attention", "sdpa.py"),
    ("  sampling and streaming (Engine._emit)", "Engine._emit", "engine.py"),
    ("event loop (HTTP, SSE)", "BaseEventLoop._run_once", "base_events.py"),
]


def _matches(frame: str, fn: str, path: str) -> bool:
    """py-spy's frame `name (path/file.py:line)` is function fn of a file named path."""
    name, _, where = frame.partition(" (")
    if not (name.endswith(fn[1:]) if fn.startswith("*") else name == fn):
        return False
    return not path or where.rsplit(":", 1)[0].endswith("/" + path)


def shares(raw: Path) -> tuple[int, dict[str, float]]:
    """py-spy's raw output (one `frame;frame;... count` line per stack) -> (samples, PARTS' shares)."""
    hits: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        for label, fn, path in PARTS:
            if any(_matches(f, fn, path) for f in frames):
                hits[label] += n
    return total, {label: hits[label] / total if total else 0.0 for label, _, _ in PARTS}


async def load(url: str, clients: int, args: argparse.Namespace, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as c:
        n = 0

        async def client() -> None:
            nonlocal n
            while not stop.is_set():
                n += 1
                prompt = serve_load.BATCH_PROMPTS[n % len(serve_load.BATCH_PROMPTS)]
                r = await serve_load.chat(c, "key-main", prompt, args.max_tokens, args.timeout, ignore_eos=True)
                if r["error"]:
                    raise SystemExit(f"a request failed: {r['error']}")

        await asyncio.gather(*(client() for _ in range(clients)))


async def run(args: argparse.Namespace, py_spy: str) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="flashmem-serve-profile-"))
    keys = tmp / "keys.txt"
    keys.write_text("key-main main\n")
    serve_load.SERVER_DTYPE[0] = args.dtype
    extra = ("--max-batch", str(args.max_batch)) if args.max_batch else ()
    server = serve_load.start_server(args.port, None, str(keys), args.clients, 1, extra)
    url = f"http://127.0.0.1:{args.port}"
    stop = asyncio.Event()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as c:
            await serve_load.wait_up(c, server, time.time() + 600)
            await serve_load.chat(c, "key-main", "Hello.", 2, args.timeout)  # first-forward costs
            clients = asyncio.create_task(load(url, args.clients, args, stop))
            await asyncio.sleep(args.warm_seconds)  # every client in flight, the batch full
            before = (await c.get("/metrics")).text
            t0 = time.perf_counter()
            spy = await asyncio.create_subprocess_exec(
                py_spy, "record", "-p", str(server.pid), "-d", str(args.seconds), "-r", str(args.rate),
                "--format", "raw", "-o", str(tmp / "spy.txt"), "--nonblocking",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await spy.communicate()
            wall = time.perf_counter() - t0
            after = (await c.get("/metrics")).text
            stop.set()
            await clients
        if spy.returncode != 0 or not (tmp / "spy.txt").exists():
            raise SystemExit(f"py-spy failed ({spy.returncode}): {err.decode().strip()[-300:]}")
        samples, parts = shares(tmp / "spy.txt")
    finally:
        serve_load.stop_server(server)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "command": "python benchmarks/diagnostics/serve_profile.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_name(),
        "server": f"flashmem serve, SmolLM2 {args.dtype}, {serve_load.server_config()}, one torch thread"
        + (f", --max-batch {args.max_batch}" if args.max_batch else ""),
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "profiled_seconds": wall,
        "samples": samples,
        "share_of_samples": parts,
        "worker": serve_load.worker_counts(before, after, wall),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=45, help="how long py-spy records")
    ap.add_argument("--warm-seconds", type=float, default=15.0, help="load before recording starts")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-batch", type=int, default=0, help="the server's --max-batch (0: its default)")
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("error: py-spy is not installed; allowed: pip install py-spy")
    out = asyncio.run(run(args, py_spy))
    for label, share in out["share_of_samples"].items():
        print(f"{100 * share:5.1f}%  {label}")
    print(json.dumps(out["worker"]))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
