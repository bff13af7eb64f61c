"""Load test of `flashmem serve` on loopback: prefix reuse under concurrent clients.

Starts the server (SmolLM2-135M, configs/cpu-small.yaml, a fresh prefix folder)
as a subprocess, then, with greedy decoding and streaming chat requests:

1. cold: one question over the shared document (about 7.7K tokens of the King
   James text) under tenant "main": a full prefill that stores the prefix;
2. load: K concurrent clients run the other questions over the same document
   (tenant "main": they reuse the stored prefix) mixed with unrelated short prompts;
3. ratio: a few questions again, one at a time, each both cold (a fresh tenant
   whose salt shares nothing) and reused (tenant "main"); TTFT reused / cold and
   whether the answers are identical.

Bounded: request count, per-request timeout and a total deadline; loopback only.
Reports throughput, p50/p99 TTFT and inter-token latency, prefix hit rate,
errors (must be 0) and the server's peak RSS, as JSON (--out).

    python benchmarks/serve_load.py --out results/serve_load_smollm2.json

`--mode batch`: continuous batching, batched against unbatched in the same run.
Two servers in turn (no prefix reuse): `--max-batch 1 --restore-on-worker` (the
engine before batching: one forward per sequence per round) and the default (every
decode step of a round in one forward); each serves 1, 4 and 8 concurrent clients
(short chat prompts of different lengths, greedy, `--max-tokens` each,
`--batch-requests` per client; with `--ignore-eos` every answer runs to `--max-tokens`, the
fixed answer lengths of vLLM's `vllm bench serve --ignore-eos`, instead of ending at the
model's EOS); aggregate generated tokens/s, TTFT and inter-token
p50/p99 per point, and the answers of the two servers compared. Beside the whole run's
tokens/s, `busy_pieces_per_s`: streamed pieces (about one a token) per second while every
client still had a request in flight (until the last request was sent; after it, clients
whose work is done drop out and the batch thins, which a server under steady load does not see).

    python benchmarks/serve_load.py --mode batch --out results/serve_load_batch_smollm2.json

`--mode restore`: the stall a prefix restore costs the other streams. A document
of `--doc-tokens` is stored once; then, for a server restoring on the worker thread
(`--restore-on-worker`, as before) and one restoring on its helper thread (the
default), a long answer streams while the document is asked again (restored):
the streaming answer's largest inter-token gap while the restore is under way,
beside its median gap.

    python benchmarks/serve_load.py --mode restore --out results/serve_load_restore_smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "Who wrote the letter above, and to whom?",
    "Summarise the passage above in one sentence.",
    "Which city is named most often above?",
    "What does the passage above say about faith?",
    "List three people named in the passage above.",
    "What is the last sentence of the passage above?",
    "Does the passage above mention a king? Which one?",
    "What is the tone of the passage above?",
    "Name one command given in the passage above.",
    "What is the first word of the passage above?",
]
UNRELATED = [
    "Write a haiku about the sea.",
    "What is 17 times 3?",
    "Give me a name for a cat.",
    "Translate 'good morning' into French.",
    "What colour is the sky on Mars?",
    "Name a prime number larger than 50.",
]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def chat(
    client: httpx.AsyncClient, key: str, content: str, max_tokens: int, timeout: float, **extra: Any
) -> dict[str, Any]:
    """One streaming chat request: TTFT, inter-token gaps, text, cached tokens, error. `extra`:
    more request fields (ignore_eos)."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    t0 = time.perf_counter()
    out: dict[str, Any] = {"ttft": None, "gaps": [], "text": "", "cached": 0, "tokens": 0, "error": None}
    out["times"] = []  # when each streamed piece arrived (perf_counter)
    last = None
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        ) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out["error"] = data["error"]["message"]
                    continue
                if data.get("usage"):
                    out["cached"] = data["usage"]["prompt_tokens_details"]["cached_tokens"]
                    out["tokens"] = data["usage"]["completion_tokens"]
                    out["prompt_tokens"] = data["usage"]["prompt_tokens"]
                for ch in data["choices"]:
                    piece = ch["delta"].get("content")
                    if piece:
                        now = time.perf_counter()
                        if out["ttft"] is None:
                            out["ttft"] = now - t0
                        elif last is not None:
                            out["gaps"].append(now - last)
                        last = now
                        out["times"].append(now)
                        out["text"] += piece
    except Exception as exc:  # noqa: BLE001 - counted as an error of the run
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["wall"] = time.perf_counter() - t0
    return out


def document(n_tokens: int) -> str:
    import flashmem
    from flashmem.texts import haystack

    _, tok = flashmem.load_model("smollm2")
    return haystack(tok, n_tokens, seed=3, name="kjv")


SERVER_MODEL = ["smollm2"]  # --model: what the server loads (it serves it as "smollm2")
SERVER_DTYPE = ["float32"]  # --dtype: other than float32, the server sizes the recipe for it (no --config)
SERVER_LAYOUT = ["auto"]  # --weight-layout: the servers' linear weights (flashmem.models.weight_layout)


def server_config() -> str:
    """What config the servers run: the file for float32, else the recipe they size for the dtype."""
    if SERVER_DTYPE[0] == "float32":
        return "configs/cpu-small.yaml"
    return f"the recipe at 1/8 of 8K for {SERVER_DTYPE[0]} (flashmem serve --dtype {SERVER_DTYPE[0]}, no --config)"


def start_server(
    port: int, prefix_dir: str | None, keys_file: str, max_concurrent: int, threads: int, extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """`flashmem serve` on loopback; prefix_dir None: no prefix reuse; extra: more flags."""
    cmd = [sys.executable, "-m", "flashmem.cli.main", "serve", "--model", SERVER_MODEL[0], "--served-name", "smollm2"]
    if SERVER_DTYPE[0] == "float32":
        cmd += ["--config", str(ROOT / "configs" / "cpu-small.yaml")]
    else:  # configs/cpu-small.yaml is the recipe for float32; the server sizes it for the dtype's bytes
        cmd += ["--dtype", SERVER_DTYPE[0]]
    cmd += ["--port", str(port)]
    cmd += ["--prefix-dir", prefix_dir] if prefix_dir is not None else ["--no-prefix-cache"]
    cmd += ["--api-keys", keys_file, "--max-concurrent", str(max_concurrent), "--max-queue", "64"]
    cmd += ["--threads", str(threads), "--weight-layout", SERVER_LAYOUT[0], *extra]
    return subprocess.Popen(cmd, cwd=ROOT)


async def wait_up(client: httpx.AsyncClient, server: subprocess.Popen[bytes], deadline: float) -> None:
    while True:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.time() > deadline:
            raise SystemExit("the server did not start")
        await asyncio.sleep(0.5)


def stop_server(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


def watch_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        try:
            peak[0] = max(peak[0], proc.memory_info().rss)
        except psutil.Error:
            return
        time.sleep(0.2)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    doc = document(args.doc_tokens)
    prompt = lambda q: f"{doc}\n\nQuestion: {q}"  # noqa: E731
    tmp = tempfile.mkdtemp(prefix="flashmem-serve-load-")
    keys = Path(tmp) / "keys.txt"
    n_ratio = args.ratio_questions
    keys.write_text("key-main main\n" + "".join(f"key-cold{i} cold{i}\n" for i in range(n_ratio)))
    port = args.port
    server = start_server(port, str(Path(tmp) / "prefix"), str(keys), args.clients, args.threads)
    stop, peak = threading.Event(), [0]
    threading.Thread(target=watch_rss, args=(server.pid, stop, peak), daemon=True).start()
    deadline = time.time() + args.deadline
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=args.timeout) as client:
            await wait_up(client, server, deadline)
            print("server up; warm-up and cold request...", file=sys.stderr, flush=True)
            await chat(client, "key-main", "Hello.", 2, args.timeout)  # first-forward costs, not counted
            cold_first = await chat(client, "key-main", prompt(QUESTIONS[0]), args.max_tokens, args.timeout)

            # Load: K clients share a queue of reuse questions and unrelated prompts.
            reuse_work = [("reuse", q, prompt(q)) for q in QUESTIONS[1:]]
            other_work = [("unrelated", q, q) for q in UNRELATED]
            work = [w for i in range(len(reuse_work)) for w in (reuse_work[i : i + 1] + other_work[i : i + 1])]
            queue: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
            for w in work[: args.requests]:
                queue.put_nowait(w)
            results: list[dict[str, Any]] = []

            async def client_loop() -> None:
                while not queue.empty() and time.time() < deadline:
                    kind, q, content = queue.get_nowait()
                    r = await chat(client, "key-main", content, args.max_tokens, args.timeout)
                    results.append({**r, "kind": kind, "question": q})

            print(f"load: {args.clients} clients, {queue.qsize()} requests...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            await asyncio.gather(*(client_loop() for _ in range(args.clients)))
            load_s = time.perf_counter() - t0

            # Reused vs cold, one request at a time, same questions.
            print("ratio: cold vs reused, sequential...", file=sys.stderr, flush=True)
            pairs = []
            for i, q in enumerate(QUESTIONS[1 : 1 + n_ratio]):
                cold = await chat(client, f"key-cold{i}", prompt(q), args.max_tokens, args.timeout)
                warm = await chat(client, "key-main", prompt(q), args.max_tokens, args.timeout)
                pairs.append(
                    {
                        "question": q,
                        "cold_ttft_s": cold["ttft"],
                        "reused_ttft_s": warm["ttft"],
                        "cold_cached_tokens": cold["cached"],
                        "reused_cached_tokens": warm["cached"],
                        "prompt_tokens": warm.get("prompt_tokens"),
                        "same_answer": cold["text"] == warm["text"] and cold["error"] is None,
                        "answer": warm["text"],
                        "errors": [e for e in (cold["error"], warm["error"]) if e],
                    }
                )
            metrics = (await client.get("/metrics")).text
    finally:
        stop.set()
        stop_server(server)
        shutil.rmtree(tmp, ignore_errors=True)  # the stored prefixes (hundreds of MB)
    hits = _metric(metrics, "flashmem_prefix_hits_total")
    misses = _metric(metrics, "flashmem_prefix_misses_total")
    done = [r for r in results if r["error"] is None]
    reuse = [r for r in done if r["kind"] == "reuse"]
    gaps = [g for r in done for g in r["gaps"]]
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
    cold_t = [p["cold_ttft_s"] for p in pairs if p["cold_ttft_s"]]
    warm_t = [p["reused_ttft_s"] for p in pairs if p["reused_ttft_s"]]
    errors = [r["error"] for r in results if r["error"]] + [e for p in pairs for e in p["errors"]]
    errors += [cold_first["error"]] if cold_first["error"] else []
    return {
        "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:]),
        "model": f"{args.model} ({args.dtype}, CPU)",
        "config": server_config(),
        "doc_tokens_requested": args.doc_tokens,
        "prompt_tokens_with_question": cold_first.get("prompt_tokens"),
        "clients": args.clients,
        "server_torch_threads": args.threads,
        "server_dtype": args.dtype,
        "server_weight_layout": args.weight_layout,
        "max_tokens": args.max_tokens,
        "cold_first_request": {"ttft_s": cold_first["ttft"], "answer": cold_first["text"]},
        "load": {
            "requests": len(results),
            "completed": len(done),
            "wall_s": load_s,
            "generated_tokens": sum(r["tokens"] for r in done),
            "throughput_tokens_per_s": sum(r["tokens"] for r in done) / load_s if load_s else None,
            "ttft_s": {"p50": pct(ttfts, 50), "p99": pct(ttfts, 99)},
            "ttft_reuse_s": {"p50": pct([r["ttft"] for r in reuse if r["ttft"]], 50)},
            "ttft_unrelated_s": {"p50": pct([r["ttft"] for r in done if r["kind"] == "unrelated" and r["ttft"]], 50)},
            "inter_token_s": {"p50": pct(gaps, 50), "p99": pct(gaps, 99)},
            "reuse_requests_with_cached_tokens": sum(1 for r in reuse if r["cached"] > 0),
            "reuse_requests": len(reuse),
        },
        "prefix_hit_rate": hits / (hits + misses) if hits + misses else None,
        "prefix_hits": hits,
        "prefix_misses": misses,
        "ratio": {
            "pairs": pairs,
            "cold_ttft_mean_s": statistics.mean(cold_t) if cold_t else None,
            "reused_ttft_mean_s": statistics.mean(warm_t) if warm_t else None,
            "reused_over_cold": statistics.mean(warm_t) / statistics.mean(cold_t) if cold_t and warm_t else None,
            "answers_identical": all(p["same_answer"] for p in pairs),
        },
        "errors": errors,
        "error_count": len(errors),
        "server_peak_rss_bytes": peak[0],
        "cpu_count": os.cpu_count(),
    }


# ---------------------------------------------------------------- --mode batch
# Short chat prompts of different lengths: decoding dominates, as in a chat server.
BATCH_PROMPTS = (
    UNRELATED
    + [q.replace(" above", "") for q in QUESTIONS]
    + [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain in simple words how a rainbow forms after the rain.",
    ]
)
SERVERS = {  # name -> extra serve flags
    "unbatched": ("--max-batch", "1", "--restore-on-worker"),  # the engine before batching
    "batched": (),
}


def summarize(results: list[dict[str, Any]], wall: float, busy: tuple[float, float] | None = None) -> dict[str, Any]:
    """busy: (start, end) of the time every client had a request in flight (the work queue
    not yet empty): the streamed pieces (about one a token) that arrived in it, per second."""
    done = [r for r in results if r["error"] is None]
    gaps = [g for r in done for g in r["gaps"]]
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in done)
    busy_rate = None
    if busy is not None and busy[1] > busy[0]:
        pieces = sum(1 for r in done for t in r["times"] if busy[0] <= t <= busy[1])
        busy_rate = pieces / (busy[1] - busy[0])
    return {
        "requests": len(results),
        "completed": len(done),
        "wall_s": wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else None,
        "busy_s": None if busy is None else busy[1] - busy[0],
        "busy_pieces_per_s": busy_rate,
        "ttft_s": {"p50": pct(ttfts, 50), "p99": pct(ttfts, 99)},
        "inter_token_s": {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "max": max(gaps, default=None)},
    }


async def batch_point(client: httpx.AsyncClient, clients: int, args: argparse.Namespace) -> dict[str, Any]:
    """`clients` concurrent clients, `--batch-requests` requests each (prompts in turn)."""
    work = [BATCH_PROMPTS[i % len(BATCH_PROMPTS)] for i in range(clients * args.batch_requests)]
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for i, w in enumerate(work):
        queue.put_nowait((i, w))
    results: list[dict[str, Any]] = []
    drained: list[float] = []  # when the last request was taken: from then on clients drop out

    async def client_loop() -> None:
        while not queue.empty():
            i, content = queue.get_nowait()
            if queue.empty():
                drained.append(time.perf_counter())
            extra = {"ignore_eos": True} if args.ignore_eos else {}
            r = await chat(client, "key-main", content, args.max_tokens, args.timeout, **extra)
            results.append({**r, "i": i})

    before = (await client.get("/metrics")).text
    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    wall = time.perf_counter() - t0
    point = summarize(results, wall, (t0, drained[0]) if drained else None)
    point["worker"] = worker_counts(before, (await client.get("/metrics")).text, wall)
    point["answers"] = {r["i"]: r["text"] for r in results}
    point["errors"] = [r["error"] for r in results if r["error"]]
    return point


async def batch_async(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="flashmem-serve-batch-")
    keys = Path(tmp) / "keys.txt"
    keys.write_text("key-main main\n")
    levels = [int(c) for c in args.batch_clients.split(",")]
    runs: dict[str, Any] = {name: {} for name in SERVERS}
    # Both servers up at once, their points alternating (unbatched then batched at each level):
    # the box's speed drifts over minutes, and a point is compared with its twin run next to it,
    # not with one run minutes before. The idle server waits on a condition (no CPU).
    servers: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for j, (name, extra) in enumerate(SERVERS.items()):
            servers[name] = start_server(args.port + j, None, str(keys), max(levels), args.threads, extra)
        clients = {
            name: httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port + j}", timeout=args.timeout)
            for j, name in enumerate(SERVERS)
        }
        try:
            for name, c in clients.items():
                await wait_up(c, servers[name], time.time() + args.deadline)
                await chat(c, "key-main", "Hello.", 2, args.timeout)  # first-forward costs, not counted
            for k in levels:
                for name, c in clients.items():
                    print(f"{name}: {k} clients...", file=sys.stderr, flush=True)
                    runs[name][str(k)] = await batch_point(c, k, args)
        finally:
            for c in clients.values():
                await c.aclose()
    finally:
        for server in servers.values():
            stop_server(server)
        shutil.rmtree(tmp, ignore_errors=True)
    errors = [e for run in runs.values() for p in run.values() for e in p["errors"]]
    same = all(runs["batched"][str(k)]["answers"] == runs["unbatched"][str(k)]["answers"] for k in levels)
    # per point: answers equal between the two servers, of those both gave (fp32 batches are
    # bit-exact; bf16 GEMMs round differently by batch shape, so greedy answers can part)
    same_count = {
        str(k): [
            sum(
                a == runs["unbatched"][str(k)]["answers"].get(i) for i, a in runs["batched"][str(k)]["answers"].items()
            ),
            len(runs["batched"][str(k)]["answers"]),
        ]
        for k in levels
    }
    speedup = {
        str(k): runs["batched"][str(k)]["tokens_per_s"] / runs["unbatched"][str(k)]["tokens_per_s"]
        for k in levels
        if runs["unbatched"][str(k)]["tokens_per_s"]
    }
    busy_speedup = {
        str(k): runs["batched"][str(k)]["busy_pieces_per_s"] / runs["unbatched"][str(k)]["busy_pieces_per_s"]
        for k in levels
        if runs["unbatched"][str(k)]["busy_pieces_per_s"] and runs["batched"][str(k)]["busy_pieces_per_s"]
    }
    top = str(max(levels))
    for run in runs.values():
        for p in run.values():
            p.pop("answers")
    return {
        "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:]),
        "model": f"{args.model} ({args.dtype}, CPU)",
        "config": server_config(),
        "servers": {name: " ".join(["flashmem serve --no-prefix-cache", *extra]) for name, extra in SERVERS.items()},
        "schedule": "both servers up at once (--port and --port + 1), points alternating: unbatched then batched at each level",
        "server_torch_threads": args.threads,
        "server_dtype": args.dtype,
        "server_weight_layout": args.weight_layout,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "requests_per_client": args.batch_requests,
        "runs": runs,
        "batched_over_unbatched_tokens_per_s": speedup,
        # the same while every client had a request in flight (no tail of clients done early)
        "batched_over_unbatched_busy": busy_speedup,
        "p99_inter_token_batched_over_unbatched": {
            str(k): runs["batched"][str(k)]["inter_token_s"]["p99"] / runs["unbatched"][str(k)]["inter_token_s"]["p99"]
            for k in levels
            if runs["unbatched"][str(k)]["inter_token_s"]["p99"] and runs["batched"][str(k)]["inter_token_s"]["p99"]
        },
        "target_met": bool(
            speedup.get(top, 0) >= 4
            and (runs["batched"][top]["inter_token_s"]["p99"] or 0)
            <= (runs["unbatched"][top]["inter_token_s"]["p99"] or 0)
        ),
        "answers_identical": same,
        "answers_same_of_all": same_count,
        "errors": errors,
        "error_count": len(errors),
        "cpu_count": os.cpu_count(),
    }


# ---------------------------------------------------------------- --mode restore
STREAM_PROMPT = "Count from one to two hundred in words, separated by commas."


async def restore_async(args: argparse.Namespace) -> dict[str, Any]:
    """Store a document, then per server: stream a long answer, ask the document again
    while it streams, and take the stream's gaps while the restore is under way."""
    doc = document(args.doc_tokens)
    prompt = f"{doc}\n\nQuestion: {QUESTIONS[1]}"
    tmp = tempfile.mkdtemp(prefix="flashmem-serve-restore-")
    keys = Path(tmp) / "keys.txt"
    keys.write_text("key-main main\n")
    prefix = str(Path(tmp) / "prefix")  # shared by both servers: stored once
    out: dict[str, Any] = {}
    errors: list[str] = []
    try:
        for i, (name, extra) in enumerate((("on_worker", ("--restore-on-worker",)), ("off_thread", ()))):
            server = start_server(args.port, prefix, str(keys), 2, args.threads, extra)
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=args.timeout) as c:
                    await wait_up(c, server, time.time() + args.deadline)
                    await chat(c, "key-main", "Hello.", 2, args.timeout)
                    if i == 0:
                        print("storing the document (cold prefill)...", file=sys.stderr, flush=True)
                        cold = await chat(c, "key-main", prompt, 1, args.timeout)
                        out["cold_ttft_s"] = cold["ttft"]
                        errors += [cold["error"]] if cold["error"] else []
                    print(f"{name}: a stream and a restore...", file=sys.stderr, flush=True)
                    out[name] = await restore_point(c, prompt, args)
                    errors += out[name].pop("errors")
            finally:
                stop_server(server)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:]),
        "model": f"{args.model} ({args.dtype}, CPU)",
        "config": server_config(),
        "doc_tokens_requested": args.doc_tokens,
        "server_torch_threads": args.threads,
        "server_dtype": args.dtype,
        "server_weight_layout": args.weight_layout,
        **out,
        "errors": errors,
        "error_count": len(errors),
        "cpu_count": os.cpu_count(),
    }


async def restore_point(c: httpx.AsyncClient, prompt: str, args: argparse.Namespace) -> dict[str, Any]:
    """The stream's token times, with the reused request sent after its 4th token."""
    times: list[float] = []
    started = asyncio.Event()
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": STREAM_PROMPT}],
        "max_tokens": args.stream_tokens,
        "temperature": 0,
        "stream": True,
    }

    async def stream() -> None:
        try:
            async with c.stream(
                "POST", "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-main"}
            ) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if choices[0].get("delta", {}).get("content"):
                        times.append(time.perf_counter())
                        if len(times) == 4:
                            started.set()
        finally:
            started.set()  # a stream that ended early does not hold the run

    task = asyncio.create_task(stream())
    await asyncio.wait_for(started.wait(), args.timeout)
    t_send = time.perf_counter()
    reused = await chat(c, "key-main", prompt, 1, args.timeout)
    t_first = t_send + (reused["ttft"] or 0.0)
    await task
    gaps = [(b - a, a, b) for a, b in zip(times, times[1:])]
    # gaps that overlap the reused request's admission, restore and tail prefill
    during = [g for g, a, b in gaps if b > t_send and a < t_first]
    before = [g for g, a, b in gaps if b <= t_send]
    return {
        "reused_ttft_s": reused["ttft"],
        "reused_cached_tokens": reused["cached"],
        "stream_tokens": len(times),
        "stream_gap_p50_before_s": pct(before, 50),
        "stream_max_gap_during_restore_s": max(during, default=None),
        "stream_gaps_during_restore_s": during,
        "errors": [reused["error"]] if reused["error"] else [],
    }


def worker_counts(before: str, after: str, wall: float) -> dict[str, float | None]:
    """The server worker's rounds over a point, from its /metrics before and after: decode
    rows per forward, ms per such forward, and the share of the point's wall time in rounds."""
    d = {n: _metric(after, f"flashmem_{n}_total") - _metric(before, f"flashmem_{n}_total")
         for n in ("decode_forwards", "decode_rows", "decode_forward_seconds", "worker_busy_seconds")}  # fmt: skip
    forwards = d["decode_forwards"]
    return {
        "decode_forwards": forwards,
        "rows_per_forward": d["decode_rows"] / forwards if forwards else None,
        "ms_per_decode_forward": 1e3 * d["decode_forward_seconds"] / forwards if forwards else None,
        "worker_busy_share": d["worker_busy_seconds"] / wall if wall else None,
    }


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["reuse", "batch", "restore"], default="reuse")
    ap.add_argument("--model", default="smollm2", help="what the server loads (a built-in name or an HF folder)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=15, help="requests of the load phase (at most 15)")
    ap.add_argument("--doc-tokens", type=int, default=7700)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ratio-questions", type=int, default=1)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds of silence a request waits")
    ap.add_argument("--deadline", type=float, default=3000.0, help="seconds for the load phase")
    # One torch thread: on this shared 2-core machine two threads ran a 256-token
    # SmolLM2 chunk in ~35 s against ~4 s for one (oversubscribed OpenMP spinning).
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the servers' model dtype"
    )
    ap.add_argument(
        "--weight-layout", default="auto", choices=["auto", "out_major", "in_major", "onednn"],
        help="the servers' linear weights in memory (flashmem serve --weight-layout)",
    )  # fmt: skip
    ap.add_argument("--batch-clients", default="1,4,8", help="--mode batch: concurrent clients, comma-separated")
    ap.add_argument("--batch-requests", type=int, default=2, help="--mode batch: requests per client")
    ap.add_argument(
        "--ignore-eos", action="store_true",
        help="--mode batch: every answer runs to --max-tokens (the server's ignore_eos, as vLLM's load generators send it)",
    )  # fmt: skip
    ap.add_argument("--stream-tokens", type=int, default=96, help="--mode restore: tokens of the streaming answer")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    SERVER_MODEL[0] = args.model
    SERVER_DTYPE[0] = args.dtype
    SERVER_LAYOUT[0] = args.weight_layout
    run = {"reuse": main_async, "batch": batch_async, "restore": restore_async}[args.mode]
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if result["error_count"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
