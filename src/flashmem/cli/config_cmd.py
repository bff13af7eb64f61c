"""`flashmem config check FILE [--model M]`: validate a FlashMemoryConfig YAML, naming
every bad key (one line each), not only the first."""

from __future__ import annotations

from pathlib import Path

import typer

config_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Work with FlashMemoryConfig YAML files.",
)


@config_app.command("check")
def check(
    file: Path = typer.Argument(..., help="YAML config (optionally under 'flash_memory:')"),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="also check keep_full_layers against this model's layers "
        "(built-in name, HF folder with config.json, or .gguf file)",
    ),
) -> None:
    """Validate FILE; with --model also check it against the model's layer count.
    Every bad key is named, one line each (exit 2)."""
    from flashmem.config import FlashMemoryConfig

    problems = FlashMemoryConfig.problems_in_yaml(file)
    if problems:
        for line in problems:
            typer.echo(f"error: {' '.join(line.split())}", err=True)
        if len(problems) > 1:
            typer.echo(f"error: {file}: {len(problems)} problems", err=True)
        raise typer.Exit(2)
    cfg = FlashMemoryConfig.from_yaml(file)
    where = ""
    if model is not None:
        from flashmem.sizing.specs import resolve_model

        spec = resolve_model(model)
        cfg.check_for_model(spec.num_layers)
        full = sorted(cfg.resolve_full_layers(spec.num_layers))
        where = f"; model {spec.name}: {spec.num_layers} layers, full layers {full or 'none'}"
    changed = [k for k in cfg.model_fields_set]
    summaries = f"csa {cfg.csa_chunk_size}, band {cfg.csa_band_tokens}" if cfg.use_summaries else "no summaries"
    pages = f", pages {cfg.lsa_page_tokens}" if cfg.lsa_page_tokens else ""
    typer.echo(
        f"ok: {file}: window {cfg.gpu_cache_limit}, block {cfg.hca_chunk_size}{pages}, "
        f"{summaries}, index {cfg.lsa_scorer}, sinks {cfg.sink_tokens}, "
        f"cold {cfg.cold_store}/{cfg.cold_codec}, keep_full_layers {cfg.keep_full_layers}"
        f"{where}; {len(changed)} key(s) set, others default"
    )


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
