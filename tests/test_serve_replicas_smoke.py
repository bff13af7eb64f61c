"""Smoke test of benchmarks/serve_replicas.py: a real `valkey-server`/`redis-server` and two
`flashmem serve` processes on the tiny random Llama (`--model tiny`: an HF folder it writes), a short
document. The report must show B reusing A's blocks with A's answer, and both replicas
answering every request after the store is killed, the outage counted in /metrics.
Skips, saying why, when neither server binary is installed (`.ci/run` installs one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("redis")
pytest.importorskip("prometheus_client")

from flashmem.serve.prefix import end_point  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVER = shutil.which("valkey-server") or shutil.which("redis-server")


def test_serve_replicas_on_the_tiny_model(tmp_path: Path) -> None:
    if SERVER is None:
        pytest.skip("neither valkey-server nor redis-server is installed (apt-get install valkey-server)")
    out = tmp_path / "replicas.json"
    args = ["--model", "tiny", "--doc-tokens", "300", "--short-tokens", "80"]
    args += ["--max-tokens", "4", "--kill-after", "0", "--deadline", "120", "--timeout", "120", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_replicas.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["error_count"] == 0 and r["errors"] == []
    assert r["command"].startswith("python benchmarks/serve_replicas.py --model tiny") and r["date_utc"]
    assert r["model"].startswith("tiny") and "prefill_chunk" in r["config"]
    cross = r["cross"]
    runs = cross["runs"]
    # B restored what A stored (every full 32-token block before the last token, then the prompt's
    # end record: all but its last 2 tokens), with A's answer
    assert runs["A_cold"]["cached_tokens"] == 0 and runs["B_cold"]["cached_tokens"] == 0
    n = runs["A_cold"]["prompt_tokens"]
    assert runs["B_reused"]["cached_tokens"] == (end_point(n, 32) or (n - 1) // 32 * 32) > 0
    assert cross["answers_identical"] and runs["B_reused"]["text"] == runs["A_cold"]["text"] != ""
    assert cross["ttft_B_reused_over_B_cold"] > 0
    # the in-process breakdown found the same blocks under the replicas' keys
    bd = r["breakdown"]
    assert bd["reused_tokens"] == runs["B_reused"]["cached_tokens"] and bd["prompt_tokens"] == n
    assert bd["record_bytes"] > 0 and bd["first_token_is_the_answers"]
    assert bd["full_block_tail"]["restored_tokens"] == (n - 1) // 32 * 32 - 32
    mem = bd["sequence_memory_at_first_decode_step"]
    assert mem["tokens_seen"] == n + 1 and 0 < mem["device_resident_bytes"] < mem["full_cache_bytes"]
    assert r["store_after_cross"]["keys"] >= 2 * ((n - 1) // 32)  # tenant "main"'s blocks and tenant "cold"'s
    assert all(v > 0 for v in r["replica_peak_rss_bytes"].values()) and len(r["replica_peak_rss_bytes"]) == 2
    # the store killed: every request answered, the same text, nothing reused, the outage counted on both
    outage = r["outage"]
    assert outage["failed_requests"] == 0 and outage["requests"] == 6
    assert outage["before"]["B"]["cached_tokens"] > 0  # reuse worked before the kill
    assert outage["answers_unchanged"] and outage["reused_after_kill"] == 0
    assert outage["unreachable_counted_on_both"]
    assert all(m["prefix_store_unreachable"] > 0 for m in outage["metrics_after"].values())
    assert r["replicas_alive_at_end"] == {"A": True, "B": True}


def test_serve_replicas_bad_arguments_are_one_line() -> None:
    for extra, message in (
        (["--doc-tokens", "0"], "--doc-tokens 0: allowed: a positive number of tokens"),
        (["--config", "nope.yaml"], "--config nope.yaml: no such file"),
        (["--store-binary", "no-such-server"], "--store-binary no-such-server: not found"),
    ):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "serve_replicas.py"), *extra],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr
