"""`flashmem estimate`: KV-cache memory of a model, full and under FlashMemory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

HELP = """Estimate the KV cache of a model after --tokens tokens for --batch sequences.

Give --model (a built-in name, a folder with config.json, or a .gguf file: only
its metadata is read) or all of --layers, --kv-heads, --head-dim (and --dtype).

--tokens: a plain integer is exact (1000000 is one million tokens); K and M are
binary: K = 1024, M = 1048576 (128K = 131072, 1M = 1048576).

Sizes print as GB = 10^9 bytes and GiB = 2^30 bytes. With --config FILE (a
FlashMemoryConfig YAML) it also prints the device-resident bytes per tier and
the cold-tier bytes.
"""


def estimate_command(
    model: str | None = typer.Option(
        None, "--model", "-m", help="built-in name, HF folder with config.json, or .gguf file"
    ),
    tokens: str = typer.Option(
        ..., "--tokens", "-t", help="tokens per sequence: 131072 (exact), 128K (x1024), 1M (x1048576)"
    ),
    batch: int = typer.Option(1, "--batch", "-b", help="sequences"),
    layers: int | None = typer.Option(None, "--layers", help="attention layers (without --model)"),
    kv_heads: int | None = typer.Option(None, "--kv-heads", help="KV heads per layer (without --model)"),
    head_dim: int | None = typer.Option(None, "--head-dim", help="head dimension (without --model)"),
    dtype: str | None = typer.Option(
        None, "--dtype", help="K/V element type: bfloat16, float16, float32, float8, int8 (overrides the model's)"
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="FlashMemoryConfig YAML: show the device/cold split"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    from flashmem.memory.calculator import estimate

    est = estimate(
        model,
        tokens=tokens,
        batch=batch,
        dtype=dtype,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        config=config,
    )
    if as_json:
        typer.echo(json.dumps(est.to_dict(), indent=2))
        return
    _print(est)


def _print(est: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from flashmem.memory.units import fmt_bytes

    con = Console()
    con.print(
        f"[bold]{est.model}[/bold]  ({est.source}; {est.layers} layers, {est.dtype}, " f"{est.element_bytes} B/element)"
    )
    con.print(f"layers: {est.layer_summary}")
    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column()
    bpt = est.bytes_per_token
    t.add_row(
        "bytes per token",
        f"{bpt:,}" if isinstance(bpt, int) else f"{bpt:,.3f}",
        "one sequence, each further token at long context",
    )
    if est.fixed_bytes:
        t.add_row("window bytes", f"{est.fixed_bytes:,}", "bounded sliding windows, one sequence")
    t.add_row("tokens x batch", f"{est.tokens:,} x {est.batch}", "")
    t.add_row("full cache", f"{est.full_cache_bytes:,} B", fmt_bytes(est.full_cache_bytes))
    if est.flashmem is not None:
        f = est.flashmem
        t.add_row("flashmem device", f"{f.device_resident_bytes:,} B", fmt_bytes(f.device_resident_bytes))
        if f.prompt_kv_bytes:
            t.add_row(
                "flashmem device, prompt",
                f"{f.prompt_peak_bytes:,} B",
                f"{fmt_bytes(f.prompt_peak_bytes)}, at most: the exact prompt's K/V until the first token",
            )
        t.add_row(f"flashmem cold ({f.cold_codec})", f"{f.cold_bytes:,} B", fmt_bytes(f.cold_bytes))
        if f.cold_layout != "exact":
            t.add_row("cold low-rank", f.cold_layout, "cold_low_rank, low_rank_dim")
        t.add_row("cold bytes per token", f"{f.cold_bytes_per_token:,.1f}", "one sequence")
        if est.full_cache_bytes:
            t.add_row("device / full", f"{f.device_resident_bytes / est.full_cache_bytes:.4f}", "")
    con.print(t)
    if est.flashmem is not None:
        tt = Table(title="FlashMemory device-resident bytes per tier (whole batch)")
        tt.add_column("tier")
        tt.add_column("bytes", justify="right")
        tt.add_column("size")
        for k, v in est.flashmem.tiers.items():
            if v:
                tt.add_row(k, f"{v:,}", fmt_bytes(v))
        con.print(tt)
        con.print(
            f"managed layers: {est.flashmem.managed_layers.count}; "
            f"full layers: {est.flashmem.full_layers or 'none'}"
        )
    ft = Table(title="fits on (KV cache alone, weights not counted)")
    ft.add_column("accelerator")
    ft.add_column("full cache")
    if est.flashmem is not None:
        ft.add_column("flashmem device" + (" (prompt peak)" if est.flashmem.prompt_kv_bytes else ""))
    for name, ok in est.fits.items():
        row = [name, "yes" if ok else "no"]
        if est.flashmem is not None:
            row.append("yes" if est.flashmem.fits[name] else "no")
        ft.add_row(*row)
    con.print(ft)


def register(app: typer.Typer) -> None:
    app.command("estimate", help=HELP)(estimate_command)
