"""`flashmem estimate` and `flashmem config check` through the CLI entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashmem.cli.main import main
from flashmem.config import FlashMemoryConfig
from flashmem.sizing.calculator import estimate
from flashmem.sizing.hardware import MEASURED_NEW_PAGE_FRACTIONS as MEASURED

ROOT = Path(__file__).resolve().parents[1]
SEED = str(ROOT / "configs" / "seed.yaml")


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = 0
    try:
        main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]


def test_issue_check_exact_json(capsys):
    code, out, _ = run(
        capsys,
        "estimate",
        "--layers",
        "61",
        "--kv-heads",
        "64",
        "--head-dim",
        "128",
        "--dtype",
        "float16",
        "--tokens",
        "1000000",
        "--json",
    )
    assert code == 0
    d = json.loads(out)
    assert d["bytes_per_token"] == 1998848
    assert d["full_cache_bytes"] == 1998848000000
    assert d["tokens"] == 1000000 and d["batch"] == 1


@pytest.mark.parametrize(
    "model,bpt",
    # smollm2: 30 x 3 x 64 x (K + V) x 4 B: float32, the dtype load_model and doctor run it in
    [("deepseek-v3", 70272), ("deepseek-v3.2", 85888), ("smollm2", 46080), ("llama-3.1-8b", 131072)],
)
def test_builtins_json(capsys, model, bpt):
    code, out, _ = run(capsys, "estimate", "--model", model, "--tokens", "128K", "--json")
    d = json.loads(out)
    assert code == 0 and d["bytes_per_token"] == bpt
    assert d["tokens"] == 131072 and d["full_cache_bytes"] == bpt * 131072


def test_human_output_shows_gb_and_gib_and_fits(capsys):
    code, out, _ = run(capsys, "estimate", "-m", "llama-3.1-8b", "-t", "1M")
    assert code == 0
    assert "137.439 GB (128.000 GiB)" in out
    assert "141 GB" in out and "80 GB" in out and "24 GB" in out


def test_config_split_json(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("flash_memory:\n  gpu_cache_limit: 1024\n  lsa_top_k: 8\n  keep_full_layers: [-1]\n")
    code, out, _ = run(capsys, "estimate", "-m", "smollm2", "-t", "32K", "-b", "2", "-c", str(cfg), "--json")
    assert code == 0
    d = json.loads(out)
    f = d["flashmem"]
    assert d["batch"] == 2
    assert f["device_resident_bytes"] == sum(f["tiers"].values())
    assert f["device_resident_bytes"] < d["full_cache_bytes"] / 5
    assert f["cold_bytes"] > 0 and f["full_layers"] == [29]
    for key in ("sinks", "window", "open_block", "csa_entries", "hca_entries", "index", "working_set"):
        assert key in f["tiers"]


def test_config_split_table(capsys):
    code, out, _ = run(capsys, "estimate", "-m", "deepseek-v3", "-t", "128K", "-c", SEED)
    assert code == 0 and "working_set" in out and "flashmem device" in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["-m", "lama-3.1-8b", "-t", "1M"], "did you mean 'llama-3.1-8b'"),
        (["-m", "smollm2", "-t", "12x"], "--tokens"),
        (["--layers", "3", "-t", "10"], "missing --kv-heads, --head-dim"),
        (["-m", "smollm2", "--layers", "3", "-t", "10"], "--model"),
        (["-m", "smollm2", "-t", "10", "--dtype", "fp13"], "--dtype"),
        (["-m", "smollm2", "-t", "10", "-c", SEED], "keep_full_layers: layer 58 is outside"),
        (["-m", "smollm2", "-t", "10", "-c", "/nonexistent.yaml"], "no such file"),
        (["-m", "smollm2", "-t", "10", "-b", "0"], "--batch"),
    ],
)
def test_estimate_errors_are_one_line(capsys, args, needle):
    code, _, err = run(capsys, "estimate", *args)
    assert_one_line_error(code, err, needle)


def test_config_check_ok(capsys):
    code, out, _ = run(capsys, "config", "check", SEED)
    assert code == 0 and out.startswith("ok: ") and "keep_full_layers [58, 59]" in out
    code, out, _ = run(capsys, "config", "check", SEED, "--model", "deepseek-v3")
    assert code == 0 and "61 layers" in out


@pytest.mark.parametrize(
    "text,model,needle",
    [
        ("flash_memory:\n  gpu_cache_limt: 5\n", None, "did you mean 'gpu_cache_limit'"),
        ("flash_memory:\n  hca_chunk_size: 130\n", None, "not a multiple"),
        ("flash_memory:\n  keep_full_layers: [-31]\n", "smollm2", "layer -31 is outside"),
        ("flash_memory: [\n", None, "not valid YAML"),
        ("flash_memory:\n  gpu_cache_limit: 1\n", "nosuchmodel", "unknown model"),
    ],
)
def test_config_check_errors(capsys, tmp_path, text, model, needle):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    args = ["config", "check", str(p)] + (["--model", model] if model else [])
    code, _, err = run(capsys, *args)
    assert_one_line_error(code, err, needle)


def test_entry_point_subprocess():
    """The installed way: a real process, exit 2, one stderr line, no traceback."""
    cmd = [sys.executable, "-c", "from flashmem.cli.main import main; main()"]
    ok = subprocess.run(
        cmd + ["estimate", "-m", "deepseek-v3", "-t", "1M", "--json"], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0 and json.loads(ok.stdout)["full_cache_bytes"] == 70272 * 2**20
    bad = subprocess.run(cmd + ["estimate", "-m", "gpt5", "-t", "1M"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "unknown model 'gpt5'" in bad.stderr


def test_an_exact_prompt_shows_its_peak_and_fits_by_it(capsys, tmp_path):
    """An exact prompt over a lossy cold tier holds the prompt's K/V until the first token: the
    estimate adds it (min(tokens, cap) tokens of the managed layers) and judges the fit by that
    peak. Over an exact cold tier the prompt is streamed from the tiers: nothing is added."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("flash_memory:\n  gpu_cache_limit: 1024\n  lsa_top_k: 8\n  prefill_exact_tokens: 16384\n")
    code, out, _ = run(capsys, "estimate", "-m", "smollm2", "-t", "8K", "-c", str(cfg), "--json")
    assert code == 0 and json.loads(out)["flashmem"]["prompt_kv_bytes"] == 0  # streamed
    base = "flash_memory:\n  gpu_cache_limit: 1024\n  lsa_top_k: 8\n  cold_codec: int8\n"
    cfg.write_text(base + "  prefill_exact_tokens: 16384\n")
    code, out, _ = run(capsys, "estimate", "-m", "smollm2", "-t", "8K", "-c", str(cfg), "--json")
    d = json.loads(out)
    f = d["flashmem"]
    assert code == 0 and f["prompt_kv_bytes"] == d["full_cache_bytes"]  # all 8K tokens, every layer managed
    assert f["prompt_peak_bytes"] == f["device_resident_bytes"] + f["prompt_kv_bytes"]
    code, out, _ = run(capsys, "estimate", "-m", "smollm2", "-t", "64K", "-c", str(cfg), "--json")
    d = json.loads(out)
    assert d["flashmem"]["prompt_kv_bytes"] == d["full_cache_bytes"] // 4  # the cap: 16K of 64K tokens
    cfg.write_text(base)
    code, out, _ = run(capsys, "estimate", "-m", "smollm2", "-t", "8K", "-c", str(cfg), "--json")
    assert json.loads(out)["flashmem"]["prompt_kv_bytes"] == 0
    cfg.write_text(base + "  prefill_exact_tokens: 16384\n")
    code, out, _ = run(capsys, "estimate", "-m", "smollm2", "-t", "8K", "-c", str(cfg))
    assert code == 0 and "flashmem device, prompt" in out and "prompt peak" in out


def test_packaged_models_assume_load_models_float32(capsys):
    """One dtype across estimate, load_model and doctor (issue 28): a packaged model is
    estimated in float32 unless --dtype says otherwise; a model load_model cannot run keeps its own."""
    import inspect

    from flashmem.cli.estimate_cmd import assumed_dtype
    from flashmem.doctor import diagnose

    assert assumed_dtype("smollm2", None) == inspect.signature(diagnose).parameters["dtype"].default == "float32"
    assert assumed_dtype("gemma-3-270m", None) == "float32"
    assert assumed_dtype("llama-3.1-8b", None) is None and assumed_dtype("smollm2", "bf16") == "bf16"
    code, out, _ = run(capsys, "estimate", "-m", "smollm2", "-t", "8K", "--dtype", "bfloat16", "--json")
    d = json.loads(out)
    assert code == 0 and d["bytes_per_token"] == 23040 and "dtype_note" not in d
    code, out, _ = run(capsys, "estimate", "-m", "smollm2", "-t", "8K")
    assert code == 0 and "float32, as flashmem.load_model" in out


def _recipe(tokens: int, group: int) -> FlashMemoryConfig:
    return FlashMemoryConfig.for_budget(1 / 16, tokens, group=group, head_dim=128, dtype_bytes=2)


def _traffic_file(tmp_path, h2d: int) -> str:
    zero = {"device_read_bytes": 0, "h2d_bytes": 0, "disk_read_bytes": 0, "host_read_bytes": 0}
    report = {
        "steps": {"prefill_chunks": 4, "decode_steps": 8},
        "totals": dict(zero, h2d_bytes=8 * h2d),
        "per_decode_step_median": dict(zero, device_read_bytes=10**9, h2d_bytes=h2d),
        "per_prefill_chunk_median": dict(zero, h2d_bytes=10**6),
        "full_cache_bytes": 2**34,
        "layers": 32,
    }
    p = tmp_path / "traffic.json"
    p.write_text(json.dumps(report))
    return str(p)


def test_hardware_model_json_with_counted_traffic(capsys, tmp_path):
    code, out, _ = run(
        capsys,
        *("estimate", "-m", "llama-3.1-8b", "-t", "128K", "--hardware", "h200", "--json", "--dispatch", "off"),
        *("--traffic", _traffic_file(tmp_path, 50 * 10**6)),
    )
    assert code == 0
    d = json.loads(out)
    hm = d["hardware_model"]
    assert hm["label"] == "modelled, not measured"  # the roofline alone: the host's dispatch off
    weights = 8_030_261_248 * 2
    hbm, allow, kv = 143771 * 2**20, 2 * 2**30, 131072 * 131072
    rows = hm["rows"]
    assert rows["full"]["largest_batch"] == (hbm - weights - allow) // kv == 7
    assert rows["full"]["step_s"] == pytest.approx((weights + kv) / 4.8e12)
    assert rows["offloaded"]["step_s"] == pytest.approx(kv / 55e9)
    # flashmem: the recipe's resident bytes from the calculator, the run's counted link bytes
    cfg = FlashMemoryConfig.for_budget(1 / 16, 131072, group=4, head_dim=128, dtype_bytes=2)
    flash = estimate("llama-3.1-8b", tokens=131072, config=cfg).flashmem
    big = (hbm - weights - allow - flash.prompt_kv_bytes) // flash.device_resident_bytes
    assert rows["flashmem"]["largest_batch"] == big
    assert rows["flashmem"]["step_s_at_largest"] == pytest.approx(big * 50e6 / 55e9)
    assert rows["flashmem"]["prefill_link_bytes"] == 4 * 10**6
    assert hm["targets"]["throughput_target_met"] and hm["targets"]["batch1_target_met"]
    assert hm["flashmem_traffic"]["source"].startswith("counted")


def test_hardware_model_table_and_overrides(capsys):
    args = ("estimate", "-m", "llama-3.1-8b", "-t", "128K", "--hardware", "h200")
    code, out, _ = run(capsys, *args)
    assert code == 0 and "MODELLED, not measured" in out and "offloaded" in out
    # the recipe at 128K and 1/16 holds int4 candidate codes on the device (recipe.DEVICE_RERANK)
    assert (
        "issue 27 targets (modelled, re-rank codec int4 on the device" in out
        and "re-rank int4 codes held on the device and scored there" in out
    )
    assert "at measured new-page fractions" in out and "0.067 (SmolLM2 measured)" in out
    code, out, _ = run(capsys, *args, "--json", "--hbm-gib", "1000", "--link-gbps", "110", "--rerank-keys", "device")
    hm = json.loads(out)["hardware_model"]
    assert hm["hardware"]["hbm_bytes"] == 1000 * 2**30 and hm["hardware"]["link_bytes_per_s"] == 110e9
    assert hm["rows"]["full"]["largest_batch"] == (1000 * 2**30 - 8_030_261_248 * 2 - 2 * 2**30) // 131072**2
    assert hm["flashmem_traffic"]["parts"]["rerank_keys"] == 0


def test_hardware_model_when_the_full_cache_does_not_fit(capsys):
    code, out, _ = run(capsys, "estimate", "-m", "llama-3.1-8b", "-t", "1M", "--hardware", "h100")
    assert code == 0 and "no fit" in out and "not comparable: the full cache does not fit one sequence" in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--hardware", "h300"], "--hardware: 'h300' is not known; allowed: h100, h200, a100, l4"),
        (["--hardware", "h100", "--hbm-gbps", "-5"], "--hbm-gbps"),
        (["--hardware", "h100", "--link-gbps", "0"], "--link-gbps"),
        (["--link-gbps", "10"], "only with --hardware"),
        (["--hardware", "h100", "--new-page-fraction", "2"], "--new-page-fraction"),
        (["--hardware", "h100", "--rerank-keys", "disk"], "--rerank-keys"),
        (["--hardware", "h100", "--traffic", "/nonexistent.json"], "no such file"),
        (["--hardware", "h100", "--budget", "0"], "--budget"),
        (
            ["--hardware", "h100", "--budget", "0.1", "-c", str(ROOT / "configs" / "cpu-small.yaml")],
            "not allowed together with --config",
        ),
        (["--budget", "0.1"], "only with --hardware"),
        (
            ["--hardware", "h200", "--rerank-codec", "int3"],
            "--rerank-codec: 'int3' is not allowed; allowed: exact, int4, int2, sign",
        ),
        (["--rerank-codec", "sign"], "--rerank-codec: only with --hardware"),
        (["--hardware", "h200", "--host-tflops", "0"], "--host-tflops"),
        (
            ["--hardware", "h200", "--rerank-codec", "exact", "--rerank-on-device"],
            "--rerank-on-device: holds the candidates' codes on the device, but the re-rank codec is 'exact'; "
            "allowed: --rerank-codec int4, int2, sign",
        ),
        # the recipe at 32K re-ranks by exact keys: a device-held re-rank needs a code
        (["--hardware", "h200", "--rerank-on-device"], "allowed: --rerank-codec int4, int2, sign"),
        (["--rerank-on-host"], "--rerank-on-host: only with --hardware"),
        (["--rerank-on-device"], "--rerank-on-device: only with --hardware"),
        (["--hardware", "h200", "--new-candidate-fraction", "2"], "--new-candidate-fraction: 2.0 is not allowed"),
        (["--new-candidate-fraction", "0.1"], "--new-candidate-fraction: only with --hardware"),
        (
            ["--hardware", "h200", "--rerank-on-device", "--traffic", "/nonexistent.json"],
            "--rerank-on-device: not allowed together with --traffic",
        ),
        (["--host-tflops", "2"], "--host-tflops: only with --hardware"),
        (
            ["--hardware", "h200", "--rerank-codec", "sign", "--traffic", "/nonexistent.json"],
            "--rerank-codec: not allowed together with --traffic",
        ),
        (["--hardware", "h200", "--select-every", "0"], "--select-every: 0 is not allowed; allowed: 1 to 64"),
        (["--select-every", "4"], "--select-every: only with --hardware"),
        (
            ["--hardware", "h200", "--select-every", "4", "--traffic", "/nonexistent.json"],
            "--select-every: not allowed together with --traffic",
        ),
        (["--hardware", "h200", "--fetch-share", "0.3"], "--fetch-share: needs --static"),
        (["--hardware", "h200", "--static", "--fetch-share", "1.5"], "--fetch-share: 1.5 is not allowed"),
        (["--static"], "--static: only with --hardware"),
        (["--doubt-redo-fraction", "0.1"], "--doubt-redo-fraction: only with --hardware"),
        (["--hardware", "h200", "--doubt-redo-fraction", "2"], "--doubt-redo-fraction: 2.0 is not allowed"),
        (["--hardware", "h200", "--static", "--select-every", "4"], "--static: one selection a step"),
    ],
)
def test_hardware_mistakes_are_one_line(capsys, args, needle):
    code, _, err = run(capsys, "estimate", "-m", "llama-3.1-8b", "-t", "32K", *args)
    assert_one_line_error(code, err, needle)


def test_a_config_that_redoes_near_ties_pays_for_the_cold_tier_over_the_link(capsys):
    """configs/cpu-small.yaml carries exact_on_doubt: modelled on an accelerator, its redone
    steps read the whole cold tier over the link, which then bounds the largest batch."""
    cpu = str(ROOT / "configs" / "cpu-small.yaml")
    base = ("estimate", "-m", "llama-3.1-8b", "-t", "128K", "--hardware", "h200", "-c", cpu, "--json")
    code, out, _ = run(capsys, *base)
    assert code == 0
    flash = json.loads(out)["hardware_model"]["rows"]["flashmem"]
    assert "exact_on_doubt: 0.12 of the steps redone" in flash["note"]
    code, out, _ = run(capsys, *base, "--doubt-redo-fraction", "0")
    none = json.loads(out)["hardware_model"]["rows"]["flashmem"]
    assert "exact_on_doubt" not in none["note"]
    # 0.12 of the 16 GiB cold tier a step (at most that; the working set's new pages besides)
    assert flash["link_bytes_per_step"] - none["link_bytes_per_step"] == pytest.approx(0.12 * 2**34, rel=0.01)
    assert flash["bound_at_largest"] == "link" and flash["step_s_at_largest"] > none["step_s_at_largest"]


def test_hardware_needs_params_for_an_unknown_model(capsys):
    base = ("estimate", "--layers", "4", "--kv-heads", "8", "--head-dim", "128", "-t", "32K", "--hardware", "h100")
    code, _, err = run(capsys, *base)
    assert_one_line_error(code, err, "--params")
    code, out, _ = run(capsys, *base, "--params", "1e9", "--json")
    hm = json.loads(out)["hardware_model"]
    assert code == 0 and hm["model_cost"]["params"] == 10**9 and "lower bound" in hm["flops_note"]
    # the flashmem row sizes the model given by dimensions: 4 layers x 8 KV heads x 128
    flash = estimate(None, tokens=32768, layers=4, kv_heads=8, head_dim=128, config=_recipe(32768, 1)).flashmem
    assert hm["rows"]["flashmem"]["device_bytes_per_seq"] == flash.device_resident_bytes


def test_rerank_codec_overrides_the_config(capsys):
    """--rerank-codec sign: the recipe at 1/16 and 128K re-ranks 1,024 pages of 16 tokens per KV head
    and layer by 1-bit codes of blocks of 64 tokens: 16,384 x 32 layers x 8 KV heads x 128 elements x
    (1/8 + 4/64) bytes read on the host; 4 query heads score each key."""
    from typing import get_args

    from flashmem.cli.estimate_cmd import RERANK_CODECS
    from flashmem.config import RerankCodec

    assert RERANK_CODECS == get_args(RerankCodec)
    base = ("estimate", "-m", "llama-3.1-8b", "-t", "128K", "--hardware", "h200", "--json")
    out = {}
    for codec in ("exact", "sign"):
        # exact alone puts the recipe's re-rank on the host; a code needs --rerank-on-host for it
        host = () if codec == "exact" else ("--rerank-on-host",)
        code, text, _ = run(capsys, *base, "--rerank-codec", codec.upper() if codec == "sign" else codec, *host)
        assert code == 0
        out[codec] = json.loads(text)["hardware_model"]
    hm = out["sign"]
    assert hm["rerank_codec"] == "sign" and "lsa_rerank_codec sign (--rerank-codec)" in hm["flashmem_config"]
    elems = 16384 * 32 * 8 * 128
    assert hm["flashmem_traffic"]["host_read_bytes_per_step"] == elems * (1 / 8 + 4 / 64) == 100663296
    assert out["exact"]["flashmem_traffic"]["host_read_bytes_per_step"] == elems * 2 == 2**30
    assert hm["flashmem_traffic"]["host_flops_per_step"] == 16384 * 4 * 32 * 8 * (2 * 128 + 4)
    # exact: 212 sequences x 1 GiB of keys on 200 GB/s of host DRAM; sign: 212 x 4.36 GFLOP at 1.43 TFLOP/s
    big = hm["rows"]["flashmem"]["largest_batch"]
    assert out["exact"]["rows"]["flashmem"]["bound_at_largest"] == "host DRAM"
    assert out["exact"]["rows"]["flashmem"]["step_s_at_largest"] == pytest.approx(big * 2**30 / 200e9)
    assert hm["rows"]["flashmem"]["bound_at_largest"] == "host compute"
    flops = 16384 * 4 * 32 * 8 * (2 * 128 + 4)
    assert hm["rows"]["flashmem"]["step_s_at_largest"] == pytest.approx(big * flops / (2 * 56 * 64 * 2.0e9 * 0.1))
    # the measured fractions beside the default
    measured = hm["at_measured_new_page_fractions"]
    assert [m["new_page_fraction"] for m in measured] == [m.new_page_fraction for m in MEASURED]
    assert [m["new_page_fraction"] for m in measured][:2] == [0.067, 0.361]
    assert all(m["throughput_ratio_at_largest_batch"] > 0 for m in measured)


def test_host_tflops_moves_the_bound(capsys):
    args = ("estimate", "-m", "llama-3.1-8b", "-t", "128K", "--hardware", "h200", "--rerank-codec", "sign")
    args = (*args, "--rerank-on-host")
    code, out, _ = run(capsys, *args)
    assert code == 0 and "host compute" in out and "1.43 TFLOP/s" in out
    code, out, _ = run(capsys, *args, "--host-tflops", "1000", "--json")
    hm = json.loads(out)["hardware_model"]
    assert hm["hardware"]["host_flops"] == 1000e12 and hm["rows"]["flashmem"]["bound_at_largest"] == "link"


def test_rerank_on_device_holds_the_codes_in_the_budget(capsys):
    """--rerank-codec int4 --rerank-on-device at 32K: the recipe re-ranks max(4 x 176, 256) = 704
    candidate pages of 16 tokens per KV head and layer; each page's int4 codes are 16 x 128 / 2 =
    1,024 B plus an fp16 zero and scale per channel (512 B): 704 x 1,536 x 32 layers x 8 KV heads =
    276,824,064 B held on the device per sequence, and 0.4 of them cross the link per step."""
    base = ("estimate", "-m", "llama-3.1-8b", "-t", "32K", "--hardware", "h200", "--json", "--rerank-codec", "int4")
    code, text, _ = run(capsys, *base, "--rerank-on-device")
    assert code == 0
    hm = json.loads(text)["hardware_model"]
    code, text, _ = run(capsys, *base)  # the recipe at 32K keeps the codes on the host
    host = json.loads(text)["hardware_model"]
    assert FlashMemoryConfig.for_budget(1 / 16, 32768, "llama-3.1-8b").lsa_top_k == 176
    held = 704 * (16 * 128 // 2 + 4 * 128) * 32 * 8
    assert held == 276_824_064 and hm["flashmem_traffic"]["held_code_bytes"] == held
    assert hm["rerank_on_device"] and not host["rerank_on_device"]
    assert "lsa_rerank_on_device true (--rerank-on-device)" in hm["flashmem_config"]
    # the device holds them: a sequence's resident bytes grow by exactly the codes, which sets the batch
    per_seq = hm["rows"]["flashmem"]["device_bytes_per_seq"]
    assert per_seq == host["rows"]["flashmem"]["device_bytes_per_seq"] + held
    weights, hbm, allow = 8_030_261_248 * 2, 143771 * 2**20, 2 * 2**30
    assert hm["rows"]["flashmem"]["largest_batch"] == (hbm - weights - allow) // per_seq == 243
    # the link: the new pages (as int8 codes) and 0.4 of the candidates' codes; nothing on the host
    tr = hm["flashmem_traffic"]
    assert tr["parts"]["rerank_keys"] == pytest.approx(0.4 * held)
    assert tr["parts"]["new_pages"] == host["flashmem_traffic"]["parts"]["new_pages"]
    assert tr["link_bytes_per_step"] == pytest.approx(tr["parts"]["new_pages"] + 0.4 * held)
    assert tr["host_read_bytes_per_step"] == 0 and tr["host_flops_per_step"] == 0
    # the same scores, of the 704 candidates on the device; the host scores all 2,044 sealed pages
    # ((32,768 - 20 sinks - 32 window) // 64 = 511 blocks of 4) in place: candidates are a third of them
    host_flops = host["flashmem_traffic"]["host_flops_per_step"]
    assert tr["device_flops_rerank_per_step"] * 2044 == pytest.approx(host_flops * 704) and host_flops > 0
    assert host["rows"]["flashmem"]["bound_at_largest"] == "host compute"
    assert hm["rows"]["flashmem"]["bound_at_largest"] == "link"
    big = hm["rows"]["flashmem"]["largest_batch"]
    assert hm["rows"]["flashmem"]["step_s_at_largest"] == pytest.approx(big * tr["link_bytes_per_step"] / 55e9)
    # the new-candidate fraction follows the new-page fraction unless the run counted its own
    measured = hm["at_measured_new_page_fractions"]
    assert [m["new_candidate_fraction"] for m in measured] == [
        m.new_page_fraction if m.new_candidate_fraction is None else m.new_candidate_fraction for m in MEASURED
    ]
    assert [m["new_candidate_fraction"] for m in measured][:2] == [0.067, 0.361]
    code, text, _ = run(capsys, *base, "--rerank-on-device", "--new-candidate-fraction", "0.1")
    tr = json.loads(text)["hardware_model"]["flashmem_traffic"]
    assert code == 0 and tr["parts"]["rerank_keys"] == pytest.approx(0.1 * held)


def test_the_recipe_at_128k_holds_int4_codes_and_exact_takes_them_off(capsys):
    """The recipe at 128K and 1/16 re-ranks by int4 codes held on the device; --rerank-codec exact
    alone reads exact keys on the host (exact keys are never held on the device)."""
    base = ("estimate", "-m", "llama-3.1-8b", "-t", "128K", "--hardware", "h200", "--json")
    code, text, _ = run(capsys, *base)
    hm = json.loads(text)["hardware_model"]
    assert code == 0 and hm["rerank_codec"] == "int4" and hm["rerank_on_device"]
    assert hm["flashmem_traffic"]["held_code_bytes"] == 1024 * (1024 + 512) * 32 * 8  # 384 MiB
    code, text, _ = run(capsys, *base, "--rerank-codec", "exact")
    hm = json.loads(text)["hardware_model"]
    assert code == 0 and not hm["rerank_on_device"] and hm["flashmem_traffic"]["held_code_bytes"] == 0
    assert "lsa_rerank_on_device false (--rerank-codec exact)" in hm["flashmem_config"]
    assert hm["flashmem_traffic"]["host_read_bytes_per_step"] == 2**30


def test_dispatch_and_op_us_options(capsys):
    """--dispatch and --op-us reach the model: off is the bytes-only step, serial adds the host's
    launches to flashmem's, and a larger --op-us lengthens a launch-bound step; both need
    --hardware, and a bad value is one line naming what is allowed."""
    base = ("estimate", "-m", "llama-3.1-8b", "-t", "128K", "--hardware", "h200", "--json")

    def rows(*extra: str) -> dict:
        code, out, _ = run(capsys, *base, *extra)
        assert code == 0
        return json.loads(out)["hardware_model"]

    default, off, serial = rows(), rows("--dispatch", "off"), rows("--dispatch", "serial")
    slow = rows("--op-us", "10")
    assert default["assumptions"]["dispatch"] == "overlap" and default["assumptions"]["op_launch_s"] == 5e-6
    f = {name: d["rows"]["flashmem"]["step_s"] for name, d in (("default", default), ("off", off), ("serial", serial))}
    assert f["off"] < f["default"] < f["serial"]
    assert slow["rows"]["flashmem"]["step_s"] > f["default"]
    code, _, err = run(capsys, "estimate", "-m", "llama-3.1-8b", "-t", "128K", "--op-us", "3")
    assert code == 2 and "--op-us: only with --hardware" in err
    code, _, err = run(capsys, *base, "--dispatch", "never")
    assert code == 2 and "--dispatch: 'never' is not allowed; allowed: overlap, serial, off" in err


def test_select_every_replaces_the_configs(capsys):
    """--select-every 4: the config's lsa_select_every is 4 (named in the source line and the JSON),
    and the step's operators and ranking bytes come once in 4 steps: a shorter step at batch 1."""
    base = ("estimate", "-m", "llama-3.1-8b", "-t", "128K", "--hardware", "h200", "--json")
    code, one, _ = run(capsys, *base)
    assert code == 0
    code, four, _ = run(capsys, *base, "--select-every", "4")
    assert code == 0
    one_hm, four_hm = json.loads(one)["hardware_model"], json.loads(four)["hardware_model"]
    assert one_hm["select_every"] == 1 and four_hm["select_every"] == 4
    assert "lsa_select_every 4 (--select-every)" in four_hm["flashmem_config"]
    parts1, parts4 = one_hm["flashmem_traffic"]["parts"], four_hm["flashmem_traffic"]["parts"]
    assert parts4["rerank_keys"] == pytest.approx(parts1["rerank_keys"] / 4)
    assert parts4["new_pages"] == pytest.approx(parts1["new_pages"])
    assert four_hm["rows"]["flashmem"]["step_s"] < one_hm["rows"]["flashmem"]["step_s"]


def test_static_reads_a_fixed_share_and_launches_the_static_steps_operators(capsys):
    """--static: the config gets decode_step static (named in the source line); the step reads
    every selected page over the link, coded (int8), whatever is new, and --fetch-share s reads
    s of them; its operators are the static step's (fewer, no waits), so at the same host cost
    per operator a batch-1 step is shorter than the recipe's."""
    base = ("estimate", "-m", "llama-3.1-8b", "-t", "128K", "--hardware", "h200", "--json", "--op-us", "63")
    code, recipe, _ = run(capsys, *base)
    code2, every, _ = run(capsys, *base, "--static")
    code3, quarter, _ = run(capsys, *base, "--static", "--fetch-share", "0.25")
    assert code == code2 == code3 == 0
    r, e, q = (json.loads(x)["hardware_model"] for x in (recipe, every, quarter))
    assert "decode_step static" in e["flashmem_config"] and "lsa_fetch_share 0.25" in q["flashmem_config"]
    assert q["flashmem_traffic"]["link_bytes_per_step"] == pytest.approx(
        e["flashmem_traffic"]["link_bytes_per_step"] / 4, rel=0.02
    )
    assert e["flashmem_traffic"]["parts"]["rerank_keys"] == 0
    assert e["rows"]["flashmem"]["step_s"] < r["rows"]["flashmem"]["step_s"]


def test_static_keeps_a_rerank_by_codes_on_the_device_and_reads_a_share_of_them(capsys):
    """--static with --rerank-codec int4 --rerank-on-device: the static step re-ranks by the held
    codes (named in the source line), reads every candidate's codes a step (a fixed read, new or
    not) and, with --fetch-share s, as many as the pages it reads, beside them; without a code on
    the device the re-rank is dropped."""
    base = ("estimate", "-m", "llama-3.1-8b", "-t", "128K", "--hardware", "h200", "--json", "--static")
    coded = ("--rerank-codec", "int4", "--rerank-on-device")
    outs = [run(capsys, *base, *extra) for extra in ((), coded, (*coded, "--fetch-share", "0.25"))]
    assert all(code == 0 for code, _, _ in outs)
    plain, every, quarter = (json.loads(out)["hardware_model"] for _, out, _ in outs)
    assert "lsa_rerank 1" in plain["flashmem_config"] and plain["flashmem_traffic"]["parts"]["rerank_keys"] == 0
    assert "re-ranked by int4 codes on the device" in every["flashmem_config"]
    held = every["flashmem_traffic"]["parts"]["rerank_keys"]
    # a quarter of the pages a step, and as many candidates (of 4x as many): a sixteenth of their codes
    assert held > 0 and quarter["flashmem_traffic"]["parts"]["rerank_keys"] == pytest.approx(held / 16, rel=0.02)
    # the pages' read is the static step's own, with or without the re-rank
    assert quarter["flashmem_traffic"]["parts"]["new_pages"] == pytest.approx(
        every["flashmem_traffic"]["parts"]["new_pages"] / 4, rel=0.02
    )
