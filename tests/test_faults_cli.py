"""Fault and abuse suite, command line (issue 11 items 6, 12-14): every bad input is
answered in one line with exit 2, before any work; SIGTERM leaves no cold-tier folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flashmem.cli.main import main

CLI = [sys.executable, "-m", "flashmem.cli.main"]
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        p for p in [os.path.join(ROOT, "src"), os.path.join(ROOT, "evaluation"), os.environ.get("PYTHONPATH", "")] if p
    ),
}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err.strip()


def one_line_exit_2(capsys, *args: str) -> str:
    code, _, err = cli(capsys, *args)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: ")
    return err


# ------------------------------------------------------------------ 12. outputs checked first
@pytest.mark.parametrize("where", ["dir", "missing-parent"])
def test_run_json_out_is_checked_before_the_work(capsys, tmp_path, where):
    """Issue 11 item 12: a bad --json-out is refused before the model is even loaded
    (the model named here does not exist, so any later check would say so instead)."""
    target = tmp_path if where == "dir" else tmp_path / "no" / "out.json"
    err = one_line_exit_2(capsys, "run", "--model", str(tmp_path / "no-model"), "--json-out", str(target))
    assert "--json-out" in err and ("is a folder" in err or "does not exist" in err)


def test_bench_json_out_checked_and_depths_parsed(capsys, tmp_path):
    err = one_line_exit_2(capsys, "bench", "retrieval", "--depths", "abc", "--json-out", str(tmp_path / "r.json"))
    assert "--depths" in err and "'abc'" in err and "0 to 1" in err
    err = one_line_exit_2(capsys, "bench", "retrieval", "--depths", "2", "--json-out", str(tmp_path / "r.json"))
    assert "--depths" in err
    err = one_line_exit_2(capsys, "bench", "retrieval", "--json-out", str(tmp_path))
    assert "is a folder" in err


@pytest.mark.parametrize(
    "content,expect",
    [
        (b"\x7fELF\x02\x01\x01\x00\xff\xfe", "UTF-8"),
        (b'{"rows": 5}', "rows"),
        (b"[1, 2]", "rows"),
        (b'{"rows": [1]}', "objects"),
        (b"{", "not a `flashmem bench` JSON"),
    ],
)
def test_report_on_a_file_that_is_not_results(capsys, tmp_path, content, expect):
    """Issue 11 item 12: `report` on a binary file or on {"rows": 5} is one line."""
    f = tmp_path / "r.json"
    f.write_bytes(content)
    assert expect in one_line_exit_2(capsys, "report", str(f))


@pytest.mark.parametrize("layers", ["999999999999999999999", "2000000000", "100000000"])
def test_estimate_huge_layer_counts_by_arithmetic(capsys, layers):
    """Issue 11 item 12: OverflowError / MemoryError / 6 minutes before; now exact and instant."""
    t0 = time.perf_counter()
    code, out, _ = cli(
        capsys,
        "estimate",
        "--layers",
        layers,
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "-t",
        "1000",
        "--dtype",
        "float16",
        "--json",
        "-c",
        "configs/cpu-small.yaml",
    )
    assert code == 0 and time.perf_counter() - t0 < 10
    est = json.loads(out)
    n = int(layers)
    assert est["layers"] == n and est["full_cache_bytes"] == n * 2 * 8 * 128 * 2 * 1000
    assert est["flashmem"]["device_resident_bytes"] > 0


def test_estimate_beyond_the_cap_is_one_line(capsys):
    err = one_line_exit_2(
        capsys, "estimate", "--layers", "1" + "0" * 40, "--kv-heads", "8", "--head-dim", "128", "-t", "1"
    )
    assert "--layers" in err and "10**24" in err


# ------------------------------------------------------------------ 13. unbounded reads
def test_config_check_and_run_input_refuse_devices(capsys, tmp_path):
    """Issue 11 item 13: /dev/zero and /dev/urandom are refused, not read until MemoryError."""
    for args in (["config", "check", "/dev/zero"], ["run", "--input", "/dev/zero"], ["run", "--input", "/dev/urandom"]):
        err = one_line_exit_2(capsys, *args)
        assert "allowed: a regular file" in err


def test_fifo_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    for args in (["config", "check", str(fifo)], ["run", "--input", str(fifo), "--model", "x"]):
        p = subprocess.run(CLI + args, capture_output=True, text=True, timeout=60, env=ENV)
        assert p.returncode == 2 and "regular file" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_oversized_files_are_refused(capsys, tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(2 * 2**20)  # sparse: cheap
    assert "at most 1 MiB" in one_line_exit_2(capsys, "config", "check", str(big))


# ------------------------------------------------------------------ 14. usage errors
@pytest.mark.parametrize(
    "args,expect",
    [
        (["estimate", "--bogus"], "No such option: --bogus"),
        (["estimate", "-t", "1", "--batch", "x"], "--batch"),
        (["bench"], "Missing argument"),
        (["nosuch"], "No such command"),
        (["estimate", "-t"], "requires an argument"),
    ],
)
def test_usage_errors_are_one_line_exit_2(capsys, args, expect):
    """Issue 11 item 14: no usage box; what was wrong and where the allowed forms are."""
    err = one_line_exit_2(capsys, *args)
    assert expect in err and "allowed: see `flashmem" in err


def test_help_still_works(capsys):
    code, out, _ = cli(capsys, "estimate", "--help")
    assert code == 0 and "--tokens" in out


# ------------------------------------------------------------------ 6. SIGTERM cleans up
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from flashmem_eval.tiny import tiny_llama, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_run_removes_the_store_folder(tiny_folder, tmp_path, sig):
    """Issue 11 item 6: SIGTERM (like Ctrl-C) mid-run leaves no cold-tier folder behind."""
    cold = tmp_path / "cold"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"flash_memory:\n  gpu_cache_limit: 16\n  hca_chunk_size: 16\n  csa_band_tokens: 16\n"
        f"  cold_store: disk\n  cold_dir: {cold}\n  prefetch_threads: 1\n"
    )
    text = tmp_path / "in.txt"
    text.write_text("one two three four five six seven eight nine ten " * 50)
    p = subprocess.Popen(
        CLI
        + [
            "run",
            "--model",
            str(tiny_folder),
            "--config",
            str(cfg),
            "--input",
            str(text),
            "--max-new-tokens",
            "100000",
            "--threads",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        # a runner that starts the suite in the background (`cmd &`) hands it SIGINT ignored;
        # the child must see Ctrl-C as a user's shell delivers it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not (cold.is_dir() and os.listdir(cold)) and time.monotonic() < deadline:
            assert p.poll() is None, p.stderr.read()
            time.sleep(0.1)
        assert os.listdir(cold), "the run never opened its store"
        time.sleep(0.5)  # mid-generation
        p.send_signal(sig)
        p.wait(timeout=60)
    finally:
        p.kill()
        p.wait()
        p.stderr.close()
    assert p.returncode != 0 and os.listdir(cold) == []
