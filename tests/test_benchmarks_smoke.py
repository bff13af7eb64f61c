"""Smoke tests of the scripts under benchmarks/: each answers `--help`, and each maintained
benchmark runs its cheapest real invocation (a tiny model and a few steps, or SmolLM2 on a
short prompt under the `model` marker) and writes the rows its docs quote from.

The scripts run in this process through `runpy` (as `python benchmarks/X.py ARGS` runs
them, without paying a fresh interpreter and torch import each), with one torch thread.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

# The maintained benchmarks: the README and docs/results.md quote their numbers, and
# benchmarks/reproduce.sh runs them. Everything else lives in benchmarks/diagnostics/.
MAINTAINED = [
    "bench_cold_tier.py",
    "bench_prefetch.py",
    "bench_scale.py",
    "bench_target_8k.py",
    "budget_peak.py",
    "host_score_rate.py",
    "decode_alternating.py",
    "needle_selected.py",
    "page_retrieval.py",
    "prefix_bytes.py",
    "serve_load.py",
    "serve_replicas.py",
]
# written by another change; checked when present
OPTIONAL = ["gpu_check.py"]


def run_script(path: Path, *args: str) -> str:
    """Run a script as __main__ with argv; what it printed. SystemExit(0/None) is success."""
    old_argv, threads = sys.argv, torch.get_num_threads()
    sys.argv = [str(path), *args]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as exc:
                if exc.code not in (0, None):
                    msg = f"{path.name} {' '.join(args)} exited {exc.code}: {buf.getvalue()[-2000:]}"
                    raise AssertionError(msg) from None
    finally:
        sys.argv = old_argv
        torch.set_num_threads(threads)
    return buf.getvalue()


def test_top_level_scripts_are_the_maintained_ones():
    """A new script at the top of benchmarks/ is either maintained (listed here, smoke-tested)
    or a diagnostic under benchmarks/diagnostics/."""
    present = {p.name for p in BENCH.glob("*.py")}
    assert present - set(OPTIONAL) == set(MAINTAINED)


SCRIPTS = sorted(
    [BENCH / n for n in MAINTAINED]
    + [BENCH / n for n in OPTIONAL if (BENCH / n).exists()]
    + list((BENCH / "diagnostics").glob("*.py")),
    key=lambda p: str(p),
)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_help(path: Path):
    text = run_script(path, "--help")
    assert text.startswith("usage: "), text[:200]
    doc = path.read_text(encoding="utf-8").split('"""')[1]
    first = doc.strip().splitlines()[0]
    assert not first.rstrip().endswith("?"), f"{path.name}: the docstring should say what it measures: {first!r}"


def test_reproduce_script_help_and_refusal():
    import subprocess

    script = BENCH / "reproduce.sh"
    ok = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "Sections" in ok.stdout
    bad = subprocess.run(["bash", str(script), "nosuchsection"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown section 'nosuchsection'" in bad.stderr


# ---- the cheapest real invocations


def test_decode_alternating_tiny(tmp_path: Path):
    out = tmp_path / "da.json"
    args = ("--lengths", "1024", "--steps", "1", "--no-fixed", "--rebuild", "--whole", "--json", str(out))
    run_script(BENCH / "decode_alternating.py", *args)
    rows = json.loads(out.read_text())["rows"]
    caches = {r["cache"] for r in rows}
    assert {"recipe", "recipe:rebuild", "recipe:whole", "dynamic"} <= caches, caches
    recipe = next(r for r in rows if r["cache"] == "recipe")
    assert recipe["tokens"] == 1024 and recipe["decode_ms_median"] > 0
    assert 0 < recipe["decode_resident_fraction"] < 0.5  # the recipe at 1/8 holds a fraction while decoding


def test_bench_cold_tier_small(tmp_path: Path):
    text = run_script(BENCH / "bench_cold_tier.py", "--dir", str(tmp_path), "--mib", "2", "--threads", "1")
    assert "store random get, sync" in text and "MB/s" in text


def test_bench_prefetch_tiny(tmp_path: Path):
    out = tmp_path / "pf.json"
    args = ["--skip-smollm", "--tiny-tokens", "2048", "--steps", "1", "--window", "256", "--raw-mib", "4"]
    run_script(BENCH / "bench_prefetch.py", *args, "--threads", "1", "--dir", str(tmp_path), "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["prefetch"] for r in rows] == [False, True]  # prefetch off, then on, same cache
    assert all(r["model"] == "tiny-llama" and r["context"] == 2048 and r["disk_reads"] > 0 for r in rows[:1])


def test_bench_scale_one_child(tmp_path: Path):
    out = tmp_path / "scale.json"
    args = ["--lengths", "2048", "--steps", "1", "--chunk", "1024", "--methods", "flashmem", "--plot", ""]
    printed = run_script(BENCH / "bench_scale.py", *args, "--dir", str(tmp_path), "--json", str(out))
    assert out.exists(), f"the child wrote no row: {printed[-3000:]}"  # a failed child prints why
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["tokens"]) for r in rows] == [("flashmem", 2048)]
    assert rows[0]["device_resident_bytes"] > 0 and rows[0]["decode_ms_median"] > 0


def test_needle_selected_tiny_and_summary(tmp_path: Path):
    out = tmp_path / "ns.jsonl"
    args = ["512", "0.25", "default", "0", "--depths", "0.5", "--model", "tiny:2", "--json-out", str(out)]
    run_script(BENCH / "needle_selected.py", *args)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4  # 2 tasks x 2 haystacks x 1 seed x 1 depth
    assert all(r["variant"] == "default" and set(r["held"]) == {"0", "1"} for r in rows)
    text = run_script(BENCH / "needle_selected.py", "--summary", str(out))
    assert "tiny:2" in text and "held" in text


def test_needle_selected_refuses_a_half_command():
    with pytest.raises(AssertionError, match="exited 2"):
        run_script(BENCH / "needle_selected.py", "512", "0.25")


def test_page_retrieval_tiny(tmp_path: Path):
    out = tmp_path / "pr.jsonl"
    run_script(
        BENCH / "page_retrieval.py", "512", "0.25", "full,default", "passkey", "0", "0.5", "--model", "tiny:2",
        "--json-out", str(out),
    )  # fmt: skip
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["fmt"] == "passkey" and row["full"] in (0, 1) and row["default"] in (0, 1)
    assert row["full_ratio"] == 1.0 and 0 < row["default_ratio"] < 1


@pytest.mark.model
def test_bench_target_8k_short_on_smollm2(tmp_path: Path):
    out = tmp_path / "t8k.json"
    args = ["--config", str(ROOT / "configs" / "cpu-small.yaml"), "--prompt", "256", "--decode", "4"]
    run_script(BENCH / "bench_target_8k.py", *args, "--json-out", str(out))
    row: dict[str, Any] = json.loads(out.read_text())
    assert row["prompt_tokens"] == 256 and row["decoded_tokens"] == 4
    assert 0 <= row["kl_mean"] < 1 and 0 <= row["top1_agree"] <= 1
    assert 0 < row["resident_ratio"] < 1 and row["decode_time_ratio_flashmem_over_full"] > 0


@pytest.mark.model
def test_step_parts_charges_each_operator_to_its_function_on_smollm2(tmp_path: Path):
    out = tmp_path / "parts.json"
    run_script(BENCH / "diagnostics" / "step_parts.py", "--tokens", "700", "--steps", "2", "--op-times", "1",
               "--json-out", str(out))  # fmt: skip
    got = json.loads(out.read_text())
    funcs = {row["function"]: row for row in got["op_times"]}
    assert "model" in funcs and funcs["model"]["ops_per_layer"] > 0
    # the selecting step's own parts: its ranking and its attention, each in its own function
    assert any(f.startswith("cache/sdpa.py:") for f in funcs) and any(f.startswith("index/") for f in funcs)
    assert all(row["ms"] >= 0 for row in got["op_times"]) and got["parts_ms"]["index scores"] > 0


def test_prefill_tail_split_ab_reads_the_cold_tier_once_per_forward(tmp_path: Path):
    out = tmp_path / "ts.json"
    run_script(BENCH / "diagnostics" / "prefill_tail_split_ab.py", "--model", "tiny", "--tokens", "600",
               "--rounds", "1", "--json-out", str(out))  # fmt: skip
    got = json.loads(out.read_text())
    assert all(len(v) == 1 and v[0] > 0 for v in got["seconds"].values())
    assert 0 < got["h2d_bytes"]["one"] < got["h2d_bytes"]["split"] and got["last_logits_max_diff"] < 1e-4


@pytest.mark.model
def test_prefill_fused_ab_on_smollm2_gives_the_same_logits_both_ways(tmp_path: Path):
    out = tmp_path / "pf.json"
    run_script(BENCH / "diagnostics" / "prefill_fused_ab.py", "--tokens", "300", "--prefill-chunk", "64",
               "--rounds", "1", "--json-out", str(out))  # fmt: skip
    got = json.loads(out.read_text())
    assert got["cpu_kernel"] and all(len(v) == 1 and v[0] > 0 for v in got["seconds"].values())
    assert got["last_logits_max_diff"] < 1e-3


def test_prompt_transients_with_an_accelerators_bounds(tmp_path: Path, monkeypatch):
    """The diagnostic counts a GPU's transients on this CPU: the CPU's bounds lifted for its run
    (restored after the test: they are module constants)."""
    from flashmem.cache import assembly, scratch
    from flashmem.index import selection

    for mod, name in [
        (assembly, "DECODE_KV_BYTES"),
        (scratch, "CPU_TRANSIENT_BYTES"),
        (selection, "SCORE_BLOCK_BYTES_CPU"),
    ]:
        monkeypatch.setattr(mod, name, getattr(mod, name))
    out = tmp_path / "pt.json"
    run_script(BENCH / "diagnostics" / "prompt_transients.py", "--lengths", "1024", "--exact-tokens", "256",
               "--accelerator-bounds", "--out", str(out))  # fmt: skip
    got = json.loads(out.read_text())
    assert got["meta"]["accelerator_bounds"] and got["rows"][0]["transient_bytes"] > 0
    assert selection.SCORE_BLOCK_BYTES_CPU == selection.SCORE_BLOCK_BYTES  # lifted for the run


@pytest.mark.model
def test_serve_load_small_on_smollm2(tmp_path: Path):
    """The load test with a 300-token document, one client, two requests: a server process
    starts, serves, reuses the prefix, and the report comes back without errors."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "serve.json"
    args = ["--doc-tokens", "300", "--requests", "2", "--clients", "1", "--max-tokens", "2", "--ratio-questions", "1"]
    run_script(BENCH / "serve_load.py", *args, "--port", str(port), "--deadline", "300", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["error_count"] == 0 and result["errors"] == []
    assert result["server_peak_rss_bytes"] > 0
    assert result["ratio"]["answers_identical"]  # the same question, cold and reused, same answer


# ---- the commands the docs quote


class _Parsed(Exception):
    """Raised right after a script's argparse accepted its arguments: nothing runs."""


def quoted_commands() -> list[str]:
    """`python benchmarks/...` commands quoted in the README and the docs (inline code and
    fenced lines), without placeholders ([--x], ..., $VAR, L, DIR) that no shell would run."""
    cmds = []
    for doc in ("README.md", "docs/results.md", "docs/measurements.md"):
        text = (ROOT / doc).read_text(encoding="utf-8")
        spans = re.findall(r"`(python benchmarks/[^`]+)`", text)
        fences = [
            line
            for block in re.findall(r"^```\w*\n(.*?)^```", text, flags=re.M | re.S)
            for line in block.replace("\\\n", " ").splitlines()
            if line.strip().startswith("python benchmarks/")
        ]
        for cmd in spans + fences:
            cmd = " ".join(cmd.split()).split(" #")[0]
            if not re.search(r"[\[\]|$]|\.\.\.|\b(L|N|S|DIR|FILE)\b", cmd):
                cmds.append(cmd)
    return sorted(set(cmds))


def test_docs_quote_commands():
    assert len(quoted_commands()) >= 20


@pytest.mark.parametrize("cmd", quoted_commands())
def test_quoted_command_parses(cmd: str, monkeypatch):
    import argparse

    words = shlex.split(cmd)
    script = ROOT / words[1]
    assert script.exists(), f"{cmd}: no such script"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed):
        run_script(script, *words[2:])


def test_budget_peak_tiny(tmp_path: Path):
    """The streamed prompt keeps the peak at the budget; the held one (a lossy cold tier) does not."""
    out = tmp_path / "peak.jsonl"
    run_script(
        BENCH / "budget_peak.py", "--lengths", "2048", "--budget", "0.25", "--steps", "2", "--live-bytes",
        "--out", str(out),
    )  # fmt: skip
    rows = {r["cold_codec"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["exact"]["peak_over_budget"] < 1.2 < rows["int8"]["peak_over_budget"]
    # every tensor counted: the held prompt shows there too, and the request holds more than one
    # forward's activations
    live = {c: r["live_peak_over_budget"] for c, r in rows.items()}
    assert live["exact"] < live["int8"] and live["exact"] > rows["exact"]["live_forward_peak_over_budget"] > 0
    assert rows["exact"]["prompt_h2d_bytes"] > 0 and rows["exact"]["decode_full_cache_read"] > 0


def test_budget_peak_host_ranking_on_disk(tmp_path: Path):
    """As on an accelerator (candidates ranked where the cold tier holds them) and with the disk
    tier: the link carries the newly attended pages, and the row gives the RSS over the budget,
    here in a process that served the request once before (`--warm-process`)."""
    out = tmp_path / "peak.jsonl"
    run_script(
        BENCH / "budget_peak.py",
        *("--lengths", "2048", "--budget", "0.25", "--steps", "6", "--codecs", "exact"),
        *("--rank-on-host", "--cold-store", "disk", "--prefill-chunk", "512", "--forward-tokens", "1024"),
        *("--warm-process", "--out", str(out)),
    )
    (row,) = map(json.loads, out.read_text().splitlines())  # the warm-up request's row is not written
    assert row["rank_on_host"] and row["cold_store"] == "disk" and row["prefill_chunk"] == 512
    assert row["warm_process"] and row["host_mmap_threshold"] is None
    assert row["forward_tokens"] == 1024  # the prompt's forwards and the warm-up forward alike
    assert row["h2d_over_new_pages"] is None or 0 < row["h2d_over_new_pages"] <= 1.5
    assert row["peak_over_budget"] < 1.2
    # the RSS by phase: the request's peak is the larger of the prompt's and the decode steps'
    phases = (row["rss_prompt_peak_over_budget"], row["rss_decode_peak_over_budget"])
    assert row["rss_peak_over_budget"] == max(phases)
    assert "rss_retained_over_budget" in row and "rss_prompt_end_over_budget" in row
    assert row["scratch_over_budget"] > 0  # a decode step's attention buffers, regrown after the prompt


def test_ops_per_step_counts_each_caches_operators(tmp_path: Path):
    """The operator count behind the hardware model's dispatch term: a decode step of each cache,
    per layer; flashmem's step (ranked on the host) launches more and waits on the device, the
    full cache's does not wait; --by-caller attributes flashmem's kernels to its own functions
    (none of the full cache's); the class-wide host-ranking switch is put back."""
    from flashmem.cache.block_reads import BlockReader

    out = tmp_path / "ops.json"
    was = BlockReader.rank_on_host
    run_script(
        BENCH / "diagnostics" / "ops_per_step.py",
        *(
            "--tokens",
            "512",
            "--steps",
            "1",
            "--layers",
            "2",
            "--budget",
            "0.5",
            "--by-caller",
            "50",
            "--out",
            str(out),
        ),
    )
    d = json.loads(out.read_text())
    full, flash = d["full_cache"], d["flashmem"]
    assert full["kernels"] > 0 and full["waits"] == 0
    assert flash["kernels"] > full["kernels"] and flash["waits"] > 0
    assert full["kernels_by_caller"] == {"model": full["kernels"]}  # one step counted: mean = median
    by = flash["kernels_by_caller"]
    assert sum(by.values()) <= flash["kernels"] and by["model"] < flash["kernels"] / 2
    assert any(k.startswith("cache.assembly.") for k in by) and any(k.startswith("cache.ranking.") for k in by)
    assert BlockReader.rank_on_host is was


def test_uva_gather_copy_path_on_cpu(tmp_path: Path):
    """The mapped-memory gather needs CUDA; on a CPU the copy path runs and gives the pages."""
    out = tmp_path / "uva.json"
    run_script(
        BENCH / "diagnostics" / "uva_gather.py", "--device", "cpu", "--pages", "16,64", "--pool-mb", "2",
        "--reps", "2", "--out", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["pages"] for r in rows] == [16, 64]
    assert all(r["copy"]["equal"] and r["copy"]["gb_per_s"] > 0 and "mapped" not in r for r in rows)


def test_int8_kernels_times_every_form_and_says_which_this_cpu_takes(tmp_path: Path):
    from flashmem.cache import int8_dots

    out = tmp_path / "int8.json"
    run_script(BENCH / "diagnostics" / "int8_kernels.py", "--tokens", "256", "--pages", "4", "--reps", "3",
               "--json-out", str(out))  # fmt: skip
    got = json.loads(out.read_text())
    assert set(got["logits_us"]) == {*int8_dots.FORMS, "query_major_padded_to_8"}
    assert got["chosen"] in int8_dots.FORMS and all(t > 0 for t in got["logits_us"].values())


@pytest.mark.model
def test_onednn_linears_times_every_shape_and_product(tmp_path: Path):
    """Every distinct linear shape of SmolLM2, each product at each row count, all alike up to rounding."""
    out = tmp_path / "onednn.json"
    run_script(BENCH / "diagnostics" / "onednn_linears.py", "--rows", "1,3", "--reps", "1", "--out", str(out))
    got = json.loads(out.read_text())
    assert {(t["in"], t["out"]) for t in got["table"]} == {
        (576, 576),
        (576, 192),
        (576, 1536),
        (1536, 576),
        (576, 49152),
    }
    assert sum(t["linears"] for t in got["table"] if t["rows"] == 1) == 30 * 7 + 1  # 7 a layer and the head
    for t in got["table"]:
        assert all(t[f"{w}_ms_all"] > 0 and t[f"{w}_max_diff"] < 1e-3 for w in ("out_major", "in_major", "onednn"))
    assert set(got["totals_ms"]) == {"1", "3"} and got["linear_weight_bytes"] > 0


def test_gpu_step_anatomy_smoke_on_cpu(tmp_path: Path):
    """Every section runs on a CPU (the graph ones skipped) and records the steps it timed."""
    out = tmp_path / "anatomy.json"
    run_script(BENCH / "diagnostics" / "gpu_step_anatomy.py", "--device", "cpu", "--smoke", "--steps", "3",
               "--out", str(out))  # fmt: skip
    d = json.loads(out.read_text())
    for section in ("machine", "launch_floor", "dynamic", "static_graph", "flashmem", "dynamic_after"):
        assert "error" not in d[section], (section, d[section])
    assert len(d["flashmem"]["decode_ms"]) == 3 and d["flashmem"]["profile"]["wall_ms_per_step"] > 0
    assert "graph_ms_median" not in d["static_graph"] and d["launch_floor"]["eager_us_per_launch"] > 0
    assert d["flashmem"]["sync_points"].startswith("n/a")  # PyTorch's sync debug mode is CUDA's


@pytest.mark.parametrize("rerank", [False, True])
def test_static_step_gpu_smoke_on_cpu(tmp_path: Path, rerank: bool):
    """The next lease's static-step script runs on a CPU: eager, static and the graph mode's
    bookkeeping with each capture and replay emulated by a plain call (`--emulate-graphs`);
    the three give the same logits, and the graph mode captured once per layer and segment.
    With --rerank-codes both modes re-rank by codes held on the device."""
    out = tmp_path / "static.json"
    run_script(BENCH / "diagnostics" / "static_step_gpu.py", "--device", "cpu", "--smoke", "--steps", "30",
               "--emulate-graphs", "--out", str(out), *(["--rerank-codes"] if rerank else []))  # fmt: skip
    d = json.loads(out.read_text())
    ex = d["exactness"]
    assert ex["static_vs_eager_max_abs_diff"] < 1e-4 and ex["graph_vs_eager_max_abs_diff"] < 1e-4
    assert ex["graph_replays"] > 20
    row = d["tokens_512"]
    assert "error" not in row, row
    for mode in ("eager", "static", "graph"):
        assert len(row[mode]["decode_ms"]) == 30 and row[mode]["profile"]["wall_ms_per_step"] > 0, mode
    assert row["static"]["static"]["arena_on"] == "cpu" and "static" not in row["eager"]
    g = row["graph"]["graphs"]
    assert g["captures"] >= 2 and g["replays"] > 3 * g["captures"] and g["failures"] == 0
    st = row["static"]["static"]
    assert (st["candidates"] > st["k"]) is rerank and (row["config"]["lsa_rerank"] > 1) is rerank


def test_coded_full_cache_codes_what_attention_reads():
    """coded_full_cache.py: `none` answers as the tasks suite's full cache does; int8 coding of
    K changes the attention output by about the code's error, not more, and bf16 by less."""
    import json

    from flashmem_eval import harness as H
    from flashmem_eval.tasks import make_task

    path = BENCH / "diagnostics" / "coded_full_cache.py"
    out = run_script(path, "multivalue", "kjv", "512", "0", "--model", "tiny", "--codes", "none,int8")
    rows = {r["code"]: r for r in (json.loads(x) for x in out.splitlines() if x.startswith("{"))}
    ld = H.load("tiny")
    p = make_task(ld.tokenizer, "multivalue", 512, 0, hay="kjv")
    ctx = torch.tensor([ld.tokenizer(p.context, add_special_tokens=True)["input_ids"]])
    q = torch.tensor([ld.tokenizer(p.question, add_special_tokens=False)["input_ids"]])
    pre = H.prefill_full(ld.model, ctx)
    gaps: list[float] = []
    gen = H.greedy(ld.model, pre.cache, q, p.max_new, [ld.tokenizer.eos_token_id], gaps)
    assert rows["none"]["output"] == ld.tokenizer.decode(gen, skip_special_tokens=True)
    mod = runpy.run_path(str(path))
    # the same logits, not only the same argmax: the question (a chunk after the context) is
    # masked as SDPA masks it (unmasked, its is_causal aligned it to the first keys)
    gen2, gaps2 = mod["coded_answer"](ld.model, ctx, q, "none", p.max_new, [ld.tokenizer.eos_token_id])
    assert gen2 == gen and torch.allclose(torch.tensor(gaps2), torch.tensor(gaps), atol=1e-5)
    assert ld.model.config._attn_implementation == "sdpa"  # put back
    torch.manual_seed(0)
    qq, k, v = torch.randn(1, 4, 3, 64), torch.randn(1, 2, 50, 64), torch.randn(1, 2, 50, 64)
    layer = type("M", (), {"num_key_value_groups": 2, "is_causal": False, "training": False})()
    plain = mod["coded_attention"](None, None)(layer, qq, k, v, None)[0]
    for name, most in (("int8-keys", 0.05), ("int8-values", 0.05), ("bf16", 0.01)):
        o = mod["coded_attention"](*mod["CODES"][name])(layer, qq, k, v, None)[0]
        err = ((o - plain).norm() / plain.norm()).item()
        assert 0 < err < most, (name, err)


def test_coded_full_cache_from_runs_counts_the_full_caches_items_by_margin(tmp_path):
    """--from: each answered prompt of a tasks run, with each code; per margin band, how many of
    the full cache's items the coded cache finds too (here `none`: the full cache itself, so
    every item it found with these margins is found again)."""
    import json

    from flashmem_eval import harness as H
    from flashmem_eval.suites import BenchArgs, run_suite

    run = tmp_path / "t.json"
    args = BenchArgs(
        suite="tasks", model="tiny", methods=["full"], budgets=[0.25], lengths=[512], json_out=run,
        seeds=[0], haystacks=["kjv"], families=["multivalue", "keyed"], threads=1, progress=False,
    )  # fmt: skip
    rows = list(run_suite(args, H.load("tiny")).rows.values())
    # the tiny model finds nothing: say the full cache found the first item, behind margins in two bands
    doc = json.loads(run.read_text())
    for r, g in zip(doc["rows"], (0.05, 2.0)):
        r["hits"] = [True] + [False] * (len(r["hits"]) - 1)
        r["item_gaps"] = [g] + [None] * (len(r["hits"]) - 1)
    run.write_text(json.dumps(doc))
    out = tmp_path / "coded.json"
    path = BENCH / "diagnostics" / "coded_full_cache.py"
    run_script(path, "--from", str(run), "--model", "tiny", "--codes", "none", "--json-out", str(out))
    res = json.loads(out.read_text())
    assert len(res["rows"]) == len(rows) == 2
    bands = res["summary"]["none"]
    assert [b["full"] for b in bands] == [1, 0, 1]
    # kept: what the tiny model's own answer finds of those items (its real hits)
    real = {(r["family"], r["seed"]): r["hits"][0] for r in rows}
    by_gap = {r["full_item_gaps"][0]: real[(r["family"], r["seed"])] for r in res["rows"]}
    assert [b["kept"] for b in bands] == [int(by_gap[0.05]), 0, int(by_gap[2.0])]


def test_coded_full_cache_keys_per_channel_code_each_page_on_its_own():
    """int8-keys-kc codes K per channel over 16-token pages: a channel far larger than the others
    costs the others nothing (the per-token code scales every channel of a token to it), a
    page's code depends on its own tokens only, and a partial last page keeps its length."""
    mod = runpy.run_path(str(BENCH / "diagnostics" / "coded_full_cache.py"))
    kc, per_token = mod["CODES"]["int8-keys-kc"][0], mod["CODES"]["int8-keys"][0]
    torch.manual_seed(0)
    k = torch.randn(1, 2, 50, 64)  # 3 whole pages and 2 tokens
    k[..., 0] *= 100.0  # RoPE's low frequencies: a few large channels
    err_kc, err_tok = (k - kc(k))[..., 1:].abs().mean(), (k - per_token(k))[..., 1:].abs().mean()
    assert kc(k).shape == k.shape and err_kc < err_tok / 20
    # each channel's error within half its page's step
    step = k[:, :, :48].unflatten(-2, (3, 16)).abs().amax(-2) / 127  # [1, 2, 3, 64]
    assert ((k - kc(k))[:, :, :48].unflatten(-2, (3, 16)).abs() <= step[:, :, :, None] / 2 + 1e-6).all()
    other = k.clone()
    other[:, :, 16:] = torch.randn(1, 2, 34, 64)
    assert torch.equal(kc(other)[:, :, :16], kc(k)[:, :, :16])
    v = torch.randn(1, 2, 50, 64)
    assert mod["CODES"]["int8-kc"][1](v).equal(mod["CODES"]["int8"][1](v))  # values per token, as int8's


def test_ws_exact_pages_holds_the_int8_count_in_the_models_dtype(monkeypatch):
    """ws_int4_emulated.py --part exact: the config the solver makes for int8 pages, with those
    pages held in the model's dtype, and the open block's unused room buying int8's count."""
    from types import SimpleNamespace

    from flashmem.cache import tiered_attention
    from flashmem.config import FlashMemoryConfig

    mod = runpy.run_path(str(BENCH / "diagnostics" / "ws_int4_emulated.py"))
    geo = dict(group=3, head_dim=64, dtype_bytes=4)
    base = FlashMemoryConfig.for_budget(1 / 16, 4096, **geo)
    model_pages = FlashMemoryConfig.for_budget(1 / 16, 4096, working_set_codec="model", **geo)
    mod["patch_exact_pages"](monkeypatch.setattr)
    cfg = FlashMemoryConfig.for_budget(1 / 16, 4096, **geo)
    assert base.working_set_codec == "int8" and cfg.working_set_codec == "model"
    assert cfg.model_copy(update={"working_set_codec": "int8"}) == base
    assert cfg.lsa_top_k == base.lsa_top_k > model_pages.lsa_top_k  # int8's pages, not the model dtype's

    def layer(c: FlashMemoryConfig) -> Any:
        return SimpleNamespace(cfg=c, sink_k=torch.zeros(1, 3, 4, 64), open_k=torch.zeros(1, 3, 10, 64))

    room = tiered_attention.open_room_pages  # patched
    assert room(layer(cfg), 1) == room(layer(base), 1) > 0
    monkeypatch.undo()
    assert tiered_attention.open_room_pages(layer(cfg), 1) < room(layer(base), 1)  # fp32 pages cost more
    assert FlashMemoryConfig.for_budget(1 / 16, 4096, **geo).working_set_codec == "int8"


def test_decode_rss_steps_gives_each_steps_rss(tmp_path: Path):
    """The per-step RSS of a disk tier's decode: every step's peak at least its end, the heap's
    free pages handed back at most that end, all over the budget."""
    out = tmp_path / "rss.json"
    run_script(
        BENCH / "diagnostics" / "decode_rss_steps.py",
        *("--model", "tiny", "--tokens", "1024", "--steps", "2", "--json-out", str(out)),
    )
    row = json.loads(out.read_text())
    assert row["model"] == "tiny" and len(row["steps"]) == 2 and not row["warm"]
    assert row["base_mib"] > row["budget_mib"] > 0  # the absolute baseline beside the ratios
    for s in row["steps"]:
        assert s["peak"] >= s["end"] >= s["trimmed"] - 0.05  # KiB-granular reads of a moving RSS
