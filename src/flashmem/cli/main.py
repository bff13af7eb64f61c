"""`flashmem` command line: each subcommand lives in its own module."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, NoReturn

import typer

from flashmem import progress
from flashmem.errors import FlashMemError

try:  # typer >= 0.2x vendors click; older releases use click itself
    from typer._click import exceptions as _click_exc
except ImportError:  # pragma: no cover
    import click.exceptions as _click_exc  # type: ignore[no-redef]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="FlashMemory: a tiered, compressed, query-aware KV cache for transformers.",
)


def _register() -> None:
    # Imported here so `flashmem --help` stays fast and each command owns its file.
    from flashmem.cli import (
        bench_cmd,
        calibrate_cmd,
        config_cmd,
        doctor_cmd,
        estimate_cmd,
        report_cmd,
        run_cmd,
        serve_cmd,
    )

    for mod in (estimate_cmd, config_cmd, run_cmd, serve_cmd, doctor_cmd, calibrate_cmd, bench_cmd, report_cmd):
        mod.register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user mistakes (bad flags included) print one line and exit 2, never a
    traceback or a usage box; SIGTERM unwinds like Ctrl-C, so cold-tier folders are removed."""
    _register()
    previous = _on_sigterm_exit()
    progress.quiet_bars_in_logs()  # before torch/transformers import tqdm
    shown = progress.enable(True)  # conversion, layer profile, prefill, decode (flashmem.progress)
    try:
        code = typer.main.get_command(app).main(args=argv, prog_name="flashmem", standalone_mode=False)
    except FlashMemError as exc:
        _fail(str(exc))
    except _click_exc.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # `flashmem` or `flashmem config` alone: the help is the answer
            sys.exit(exc.exit_code)
        _fail(_usage_line(exc))
    except _click_exc.ClickException as exc:  # e.g. FileError
        _fail(exc.format_message())
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    finally:
        progress.enable(shown)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    sys.exit(code or 0)


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    sys.exit(2)


def _usage_line(exc: Any) -> str:
    """click's usage error as one line: what was wrong, and where the allowed forms are."""
    ctx = getattr(exc, "ctx", None)
    where = f"{ctx.command_path} --help" if ctx is not None else "flashmem --help"
    return f"{exc.format_message().rstrip('.')}; allowed: see `{where}`"


def _on_sigterm_exit() -> Any:
    """SIGTERM raises SystemExit(143) in the main thread: `finally` blocks and exit-time
    finalizers run (the cold tier closes and removes its folder) instead of a hard kill."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    main()
