"""`flashmem bench <suite>`: fidelity, retrieval, memory, speed and tasks benchmarks.

Results are appended per cell to `<json-out>.partial.jsonl` as they are
measured; a rerun with the same --json-out skips cells already done. At the end
the rows go to --json-out, a table is printed, and --plot writes the figure(s).
"""

from __future__ import annotations

from pathlib import Path

import typer

from flashmem.errors import FlashMemError


def _floats(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "/" in part:
                a, b = part.split("/", 1)
                out.append(float(a) / float(b))
            else:
                out.append(float(part))
        except (ValueError, ZeroDivisionError):
            raise FlashMemError(f"--budgets: {part!r} is not a number; allowed: e.g. 1/4,1/8 or 0.25") from None
    for v in out:
        if not 0 < v <= 1:
            raise FlashMemError(f"--budgets: {v!r} is not allowed; allowed: 0 < budget <= 1")
    return out


def _ints(text: str, name: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            out.append(int(float(part.rstrip("k")) * mult))
        except (ValueError, OverflowError):
            raise FlashMemError(f"{name}: {part!r} is not an integer; allowed: e.g. 4096,8k") from None
    return out


def _choices(text: str, name: str, allowed: tuple[str, ...]) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    for part in out:
        if part not in allowed:
            raise FlashMemError(f"{name}: {part!r} is not known; allowed: {', '.join(allowed)}")
    if not out:
        raise FlashMemError(f"{name}: empty; allowed: {', '.join(allowed)}")
    return out


def _depths(text: str) -> list[float]:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            d = float(part)
        except ValueError:
            raise FlashMemError(
                f"--depths: {part!r} is not a number; allowed: depths from 0 to 1, e.g. 0,0.5,1"
            ) from None
        if not 0 <= d <= 1:
            raise FlashMemError(f"--depths: {part!r} is not allowed; allowed: depths from 0 to 1, e.g. 0,0.5,1")
        out.append(d)
    return out


def bench(
    suite: str = typer.Argument(..., help="fidelity | retrieval | memory | speed | tasks"),
    model: str | None = typer.Option(None, "--model", help="smollm2 | gemma3-270m | tiny | HF folder"),
    methods: str = typer.Option(
        "full,streaming,snapkv,flashmem",
        "--methods",
        help="comma list: full, streaming, snapkv, flashmem[:variant], kvpress:<Press>",
    ),
    budgets: str = typer.Option("1/4,1/8,1/16,1/32", "--budgets", help="resident KV / full KV"),
    lengths: str | None = typer.Option(None, "--lengths", help="context lengths, e.g. 4k,8k"),
    seeds: str = typer.Option("0", "--seeds"),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="retrieval: needle depths"),
    tasks: str = typer.Option("passkey,multikey", "--tasks", help="retrieval: passkey, multikey, locker"),
    haystacks: str | None = typer.Option(
        None, "--haystacks", help="retrieval / tasks: haystack texts, kjv and/or stdlib-doc (tasks: both by default)"
    ),
    families: str = typer.Option(
        "keyed,multivalue,multiquery,vartrack,aggregation,passage",
        "--families",
        help="tasks: keyed, multivalue, multiquery, vartrack, aggregation, passage",
    ),
    wordings: str = typer.Option("dev", "--wordings", help="tasks: the wording set, dev | heldout | all"),
    n_cont: int = typer.Option(256, "--n-cont", help="fidelity: teacher-forced continuation tokens"),
    chunk: int = typer.Option(64, "--chunk", help="fidelity: continuation tokens per forward"),
    decode_tokens: int = typer.Option(32, "--decode-tokens", help="speed: decoded tokens timed"),
    threads: int = typer.Option(2, "--threads", help="torch threads"),
    json_out: Path = typer.Option(..., "--json-out", help="results JSON (and .partial.jsonl beside it)"),
    plot: Path | None = typer.Option(None, "--plot", help="PNG figure (retrieval adds *_heatmap.png)"),
    no_progress: bool = typer.Option(False, "--no-progress"),
) -> None:
    """Run one benchmark suite; resumable."""
    from flashmem.cli.inputs import check_output_path
    from flashmem_eval import report
    from flashmem_eval.suites import DEFAULT_LENGTHS, DEFAULT_MODEL, HAYSTACKS, SUITES, TASKS, BenchArgs, run_suite
    from flashmem_eval.tasks import FAMILIES, WORDING_SETS

    if suite not in SUITES:
        raise FlashMemError(f"suite: {suite!r} is not known; allowed: {', '.join(SUITES)}")
    check_output_path(json_out, "--json-out")
    if plot is not None and suite == "tasks":
        raise FlashMemError("--plot: the tasks suite has no figure; allowed with: fidelity, retrieval, memory, speed")
    task_list = _choices(tasks, "--tasks", TASKS)
    haystack_list = _choices(haystacks or ("kjv,stdlib-doc" if suite == "tasks" else "kjv"), "--haystacks", HAYSTACKS)
    family_list = _choices(families, "--families", FAMILIES)
    if wordings not in WORDING_SETS:
        raise FlashMemError(f"--wordings: {wordings!r} is not known; allowed: {', '.join(WORDING_SETS)}")
    args = BenchArgs(
        suite=suite,
        model=model or DEFAULT_MODEL[suite],
        methods=[m.strip() for m in methods.split(",") if m.strip()],
        budgets=_floats(budgets),
        lengths=_ints(lengths, "--lengths") if lengths else list(DEFAULT_LENGTHS[suite]),
        json_out=json_out,
        seeds=_ints(seeds, "--seeds"),
        depths=_depths(depths),
        tasks=task_list,
        haystacks=haystack_list,
        families=family_list,
        wordings=wordings,
        n_cont=n_cont,
        chunk=chunk,
        decode_tokens=decode_tokens,
        threads=threads,
        progress=not no_progress,
    )
    store = run_suite(args)
    rows = list(store.rows.values())
    report.print_table(rows, suite)
    if suite == "tasks":
        typer.echo(report.tasks_markdown(rows))
    if plot is not None:
        for p in report.plot(rows, suite, plot):
            typer.echo(f"wrote {p}")
    typer.echo(f"wrote {json_out}")


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
