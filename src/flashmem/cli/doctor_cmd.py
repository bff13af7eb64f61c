"""`flashmem doctor`: measure the machine and check the config, advice per symptom."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)


def doctor(
    model: str = typer.Option(
        "smollm2", "--model", "-m", help="built-in name, HF folder or .gguf (only its config is read)"
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="FlashMemory YAML (default: configs/cpu-small.yaml)"
    ),
    context: str = typer.Option("8K", "--context", help="tokens per sequence: 8192, 8K, 128K"),
    cold_dir: Path | None = typer.Option(
        None, "--cold-dir", help="folder to probe (default: the config's cold_dir, else the temp folder)"
    ),
    dtype: str = typer.Option("float32", "--dtype", help="K/V element type (flashmem.load_model loads float32)"),
    probe_mib: int = typer.Option(64, "--probe-mib", min=1, help="size of the probe file written in the cold folder"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Measure cold-tier I/O, memory, threads and device; check the config; advice for accuracy drop, slowness, out of memory."""
    from flashmem.cli.run_cmd import _default_config
    from flashmem.config import FlashMemoryConfig
    from flashmem.doctor import diagnose, format_report
    from flashmem.sizing.units import parse_tokens

    cfg = FlashMemoryConfig.from_yaml(config or _default_config())
    report = diagnose(
        cfg,
        model=model,
        context=parse_tokens(context, "--context"),
        cold_dir=cold_dir,
        dtype=dtype,
        probe_bytes=probe_mib * 2**20,
    )
    typer.echo(json.dumps(report.to_dict(), indent=2, default=str) if as_json else format_report(report))
