"""`flashmem` command line: each subcommand lives in its own module."""

from __future__ import annotations

import sys

import typer

from flashmem.errors import FlashMemError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="FlashMemory: a tiered, compressed, query-aware KV cache for transformers.",
)


def _register() -> None:
    # Imported here so `flashmem --help` stays fast and each command owns its file.
    from flashmem.cli import bench_cmd, calibrate_cmd, config_cmd, estimate_cmd, report_cmd, run_cmd

    for mod in (estimate_cmd, config_cmd, run_cmd, calibrate_cmd, bench_cmd, report_cmd):
        mod.register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user mistakes print one line and exit 2, never a traceback."""
    _register()
    try:
        app(args=argv, standalone_mode=True)
    except FlashMemError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
