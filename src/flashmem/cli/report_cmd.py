"""`flashmem report`: merge benchmark result files, print tables, write plots and markdown.

Sweeps too long for one process are run as several `flashmem bench` commands
into separate files; this command merges their rows (by cell), and can write
the merged JSON, the suite's plots, and the README's results block.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import typer

from flashmem.errors import FlashMemError


def report(
    files: list[Path] = typer.Argument(..., help="result JSONs written by `flashmem bench`"),
    json_out: Path | None = typer.Option(None, "--json-out", help="write the merged rows (one suite)"),
    plot: Path | None = typer.Option(None, "--plot", help="PNG figure(s) of the merged rows (one suite)"),
    markdown: Path | None = typer.Option(None, "--markdown", help="write the tables as markdown"),
    readme: Path | None = typer.Option(
        None, "--readme", help="replace the block between <!-- flashmem-results:begin/end --> in this file"
    ),
    methods: str | None = typer.Option(
        None, "--methods", help="keep only these methods' rows (comma-separated, e.g. full,flashmem)"
    ),
) -> None:
    """Merge result files; print every suite's table."""
    from flashmem.cli.inputs import check_output_path, check_results_file
    from flashmem_eval import report as R

    for f in files:
        check_results_file(f)
    for path, flag in ((json_out, "--json-out"), (markdown, "--markdown")):
        check_output_path(path, flag)
    rows, runs = R.load_rows(files)
    if methods is not None:
        rows = _keep_methods(rows, methods)
    suites = sorted({str(r.get("suite")) for r in rows})
    if (json_out or plot) and len(suites) != 1:
        raise FlashMemError(
            f"--json-out/--plot: the files hold suites {', '.join(suites) or 'none'}; allowed: exactly one"
        )
    for suite in suites:
        R.print_table(rows, suite)
    if json_out is not None:
        _write_json(json_out, suites[0], rows, runs, files)
    if plot is not None:
        for p in R.plot(rows, suites[0], plot):
            typer.echo(f"wrote {p}")
    if markdown is not None or readme is not None:
        opts = [
            ("--methods", methods),
            ("--json-out", json_out),
            ("--plot", plot),
            ("--markdown", markdown),
            ("--readme", readme),
        ]
        text = R.results_markdown(rows, [str(f) for f in files], runs, _command_line(files, opts))
        _write_markdown(text, markdown, readme)


def _keep_methods(rows: list[dict[str, Any]], methods: str) -> list[dict[str, Any]]:
    """The rows of the comma-separated `methods`; FlashMemError naming any the files do not hold."""
    keep = [m.strip() for m in methods.split(",") if m.strip()]
    found = sorted({str(r.get("method")) for r in rows})
    missing = [m for m in keep if m not in found]
    if not keep or missing:
        raise FlashMemError(
            f"--methods: {', '.join(missing) or repr(methods)} not in the files; allowed: {', '.join(found)}"
        )
    return [r for r in rows if r.get("method") in keep]


def _write_json(json_out: Path, suite: str, rows: list[dict[str, Any]], runs: Any, files: list[Path]) -> None:
    """The merged rows with their provenance (runs, source files, this machine)."""
    import json

    from flashmem_eval.harness import environment

    doc = {
        "meta": {"suite": suite, "runs": runs, "merged_from": [str(f) for f in files], **environment()},
        "rows": rows,
    }
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(doc, indent=1))
    typer.echo(f"wrote {json_out}")


def _command_line(files: list[Path], opts: list[tuple[str, Any]]) -> str:
    """The `flashmem report` command that reproduces this output (quoted for a shell)."""
    return " ".join(
        [
            "flashmem report",
            *map(shlex.quote, map(str, files)),
            *(f"{k} {shlex.quote(str(v))}" for k, v in opts if v is not None),
        ]
    )


def _write_markdown(text: str, markdown: Path | None, readme: Path | None) -> None:
    """The results markdown to --markdown, and into --readme's results block."""
    from flashmem_eval import report as R

    if markdown is not None:
        markdown.write_text(text)
        typer.echo(f"wrote {markdown}")
    if readme is not None:
        if not readme.is_file():
            raise FlashMemError(f"--readme: {str(readme)!r} does not exist")
        readme.write_text(R.replace_block(readme.read_text(), text))
        typer.echo(f"updated {readme}")


def register(app: typer.Typer) -> None:
    app.command("report")(report)
