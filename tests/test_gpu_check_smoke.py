"""benchmarks/gpu_check.py runs end to end on a CPU with --smoke (tiny sizes), as CI runs it:
the exactness section passes, every length has measured decode times for both caches, and the
hardware model's figures stand beside them, labelled modelled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--smoke", "--out", str(out)]
    cmd.append("--device-rerank")  # the variant with device-held re-rank codes (on by default on CUDA only)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={"OMP_NUM_THREADS": "1", **_env()})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(out.read_text())
    ex = d["exactness"]
    assert ex["ok"] and ex["blocks"]["max_abs_diff"] <= 1e-3 and ex["pages_rerank_prefetch"]["max_abs_diff"] <= 1e-3
    assert ex["blocks_in_runs"]["max_abs_diff"] <= 1e-3  # decode steps in runs of keys
    assert ex["blocks"]["sealed_blocks"] > 0 and ex["blocks"]["cold_bytes"] > 0  # the cold tier was used
    assert d["constants"]["device_copy_bytes_per_s"] > 0 and d["constants"]["link"].startswith("n/a")
    assert [r["tokens"] for r in d["lengths"]] == [256, 512]
    for r in d["lengths"]:
        assert r["dynamic"]["decode_ms_median"] > 0 and len(r["dynamic"]["decode_ms"]) == 3
        assert r["flashmem"]["decode_ms_median"] > 0 and r["flashmem"]["prefill_s"] > 0
        assert r["flashmem"]["cold_bytes"] > 0
        assert r["flashmem"]["config"]["lsa_top_k"] > 0  # pages are ranked and selected on a CPU too
        assert "h2d_over_new_pages" in r["flashmem"]
        p = r["prediction"]
        assert p["label"] == "modelled, not measured" and p["dynamic_roofline_ms"] > p["ideal_full_roofline_ms"] > 0
        # the host's operator launches: flashmem's many per layer bound its small step
        assert p["flashmem_serial_dispatch_ms"] >= p["flashmem_decode_ms"] >= p["flashmem_roofline_ms"] > 0
        assert p["dynamic_decode_ms"] >= p["dynamic_roofline_ms"]
        assert p["offloaded_decode_ms"] > 0 and r["offloaded"].startswith("n/a")  # transformers offloads on CUDA
        # the model's weights: the smoke Llama's real parameter count x 2 bytes (bf16)
        from transformers import LlamaConfig, LlamaForCausalLM

        sys.path.insert(0, str(ROOT / "benchmarks"))
        from gpu_check import SMOKE

        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **SMOKE))
        assert p["weight_bytes"] == 2 * sum(t.numel() for t in model.parameters())
    assert "exactness: ok" in proc.stdout
    # the variant beside the recipe, at the shortest length: its own config, decode and link figures
    v = d["device_rerank"]
    assert "skipped" not in v, v
    # at 256 tokens the codes leave no page at 1/16 (budget_config refuses it): the smoke runs at 3/4
    assert v["tokens"] == 256 and v["budget"] == 0.75
    assert v["overrides"] == {"lsa_rerank_codec": "int4", "lsa_rerank_on_device": True}
    assert v["config"]["lsa_top_k"] > 0
    assert v["config"]["lsa_rerank_codec"] == "int4" and v["config"]["lsa_rerank_on_device"] is True
    assert v["decode_ms_median"] > 0 and "link_bytes_per_step" in v
    assert v["prediction"]["label"] == "modelled, not measured" and "flashmem_held_code_bytes" in v["prediction"]
    assert "int4 re-rank codes held on the device" in proc.stdout


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def test_gpu_check_skips_lengths_past_its_time_limit(tmp_path):
    """With no time left the exactness check still runs and every length is marked skipped."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    out = tmp_path / "g.json"
    code = gpu_check.main(["--device", "cpu", "--smoke", "--out", str(out), "--time-limit", "0"])
    d = json.loads(out.read_text())
    assert code == 0 and d["exactness"]["ok"]
    assert d["lengths"] == [{"tokens": 256, "skipped": "time"}, {"tokens": 512, "skipped": "time"}]
    assert "device_rerank" not in d  # off on a CPU unless asked for
