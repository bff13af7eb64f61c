"""Two `flashmem serve` replicas sharing one Valkey/Redis prefix store, on loopback.

Starts a `valkey-server` (or `redis-server`) with no persistence and two server
processes (`--prefix-store redis://127.0.0.1:PORT/0`, the recipe's config
`configs/cpu-small.yaml`, SmolLM2 by default), then, with greedy streaming chat
requests over one document (`--doc-tokens` of the King James text):

1. cross: replica A answers the document cold (tenant "main"), which stores its
   prefix blocks on the server; replica B answers the same request (tenant
   "main": it restores A's blocks), then cold (tenant "cold": a salt that shares
   nothing), then reused once more. TTFT reused / cold on B, and whether all the
   answers are the same text;
2. breakdown: where the reused request's time goes, measured in this process on
   the same store and keys (look-up, reading the records, checking and decoding
   them, rebuilding the cache, the re-prefilled tail: the last END_TAIL tokens
   when the prompt's end record is stored, as the server stores it), and what a
   full re-prefilled block (the worst tail without an end record, 512 tokens)
   costs at the same depth;
3. outage: A stores a shorter prompt's blocks; then both replicas get a request
   and the store is killed (SIGKILL) while they run; then both answer the
   shorter prompt again. Every request must succeed, the answers must not
   change, and /metrics must count the store as unreachable.

Bounded: a per-request timeout and a total deadline; loopback only. Exit status
1 when a request failed (the cross-replica target is reported, not enforced).

    python benchmarks/serve_replicas.py --out results/serve_replicas_smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Who is speaking in the passage above, and to whom?"
SHORT_QUESTION = "Name one person in the passage above."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def store_binary(given: str | None, ap: argparse.ArgumentParser) -> str:
    """The Valkey/Redis server binary: --store-binary, or valkey-server, or redis-server on PATH."""
    found = given or shutil.which("valkey-server") or shutil.which("redis-server")
    if not found or not shutil.which(found):
        allowed = "allowed: a valkey-server or redis-server binary (apt-get install valkey-server)"
        ap.error(f"--store-binary {given or '(auto)'}: not found; {allowed}")
    return found


def start_store(binary: str, port: int) -> subprocess.Popen[bytes]:
    """A store on loopback with no persistence (records are a cache: a restart may lose them)."""
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"error: {binary} did not start on port {port}")
        time.sleep(0.05)


def start_replica(
    args: argparse.Namespace, port: int, store_url: str, keys: Path, log: Path
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "flashmem.cli.main", "serve", "--model", args.model, "--config", str(args.config)]
    cmd += ["--port", str(port), "--prefix-store", store_url, "--api-keys", str(keys), "--served-name", "m"]
    cmd += ["--threads", str(args.threads), "--max-concurrent", "2", "--max-queue", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with log.open("wb") as f:  # the replica's log, shown when it fails
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)


async def chat(client: httpx.AsyncClient, key: str, content: str, max_tokens: int) -> dict[str, Any]:
    """One streaming greedy chat request: TTFT, text, cached and prompt tokens, status, error."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict[str, Any] = {"ttft_s": None, "text": "", "cached_tokens": None, "prompt_tokens": None}
    out |= {"status": None, "error": None}
    t0 = time.perf_counter()
    try:
        headers = {"Authorization": f"Bearer {key}"}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out["error"] = data["error"]["message"]
                if data.get("usage"):
                    out["cached_tokens"] = data["usage"]["prompt_tokens_details"]["cached_tokens"]
                    out["prompt_tokens"] = data["usage"]["prompt_tokens"]
                for ch in data.get("choices", []):
                    piece = ch["delta"].get("content")
                    if piece:
                        if out["ttft_s"] is None:
                            out["ttft_s"] = time.perf_counter() - t0
                        out["text"] += piece
    except Exception as exc:  # noqa: BLE001 - counted as a failed request of the run
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["wall_s"] = time.perf_counter() - t0
    return out


async def wait_up(client: httpx.AsyncClient, proc: subprocess.Popen[bytes], log: Path, deadline: float) -> None:
    while True:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            tail = log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"error: a replica did not start (exit {proc.poll()}):\n{tail}")
        await asyncio.sleep(0.5)


def code_version() -> dict[str, Any]:
    """Which flashmem ran: its path, and the checkout's commit and changed files (or
    $FLASHMEM_CODE_VERSION, for a copy made with `git archive`)."""
    import flashmem

    out: dict[str, Any] = {"flashmem": str(Path(flashmem.__file__).parent)}
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if head.returncode == 0:
        dirty = subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True, text=True, check=False)
        out |= {"commit": head.stdout.strip(), "changed_under_src": dirty.stdout.split("\n")[:-1]}
    else:
        out["commit"] = os.environ.get("FLASHMEM_CODE_VERSION")
    return out


def watch_rss(pids: dict[str, int], stop: threading.Event, peak: dict[str, int]) -> None:
    """The replicas' peak resident memory (a replica holds the model and its live caches)."""
    import psutil

    procs = {r: psutil.Process(pid) for r, pid in pids.items()}
    while not stop.is_set():
        for r, proc in procs.items():
            try:
                peak[r] = max(peak.get(r, 0), proc.memory_info().rss)
            except psutil.Error:
                pass
        time.sleep(0.2)


def store_memory(url: str) -> dict[str, int]:
    """The store's used memory and key count (what the records of the run take on the server)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return {"used_memory_bytes": int(client.info("memory")["used_memory"]), "keys": int(client.dbsize())}
    finally:
        client.close()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def replica_metrics(text: str) -> dict[str, float]:
    names = ["prefix_hits", "prefix_misses", "prefix_reused_tokens", "prefix_store_unreachable"]
    return {n: metric(text, f"flashmem_{n}_total") for n in names}


# `--model tiny`: a 2-layer random Llama on a small trained BPE (flashmem_eval.tiny), written as
# an HF folder the replicas load, with a config of 32-token blocks and prefill chunks (fast: for
# the mechanics, not for times). The same sizes as the serve tests' model (tests/serve_helpers.py).
TINY_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
TINY_CONFIG = {
    "sink_tokens": 4,
    "gpu_cache_limit": 16,
    "hca_chunk_size": 16,
    "csa_band_tokens": 32,
    "lsa_top_k": 2,
    "prefill_chunk": 32,
    "prefetch_threads": 0,
}


def write_tiny(root: Path) -> tuple[str, Path]:
    """The tiny model as an HF folder and its config YAML under `root`."""
    import yaml

    from flashmem_eval.tiny import TINY_VOCAB, build_llama, tiny_tokenizer

    folder = root / "tiny-llama"
    model = build_llama(0, vocab_size=TINY_VOCAB, **TINY_SIZES)
    model.generation_config.eos_token_id = None  # greedy answers of max_tokens tokens: easier to compare
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    cfg = root / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({"flash_memory": TINY_CONFIG}))
    return str(folder), cfg


def documents(tok: Any, doc_tokens: int, short_tokens: int) -> tuple[str, str, str]:
    """The document, a shorter one for the outage and another for the requests the kill cuts into."""
    from flashmem.texts import haystack

    doc = haystack(tok, doc_tokens, seed=3, name="kjv")
    return doc, haystack(tok, short_tokens, seed=7, name="kjv"), haystack(tok, short_tokens, seed=11, name="kjv")


def breakdown(
    args: argparse.Namespace, model: Any, tok: Any, store_url: str, content: str, salt_tenant: str
) -> dict[str, Any]:
    """Where a reused request's time goes, step by step, in this process against the same store:
    the same model, config, served name and tenant give the same keys as the replicas."""
    import torch

    import flashmem
    from flashmem.config import FlashMemoryConfig
    from flashmem.serve import state
    from flashmem.serve.app import chat_prompt_ids
    from flashmem.serve.auth import salt_for
    from flashmem.serve.engine import Engine
    from flashmem.serve.prefix import chain, decode_record, end_key, end_point
    from flashmem.serve.prefix_remote import NAMESPACE, RedisPrefixStore

    cfg = FlashMemoryConfig.from_yaml(args.config)
    store = RedisPrefixStore(store_url, timeout_s=30.0)
    engine = Engine(model, tok, cfg, model_name="m", prefix_store=store)
    C = engine.block_tokens
    t0 = time.perf_counter()
    ids = chat_prompt_ids(tok, [{"role": "user", "content": content}])
    t_tok = time.perf_counter() - t0
    n = len(ids)
    salt = salt_for(salt_tenant)
    keys = chain(ids, C, engine.fingerprint, salt, limit=(n - 1) // C)
    full = len(keys)
    # the engine's look-up (Engine._admit): the full blocks, then the prompt's end record
    end_at = end_point(n, C)
    want = list(keys)
    if end_at:
        want.append(end_key(keys[-1] if full else "", ids[full * C : end_at], engine.fingerprint, salt))
    t0 = time.perf_counter()
    hit = store.longest(want)
    t_longest = time.perf_counter() - t0
    t0 = time.perf_counter()
    raw = store._client.mget([NAMESPACE + k for k in want[:hit]])  # noqa: SLF001 - the read alone, timed
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    records = [decode_record(k, bytes(v)) for k, v in zip(want[:hit], raw, strict=True)]
    t_decode = time.perf_counter() - t0
    nbytes = sum(len(v) for v in raw)

    def forward(cache: Any, chunk: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            out = model(torch.tensor([chunk]), cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    with torch.inference_mode():
        cache = flashmem.attach(model, cfg)
        t0 = time.perf_counter()
        state.import_records(cache, records)
        t_import = time.perf_counter() - t0
        pos = end_at if hit > full else hit * C
        t0 = time.perf_counter()
        logits = None
        while pos < n:  # the server's chunks: block-aligned from 0, split at the end point
            e = min(pos + C, n)
            e = end_at if pos < end_at < e else e
            logits = forward(cache, ids[pos:e])
            pos = e
        t_tail = time.perf_counter() - t0
        assert logits is not None
        first = tok.decode([int(logits.argmax())], skip_special_tokens=True)
        t0 = time.perf_counter()
        forward(cache, [int(logits.argmax())])
        t_step = time.perf_counter() - t0
        rep = cache.memory_report()  # one sequence's cache while it decodes (selection is on from here)
        memory = {k: rep[k] for k in ("tokens_seen", "device_resident_bytes", "full_cache_bytes", "cold_bytes")}
        memory["fraction_of_full"] = rep["fraction_of_full"]
        cache.close()
        # The worst tail without an end record: every block but the last restored, the last
        # one (C tokens) prefilled.
        full_block = None
        blocks = min(hit, full)
        if blocks >= 2:
            cache = flashmem.attach(model, cfg)
            t0 = time.perf_counter()
            state.import_records(cache, records[: blocks - 1])
            t_import_w = time.perf_counter() - t0
            t0 = time.perf_counter()
            forward(cache, ids[(blocks - 1) * C : blocks * C])
            full_block = {
                "restored_tokens": (blocks - 1) * C,
                "import_s": t_import_w,
                "prefill_s": time.perf_counter() - t0,
            }
            cache.close()
    store.close()
    return {
        "prompt_tokens": n,
        "block_tokens": C,
        "reused_tokens": end_at if hit > full else hit * C,
        "end_record": hit > full,
        "tail_tokens": n - (end_at if hit > full else hit * C),
        "record_bytes": nbytes,
        "tokenize_s": t_tok,
        "lookup_s": t_longest,
        "read_s": t_read,
        "check_and_decode_s": t_decode,
        "import_s": t_import,
        "tail_prefill_s": t_tail,
        "first_decode_step_s": t_step,
        "first_token_text": first,
        "restore_total_s": t_longest + t_read + t_decode + t_import,
        "sequence_memory_at_first_decode_step": memory,
        "full_block_tail": full_block,
    }


async def cross_phase(clients: dict[str, httpx.AsyncClient], doc: str, args: argparse.Namespace) -> dict[str, Any]:
    prompt = f"{doc}\n\n{QUESTION}"
    print("cross: A cold (stores the document)...", file=sys.stderr, flush=True)
    a_cold = await chat(clients["A"], "key-main", prompt, args.max_tokens)
    print(f"  A cold TTFT {a_cold['ttft_s']}; B reused...", file=sys.stderr, flush=True)
    b_reused = await chat(clients["B"], "key-main", prompt, args.max_tokens)
    print(f"  B reused TTFT {b_reused['ttft_s']}; B cold...", file=sys.stderr, flush=True)
    b_cold = await chat(clients["B"], "key-cold", prompt, args.max_tokens)
    print(f"  B cold TTFT {b_cold['ttft_s']}; B reused again...", file=sys.stderr, flush=True)
    b_again = await chat(clients["B"], "key-main", prompt, args.max_tokens)
    runs = {"A_cold": a_cold, "B_reused": b_reused, "B_cold": b_cold, "B_reused_again": b_again}
    texts = {r["text"] for r in runs.values()}
    ratio = None
    if b_reused["ttft_s"] and b_cold["ttft_s"]:
        ratio = b_reused["ttft_s"] / b_cold["ttft_s"]
    return {
        "prompt": "the document, two newlines, then: " + QUESTION,
        "runs": runs,
        "ttft_B_reused_over_B_cold": ratio,
        "ttft_B_reused_again_over_B_cold": b_again["ttft_s"] / b_cold["ttft_s"]
        if b_again["ttft_s"] and b_cold["ttft_s"]
        else None,
        "ttft_B_reused_over_A_cold": b_reused["ttft_s"] / a_cold["ttft_s"]
        if b_reused["ttft_s"] and a_cold["ttft_s"]
        else None,
        "target": 0.1,
        "target_met": ratio is not None and ratio <= 0.1,
        "answers_identical": len(texts) == 1 and all(r["error"] is None for r in runs.values()),
    }


async def outage_phase(
    clients: dict[str, httpx.AsyncClient],
    store: subprocess.Popen[bytes],
    short: str,
    other: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    p_short, p_other = f"{short}\n\n{SHORT_QUESTION}", f"{other}\n\n{SHORT_QUESTION}"
    print("outage: A stores a shorter prompt; B reuses it...", file=sys.stderr, flush=True)
    before = {
        "A": await chat(clients["A"], "key-main", p_short, args.max_tokens),
        "B": await chat(clients["B"], "key-main", p_short, args.max_tokens),
    }
    print(f"  killing the store {args.kill_after} s into two requests...", file=sys.stderr, flush=True)
    tasks = {r: asyncio.create_task(chat(clients[r], "key-main", p_other, args.max_tokens)) for r in ("A", "B")}
    await asyncio.sleep(args.kill_after)
    in_flight = sum(not t.done() for t in tasks.values())
    store.send_signal(signal.SIGKILL)
    store.wait(timeout=10)
    during = {r: await t for r, t in tasks.items()}
    print("  store dead; both replicas again...", file=sys.stderr, flush=True)
    after = {r: await chat(clients[r], "key-main", p_short, args.max_tokens) for r in ("A", "B")}
    metrics = {r: replica_metrics((await clients[r].get("/metrics")).text) for r in ("A", "B")}
    every = [*before.values(), *during.values(), *after.values()]
    return {
        "kill_after_s": args.kill_after,
        "requests_in_flight_at_kill": in_flight,
        "before": before,
        "during": during,
        "after": after,
        "metrics_after": metrics,
        "requests": len(every),
        "failed_requests": sum(1 for r in every if r["error"] is not None or r["status"] != 200),
        "answers_unchanged": len({r["text"] for r in [*before.values(), *after.values()]}) == 1
        and len({r["text"] for r in during.values()}) == 1,
        "reused_after_kill": sum(r["cached_tokens"] or 0 for r in after.values()),
        "unreachable_counted_on_both": all(m["prefix_store_unreachable"] > 0 for m in metrics.values()),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    binary = args.store_binary
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    import torch

    import flashmem

    torch.set_num_threads(args.threads)
    model, tok = flashmem.load_model(args.model)  # the texts' token counts, and the breakdown
    doc, short, other = documents(tok, args.doc_tokens, args.short_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="flashmem-serve-replicas-"))
    keys = tmp / "keys.txt"
    keys.write_text("key-main main\nkey-cold cold\n")
    store_port = free_port()
    store_url = f"redis://127.0.0.1:{store_port}/0"
    store = start_store(binary, store_port)
    ports = {"A": free_port(), "B": free_port()}
    procs = {r: start_replica(args, p, store_url, keys, tmp / f"{r}.log") for r, p in ports.items()}
    deadline = time.time() + args.deadline
    result: dict[str, Any] = {}
    stop, peak = threading.Event(), dict[str, int]()
    threading.Thread(target=watch_rss, args=({r: p.pid for r, p in procs.items()}, stop, peak), daemon=True).start()
    try:
        timeout = httpx.Timeout(args.timeout, connect=10.0)
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports['A']}", timeout=timeout) as ca,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports['B']}", timeout=timeout) as cb,
        ):
            clients = {"A": ca, "B": cb}
            for r in ("A", "B"):
                await wait_up(clients[r], procs[r], tmp / f"{r}.log", deadline)
            print("replicas up; warm-up...", file=sys.stderr, flush=True)
            warm = [await chat(clients[r], "key-main", "Hello.", 2) for r in ("A", "B")]
            result["cross"] = await cross_phase(clients, doc, args)
            result["store_after_cross"] = store_memory(store_url)
            if not args.no_breakdown:
                print("breakdown of the reused request, in this process...", file=sys.stderr, flush=True)
                bd = breakdown(args, model, tok, store_url, f"{doc}\n\n{QUESTION}", "main")
                bd["first_token_is_the_answers"] = result["cross"]["runs"]["B_reused"]["text"].startswith(
                    bd["first_token_text"]
                )
                result["breakdown"] = bd
            result["outage"] = await outage_phase(clients, store, short, other, args)
            result["warm_up_errors"] = [w["error"] for w in warm if w["error"]]
            alive = {r: p.poll() is None for r, p in procs.items()}
    finally:
        stop.set()
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        if store.poll() is None:
            store.kill()
            store.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    cross, outage = result["cross"], result["outage"]
    errors = [f"warm-up: {e}" for e in result["warm_up_errors"]]
    errors += [f"cross {n}: {r['error']}" for n, r in cross["runs"].items() if r["error"]]
    for phase in ("before", "during", "after"):
        errors += [f"outage {phase} {n}: {r['error']}" for n, r in outage[phase].items() if r["error"]]
    return {
        "command": "python benchmarks/serve_replicas.py " + " ".join(sys.argv[1:]),
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "code": code_version(),
        "model": args.model_shown,
        "config": args.config_shown,
        "store": version,
        "replicas": "2 processes, flashmem serve --prefix-store redis://127.0.0.1:PORT/0, loopback",
        "replica_torch_threads": args.threads,
        "max_tokens": args.max_tokens,
        "doc_tokens_requested": args.doc_tokens,
        **result,
        "replicas_alive_at_end": alive,
        "replica_peak_rss_bytes": peak,
        "errors": errors,
        "error_count": len(errors),
        "cpu_count": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="built-in name, HF folder, or tiny (both replicas)")
    ap.add_argument("--config", type=Path, default=None, help="default: configs/cpu-small.yaml (tiny: its own)")
    ap.add_argument("--doc-tokens", type=int, default=7700, help="tokens of the shared document")
    ap.add_argument("--short-tokens", type=int, default=1100, help="tokens of the outage phase's prompts")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kill-after", type=float, default=2.0, help="seconds into the outage requests")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each replica (and the breakdown)")
    ap.add_argument("--store-binary", default=None, help="valkey-server or redis-server (default: found on PATH)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the in-process timing of the reuse")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a request may wait for a byte")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds for both replicas to start")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    for flag, v in (("--doc-tokens", args.doc_tokens), ("--short-tokens", args.short_tokens)):
        if v < 1:
            ap.error(f"{flag} {v}: allowed: a positive number of tokens")
    if args.config is not None and not args.config.is_file():
        ap.error(f"--config {args.config}: no such file; allowed: a FlashMemory YAML such as configs/cpu-small.yaml")
    args.store_binary = store_binary(args.store_binary, ap)
    args.model_shown, args.config_shown = args.model, str(args.config or "configs/cpu-small.yaml")
    with tempfile.TemporaryDirectory(prefix="flashmem-tiny-") as tiny_root:
        if args.model == "tiny":
            args.model, tiny_cfg = write_tiny(Path(tiny_root))
            args.model_shown = "tiny (2-layer random Llama, benchmarks/serve_replicas.py TINY_SIZES)"
            if args.config is None:
                args.config, args.config_shown = tiny_cfg, f"TINY_CONFIG {TINY_CONFIG}"
        args.config = args.config or ROOT / "configs" / "cpu-small.yaml"
        result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if result["error_count"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
