"""`flashmem calibrate`: fit the index's low-rank keys and learned indexer for a model."""

from __future__ import annotations

import json
from pathlib import Path

import typer

HELP = """Fit the `lowrank` and `learned` scorers' projections for --model.

The model reads --tokens tokens of --text (default `pydoc`: the Python reference
that ships with CPython; or a UTF-8 text file) and, per global attention layer
and KV head, fits a PCA basis of its post-RoPE keys and a dual encoder trained
with KL against its own attention over history pages. Written as safetensors +
manifest.json to --out (default: the model's calibration folder in the model
cache, where `flashmem.attach` finds it).
"""


def calibrate_command(
    model: str = typer.Option("smollm2", "--model", "-m", help="built-in name, HF folder or .gguf file"),
    text: str = typer.Option("pydoc", "--text", help="calibration text: 'pydoc' or a UTF-8 text file"),
    tokens: int = typer.Option(4096, "--tokens", min=256, max=1 << 20, help="calibration tokens"),
    rank: int = typer.Option(16, "--rank", min=1, max=1024, help="low-rank dimension r"),
    steps: int = typer.Option(150, "--steps", min=0, max=100000, help="indexer training steps per layer"),
    out: Path | None = typer.Option(None, "--out", "-o", help="output folder"),
    threads: int = typer.Option(0, "--threads", min=0, help="torch threads (0: torch's default)"),
) -> None:
    import torch

    import flashmem
    from flashmem.calibration import calibrate, default_folder

    if threads:
        torch.set_num_threads(threads)
    m, tok = flashmem.load_model(model)
    folder = out if out is not None else default_folder(m)
    cal = calibrate(m, tok, text=text, tokens=tokens, rank=rank, steps=steps, out=folder)
    man = cal.manifest
    summary = {k: man[k] for k in ("model_fingerprint", "text", "tokens", "rank", "layers", "seconds")}
    size = sum(f.stat().st_size for f in Path(folder).iterdir())
    typer.echo(json.dumps({**summary, "folder": str(folder), "bytes_on_disk": size}))


def register(app: typer.Typer) -> None:
    app.command("calibrate", help=HELP)(calibrate_command)
