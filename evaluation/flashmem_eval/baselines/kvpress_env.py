"""NVIDIA kvpress 0.5.5 presses, run in their own virtual environment.

kvpress 0.5.5 needs ``transformers<5.3`` while flashmem pins 5.24, so the
benchmark creates a venv under the cache dir (``$FLASHMEM_CACHE_DIR`` or
``~/.cache/flashmem``)/``kvpress-0.5.5`` with::

    python -m venv <dir>
    <dir>/bin/pip install kvpress==0.5.5 "transformers<5.3" torch==2.13.0

and runs :mod:`flashmem_eval.baselines.kvpress_runner` there as a subprocess on the
same model files (the HF folder flashmem.load_model converted and cached: fp32
safetensors + tokenizer) with the same token ids, so both environments see the
exact same prompts. ``compression_ratio`` = fraction removed = 1 - budget.

Caveat: for `Gemma3ForCausalLM` kvpress compresses every layer,
sliding ones included; rows report `ratio` over the global layers and
`ratio_all_layers` beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from flashmem.errors import FlashMemError

KVPRESS_VERSION = "0.5.5"
KVPRESS_REQUIREMENTS = (f"kvpress=={KVPRESS_VERSION}", "transformers<5.3", "torch==2.13.0")
RUNNER = Path(__file__).with_name("kvpress_runner.py")


def cache_root() -> Path:
    return Path(os.environ.get("FLASHMEM_CACHE_DIR") or Path.home() / ".cache" / "flashmem")


def venv_dir() -> Path:
    return Path(os.environ.get("FLASHMEM_KVPRESS_VENV") or cache_root() / f"kvpress-{KVPRESS_VERSION}")


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def create_commands(venv: Path | None = None) -> list[list[str]]:
    venv = venv or venv_dir()
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "pip"), "install", "-q", *KVPRESS_REQUIREMENTS],
    ]


def ensure_venv(venv: Path | None = None) -> Path:
    """Create the kvpress venv if its python cannot import kvpress; return its python."""
    venv = venv or venv_dir()
    py = venv_python(venv)
    if py.is_file():
        ok = subprocess.run([str(py), "-c", "import kvpress"], capture_output=True).returncode == 0
        if ok:
            return py
    for cmd in create_commands(venv):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise FlashMemError(
                f"kvpress venv: {' '.join(cmd)} failed ({res.stderr.strip().splitlines()[-1:]}); "
                f"create it by hand with: {' && '.join(' '.join(c) for c in create_commands(venv))}"
            )
    return py


def press_ratio(budget: float) -> float:
    """kvpress compression_ratio (fraction removed) for a budget (fraction kept)."""
    return 1.0 - float(budget)


def runner_command(python: Path | str, jobs_file: Path | str) -> list[str]:
    return [str(python), str(RUNNER), str(jobs_file)]


def write_jobs(path: Path, model_dir: str, out: Path, jobs: list[dict[str, Any]], threads: int) -> None:
    spec = {"model_dir": model_dir, "out": str(out), "threads": threads, "jobs": jobs}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))


def run_jobs(
    model_dir: str,
    jobs: list[dict[str, Any]],
    work: Path,
    threads: int = 2,
    python: Path | None = None,
    on_row: Any = None,
) -> list[dict[str, Any]]:
    """Run `jobs` in the kvpress venv; rows are read back as the runner writes them."""
    if not jobs:
        return []
    if not model_dir or not Path(model_dir, "config.json").is_file():
        raise FlashMemError(f"kvpress: no HF model folder at {model_dir!r} (load the model once first)")
    py = python or ensure_venv()
    jobs_file = work / "kvpress_jobs.json"
    out = work / "kvpress_rows.jsonl"
    if out.exists():
        out.unlink()
    write_jobs(jobs_file, model_dir, out, jobs, threads)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(
        runner_command(py, jobs_file), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    rows: list[dict[str, Any]] = []
    seen = 0
    import time

    log: list[str] = []

    def drain() -> None:
        nonlocal seen
        if not out.exists():
            return
        lines = out.read_text().splitlines()
        for line in lines[seen:]:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                return  # partially written; read it next time
            seen += 1
            rows.append(r)
            if on_row is not None:
                on_row(r)

    import threading

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    while proc.poll() is None:
        time.sleep(0.5)
        drain()
    t.join()
    drain()
    if proc.returncode != 0 and len(rows) < len(jobs):
        raise FlashMemError(f"kvpress runner exited {proc.returncode}: {''.join(log)[-800:]}")
    return rows
