"""Results table (rich) and plots (matplotlib) from benchmark rows."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

COLUMNS = {
    "fidelity": ["ratio", "kl_mean", "top1_agree", "ppl_full", "ppl_diff"],
    "retrieval": ["ratio", "ratio_whole", "correct"],
    "memory": ["ratio", "ratio_whole", "bytes_per_token", "rss_model", "rss_peak", "rss_peak_over_model"],
    "speed": ["ratio", "prefill_tok_s", "decode_ms_per_token", "prefill_speed_vs_full", "decode_time_vs_full"],
    "tasks": ["ratio", "score"],
}


def _mean(vals: list[Any]) -> float | None:
    xs = [
        float(v)
        for v in vals
        if isinstance(v, (int, float, bool)) and v is not None and not (isinstance(v, float) and math.isnan(v))
    ]
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list[dict[str, Any]], suite: str) -> list[dict[str, Any]]:
    """Mean of each metric per (method, budget, length); `n` cells, `errors` failed."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("suite") != suite:
            continue
        groups[(r["method"], float(r["budget"]), int(r.get("length", 0)))].append(r)
    out = []
    for (method, budget, length), rs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0], -kv[0][1])):
        ok = [r for r in rs if not r.get("error")]
        s: dict[str, Any] = {
            "method": method,
            "budget": budget,
            "length": length,
            "n": len(ok),
            "errors": len(rs) - len(ok),
        }
        for c in COLUMNS.get(suite, []):
            s[c] = _mean([r.get(c) for r in ok])
        out.append(s)
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def print_table(rows: list[dict[str, Any]], suite: str) -> list[dict[str, Any]]:
    from rich.console import Console
    from rich.table import Table

    summary = summarize(rows, suite)
    cols = ["method", "budget", "length", "n", "errors", *COLUMNS.get(suite, [])]
    table = Table(title=f"flashmem bench {suite}")
    for c in cols:
        table.add_column(c, justify="left" if c == "method" else "right")
    for s in summary:
        table.add_row(*[_fmt(s[c]) if c != "budget" else f"{s[c]:.4g}" for c in cols])
    Console(width=200).print(table)
    return summary


def plot(rows: list[dict[str, Any]], suite: str, path: str | Path) -> list[Path]:
    """Write the suite's figure(s); returns the files written (retrieval adds heatmaps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if suite == "tasks":
        from flashmem.errors import FlashMemError

        raise FlashMemError("--plot: the tasks suite has no figure; allowed with: fidelity, retrieval, memory, speed")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if r.get("suite") == suite and not r.get("error")]
    summary = summarize(rows, suite)
    written = []
    lengths = sorted({s["length"] for s in summary})
    methods = sorted({s["method"] for s in summary})
    if suite in ("fidelity", "retrieval"):
        metric = {"fidelity": ["kl_mean", "top1_agree"], "retrieval": ["correct"]}[suite]
        fig, axes = plt.subplots(
            len(metric), len(lengths), figsize=(4.5 * len(lengths), 3.6 * len(metric)), squeeze=False
        )
        for i, mname in enumerate(metric):
            for j, L in enumerate(lengths):
                ax = axes[i][j]
                for meth in methods:
                    # x = measured resident fraction (the nominal budget where none was measured)
                    pts = sorted(
                        (s.get("ratio") or s["budget"], s[mname])
                        for s in summary
                        if s["method"] == meth and s["length"] == L and s[mname] is not None
                    )
                    if not pts:
                        continue
                    if meth == "full" and mname == "kl_mean":
                        continue  # zero by definition; no place on a log axis
                    if meth == "full":
                        ax.axhline(pts[0][1], color="k", ls="--", lw=1, label="full")
                    else:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=meth)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("measured resident KV / full KV (global layers)")
                ax.set_ylabel(
                    {"kl_mean": "mean KL(full||method)", "top1_agree": "top-1 agreement", "correct": "accuracy"}[mname]
                )
                if mname == "kl_mean":
                    ax.set_yscale("log")
                ax.set_title(f"L={L}")
                ax.grid(alpha=0.3)
        for row in axes[:1]:  # every length has its own methods: label each panel
            for ax in row:
                ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        if suite == "retrieval":
            written += _heatmaps(rows, path, plt)
    else:
        metric = {
            "memory": ["bytes_per_token", "rss_peak_over_model"],
            "speed": ["prefill_tok_s", "decode_ms_per_token"],
        }[suite]
        fig, axes = plt.subplots(1, len(metric), figsize=(5.5 * len(metric), 4), squeeze=False)
        for j, mname in enumerate(metric):
            ax = axes[0][j]
            for meth in methods:
                for b in sorted({s["budget"] for s in summary if s["method"] == meth}):
                    pts = sorted(
                        (s["length"], s[mname])
                        for s in summary
                        if s["method"] == meth and s["budget"] == b and s[mname] is not None
                    )
                    if pts:
                        lab = meth if meth == "full" else f"{meth} b={b:.3g}"
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            marker="o",
                            label=lab,
                            ls="--" if meth == "full" else "-",
                        )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(mname)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _heatmaps(rows: list[dict[str, Any]], path: Path, plt: Any) -> list[Path]:
    """One length x depth accuracy heatmap per (method, budget)."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["method"], float(r["budget"]))].append(r)
    keys = sorted(groups)
    if not keys:
        return []
    n = len(keys)
    cols = min(4, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(
        nrows, cols, figsize=(3.8 * cols, 1.4 + 0.5 * 5 * nrows), squeeze=False, constrained_layout=True
    )
    for k, (meth, b) in enumerate(keys):
        ax = axes[k // cols][k % cols]
        rs = groups[(meth, b)]
        Ls = sorted({int(r["length"]) for r in rs})
        Ds = sorted({float(r["depth"]) for r in rs})
        grid = [
            [_mean([r["correct"] for r in rs if int(r["length"]) == L and float(r["depth"]) == d]) for d in Ds]
            for L in Ls
        ]
        data = [[float("nan") if v is None else v for v in row] for row in grid]
        im = ax.imshow(data, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(Ds)), [f"{d:g}" for d in Ds])
        ax.set_yticks(range(len(Ls)), [str(L) for L in Ls])
        ax.set_xlabel("depth")
        ax.set_ylabel("length")
        ax.set_title(meth if meth == "full" else f"{meth} b={b:.3g}", fontsize=9)
    for k in range(n, nrows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6, label="accuracy")
    fig.suptitle("retrieval accuracy (passkey + multi-key pooled) by length and needle depth")
    out = path.with_name(path.stem + "_heatmap" + path.suffix)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]


def markdown_table(rows: list[dict[str, Any]], suite: str, columns: list[str] | None = None) -> str:
    """The summary as a GitHub markdown table (for results/README.md)."""
    summary = summarize(rows, suite)
    cols = ["method", "budget", "length", "n", *(columns or COLUMNS.get(suite, []))]
    out = ["| " + " | ".join(c + " (MB)" if c.startswith("rss_") else c for c in cols) + " |", "|" + "---|" * len(cols)]
    for s in summary:
        out.append("| " + " | ".join(_cell(c, s.get(c)) for c in cols) + " |")
    return "\n".join(out)


def _cell(col: str, v: Any) -> str:
    if col == "budget":
        return _budget(v)
    if col.startswith("rss_") and isinstance(v, (int, float)):
        return f"{v / 1e6:.0f}"  # bytes -> MB
    return _fmt(v)


# ----------------------------------------------------------------------------- merged reports
def load_rows(paths: list[str | Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows and runs of several result JSONs, merged by `cell` (later files win).

    A file's `.partial.jsonl` beside it is read too (rows of a run that was
    interrupted before it wrote the JSON). Rows with an error never replace a
    measured one.
    """
    import json

    from flashmem.errors import FlashMemError

    rows: dict[str, dict[str, Any]] = {}
    runs: list[dict[str, Any]] = []

    def take(r: dict[str, Any]) -> None:
        if "cell" not in r:
            return
        old = rows.get(r["cell"])
        if r.get("error") and old is not None and not old.get("error"):
            return
        if old is not None and "item_gaps" in old and "item_gaps" not in r and old.get("output") == r.get("output"):
            # a copy of the same answer (full-cache rows are copied between runs) keeps the decision
            # margins another file measured for that output (`task_suite margins`)
            r = {**r, "gaps": old.get("gaps"), "item_gaps": old["item_gaps"]}
        rows[r["cell"]] = r

    for p in map(Path, paths):
        partial = p.with_name(p.name + ".partial.jsonl")
        file_rows, file_runs, meta = [], [], {}
        if p.is_file():
            try:
                doc = json.loads(p.read_text())
                meta = doc.get("meta", {})
                file_rows, file_runs = doc["rows"], meta.get("runs", [])
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise FlashMemError(
                    f"results file: {str(p)!r} is not a `flashmem bench` JSON (needs 'rows' and 'meta')"
                ) from None
        elif not partial.is_file():
            raise FlashMemError(f"results file: {str(p)!r} does not exist; allowed: a JSON written by `flashmem bench`")
        for r in file_rows:
            take(r)
        if partial.is_file():
            for line in partial.read_text().splitlines():
                try:
                    take(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by an interrupted write
        runs += [_run_source(r, p, meta) for r in file_runs]
    return list(rows.values()), runs


def _run_source(run: dict[str, Any], p: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """A run of file `p` with where it was written (`file`: kept from a merged file's source,
    `path`), its suite and its model (from the file's meta where the run lacks them)."""
    out = dict(run)
    out.setdefault("file", p.name)
    out.setdefault("path", str(p.with_name(out["file"])))
    out.setdefault("suite", meta.get("suite"))
    out.setdefault("model", meta.get("model"))
    return out


def _frac(b: Any) -> str:
    return _budget(float(b)) if isinstance(b, (int, float)) else str(b)


def run_command(run: dict[str, Any]) -> str:
    """The command that makes `run` again, from its recorded arguments (`command` where the run
    recorded one): `flashmem bench`, or `python -m flashmem_eval.task_suite run` for a tasks run
    with --answered-only (`flashmem bench` has no such flag), and --stored-prompts in place of its
    seeds and wordings where the run took its prompts from the file's full-cache rows."""
    import shlex

    if run.get("command"):
        return str(run["command"])

    def join(xs: Any) -> str:
        return ",".join(_frac(x) if isinstance(x, float) else str(x) for x in xs)

    suite = str(run.get("suite") or "?")
    path = str(run.get("path") or run.get("file") or "?")
    stored = bool(run.get("stored_prompts"))  # the file's full-cache rows name the prompts, not seeds x wordings
    opts: list[tuple[str, Any]] = [("--model", run.get("model"))]
    for key, flag, fmt in (
        ("methods", "--methods", join),
        ("budgets", "--budgets", lambda xs: ",".join(_frac(x) for x in xs)),
        ("lengths", "--lengths", join),
        ("seeds", "--seeds", join),
        ("depths", "--depths", lambda xs: ",".join(f"{float(x):g}" for x in xs)),
        ("tasks", "--tasks", join),
        ("haystacks", "--haystacks", join),
        ("families", "--families", join),
    ):
        if run.get(key) and not (stored and key == "seeds"):
            opts.append((flag, fmt(run[key])))
    if run.get("wordings") and not stored:
        opts.append(("--wordings", run["wordings"]))
    if run.get("answered_only"):
        head = ["python -m flashmem_eval.task_suite run", shlex.quote(path), "--answered-only"]
        head += ["--stored-prompts"] if stored else []
        tail: list[tuple[str, Any]] = [("--threads", run.get("threads"))]
    else:
        head = [f"flashmem bench {suite}"]
        tail = [
            ("--n-cont", run.get("n_cont")),
            ("--chunk", run.get("chunk") if run.get("chunk") not in (None, 64) else None),
            ("--threads", run.get("threads")),
            ("--json-out", path),
        ]
    return " ".join([*head, *(f"{k} {shlex.quote(str(v))}" for k, v in [*opts, *tail] if v is not None)])


def runs_markdown(runs: list[dict[str, Any]]) -> str:
    """One line per run: its date, its command (from its recorded arguments) and any note."""
    lines = []
    for r in sorted(runs, key=lambda r: str(r.get("started", ""))):
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(f"- {str(r.get('started') or 'undated')[:10]}: `{run_command(r)}`{note}")
    return "\n".join(lines)


def _prompt_key(r: dict[str, Any]) -> tuple:
    return (r.get("task"), r.get("haystack"), int(r.get("length", 0)), float(r.get("depth", 0)), r.get("seed"))


def retrieval_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Accuracy per (method, budget, length) and relative to the full cache on the same prompts.

    `vs_full`: of the prompts the full cache answers, the share this method answers
    too (None when the full cache ran none of them or answered none there); a
    prompt the full cache misses does not count, whatever this method does.
    """
    ok = [r for r in rows if r.get("suite") == "retrieval" and not r.get("error") and "correct" in r]
    full = {_prompt_key(r): bool(r["correct"]) for r in ok if r["method"] == "full"}
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in ok:
        groups[(r["method"], float(r["budget"]), int(r["length"]))].append(r)
        groups[(r["method"], float(r["budget"]), 0)].append(r)  # 0 = all lengths pooled
    out = []
    for (meth, b, L), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "full", kv[0][0], -kv[0][1], kv[0][2])):
        both = [r for r in rs if _prompt_key(r) in full]
        full_hits = sum(full[_prompt_key(r)] for r in both)
        kept = sum(bool(r["correct"]) for r in both if full[_prompt_key(r)])
        out.append(
            {
                "method": meth,
                "budget": b,
                "length": L,
                "n": len(rs),
                "correct": sum(bool(r["correct"]) for r in rs),
                "accuracy": sum(bool(r["correct"]) for r in rs) / len(rs),
                "ratio": _mean([r.get("ratio") for r in rs]),
                "full_correct": full_hits if both else None,
                "vs_full": kept / full_hits if full_hits else None,
            }
        )
    return out


def retrieval_markdown(rows: list[dict[str, Any]]) -> str:
    """Pivot: one line per method and budget; per length `correct/n (x% of full)`."""
    summary = retrieval_summary(rows)
    lengths = sorted({s["length"] for s in summary if s["length"]})
    cols = ["method", "budget", *[f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths], "all"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    by = {(s["method"], s["budget"], s["length"]): s for s in summary}
    for meth, b in dict.fromkeys((s["method"], s["budget"]) for s in summary):
        cells = []
        for L in [*lengths, 0]:
            s = by.get((meth, b, L))
            if s is None:
                cells.append("-")
                continue
            vs = "" if s["vs_full"] is None or meth == "full" else f" ({100 * s['vs_full']:.0f}%)"
            cells.append(f"{s['correct']}/{s['n']}{vs}")
        out.append("| " + " | ".join([meth, "1" if meth == "full" else _budget(b), *cells]) + " |")
    return "\n".join(out)


def fidelity_markdown(rows: list[dict[str, Any]]) -> str:
    """Pivot: one line per method and length, `KL / top-1` per budget."""
    summary = [s for s in summarize(rows, "fidelity") if s["n"]]
    budgets = sorted({s["budget"] for s in summary if s["method"] != "full"}, reverse=True)
    cols = ["method", "length", *[_budget(b) for b in budgets]]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    by = {(s["method"], s["length"], s["budget"]): s for s in summary}
    for L in sorted({s["length"] for s in summary}):
        for meth in sorted({s["method"] for s in summary if s["length"] == L and s["method"] != "full"}):
            cells = []
            for b in budgets:
                s = by.get((meth, L, b))
                cells.append("-" if s is None else f"{s['kl_mean']:.3f} / {100 * s['top1_agree']:.0f}%")
            out.append("| " + " | ".join([meth, str(L), *cells]) + " |")
    return "\n".join(out)


def _budget(b: float) -> str:
    if b == 1:
        return "1"
    inv = 1 / b if b else 0
    return f"1/{inv:.0f}" if inv and abs(inv - round(inv)) < 1e-6 else f"{b:.4g}"


MARK_BEGIN = "<!-- flashmem-results:begin -->"
MARK_END = "<!-- flashmem-results:end -->"


def results_markdown(rows: list[dict[str, Any]], files: list[str], runs: list[dict[str, Any]], command: str) -> str:
    """Tables of every suite in `rows`, with the command and the dates of the runs."""
    started = sorted(r["started"][:10] for r in runs if r.get("started"))
    when = (
        started[0]
        if started and started[0] == started[-1]
        else (f"{started[0]} to {started[-1]}" if started else "unknown")
    )
    parts = [f"Generated by `{command}` from {', '.join(f'`{f}`' for f in files)} (runs {when})."]
    titles = {
        "fidelity": "Fidelity (mean KL(full || method) / top-1 agreement, per budget)",
        "retrieval": "Retrieval (correct / prompts; in brackets: of the prompts the full cache answers, the share answered)",
        "memory": "Memory",
        "speed": "Speed",
        "tasks": "Task families (items of the full cache's answers also answered / the full cache's, per family)",
    }
    pivots = {"fidelity": fidelity_markdown, "retrieval": retrieval_markdown, "tasks": tasks_results_markdown}
    for suite in ("fidelity", "retrieval", "memory", "speed", "tasks"):
        rs = [r for r in rows if r.get("suite") == suite]
        if not rs:
            continue
        models = sorted({str(r.get("model")) for r in rs})
        parts.append(f"**{titles[suite]}** ({', '.join(models)})")
        parts.append(pivots[suite](rs) if suite in pivots else markdown_table(rs, suite))
        mine = [r for r in runs if r.get("suite") in (suite, None)]
        if mine:
            fill = {"model": models[0]} if len(models) == 1 else {}  # runs of a merged file lack it
            parts.append("Measured by:\n\n" + runs_markdown([r if r.get("model") else {**r, **fill} for r in mine]))
    return "\n\n".join(parts) + "\n"


def replace_block(text: str, block: str) -> str:
    """`text` with the part between the results markers replaced by `block`."""
    from flashmem.errors import FlashMemError

    a, b = text.find(MARK_BEGIN), text.find(MARK_END)
    if a < 0 or b < a:
        raise FlashMemError(
            f"readme: the markers {MARK_BEGIN} and {MARK_END} are missing; add them where the tables go"
        )
    return text[: a + len(MARK_BEGIN)] + "\n" + block + text[b:]


# ----------------------------------------------------------------------------- tasks suite
def _task_key(r: dict[str, Any]) -> tuple:
    return (r.get("family"), r.get("haystack"), int(r.get("length", 0)), r.get("seed"), r.get("wording"))


def tasks_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (family, method, budget, length; length 0 = pooled): mean score and `vs_full`, the
    share of the items the full cache answers on the same prompts that this method answers too
    (an item the full cache misses does not count, whatever the method does)."""
    ok = [r for r in rows if r.get("suite") == "tasks" and not r.get("error") and "hits" in r]
    full = {_task_key(r): list(r["hits"]) for r in ok if r["method"] == "full"}
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in ok:
        for L in (int(r["length"]), 0):
            groups[(r["family"], r["method"], float(r["budget"]), L)].append(r)
    out = []
    for (fam, meth, b, L), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "full", kv[0][1], -kv[0][2], kv[0][3])
    ):
        both = [r for r in rs if _task_key(r) in full]
        full_items = sum(sum(full[_task_key(r)]) for r in both)
        kept = sum(sum(f and h for f, h in zip(full[_task_key(r)], r["hits"])) for r in both)
        out.append(
            {
                "family": fam,
                "method": meth,
                "budget": b,
                "length": L,
                "n": len(rs),
                "score": _mean([r["score"] for r in rs]),
                "ratio": _mean([r.get("ratio") for r in rs]),
                "full_items": full_items if both else None,
                "kept_items": kept if both else None,
                "vs_full": kept / full_items if full_items else None,
            }
        )
    return out


def tasks_markdown(rows: list[dict[str, Any]], length: int = 0) -> str:
    """Pivot: one line per method and budget, one column per family: `kept/full items (x%)`,
    the items of the full cache's answers this method answers too (length 0: all pooled)."""
    summary = [s for s in tasks_summary(rows) if s["length"] == length]
    fams = list(dict.fromkeys(s["family"] for s in summary))
    cols = ["method", "budget", *fams]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    by = {(s["family"], s["method"], s["budget"]): s for s in summary}
    keys = sorted({(s["method"], s["budget"]) for s in summary}, key=lambda k: (k[0] != "full", k[0], -k[1]))
    for meth, b in keys:
        cells = []
        for f in fams:
            s = by.get((f, meth, b))
            if s is None or s["full_items"] is None or (meth != "full" and not s["full_items"]):
                cells.append("-")  # no reference: the full cache ran none of these prompts or answered none
            elif meth == "full":
                cells.append(f"{s['full_items']} items, score {s['score']:.2f}")
            else:
                pct = "" if s["vs_full"] is None else f" ({100 * s['vs_full']:.0f}%)"
                cells.append(f"{s['kept_items']}/{s['full_items']}{pct}")
        out.append("| " + " | ".join([meth, "1" if meth == "full" else _budget(b), *cells]) + " |")
    return "\n".join(out)


# Decision margins of the full cache's found items, in nats (`flashmem_eval.tasks.item_gaps`):
# below 0.1 the runner-up token was at least 90% as likely, a coin flip; from 1 it was at most 37%.
MARGIN_EDGES = (0.1, 1.0)


def margin_band(gap: float) -> int:
    """The band of a decision margin: 0 below MARGIN_EDGES[0], ..., len(MARGIN_EDGES) above the last."""
    return sum(gap >= e for e in MARGIN_EDGES)


def margin_label(band: int) -> str:
    lo = ([0.0, *MARGIN_EDGES])[band]
    return f"margin >= {lo:g}" if band == len(MARGIN_EDGES) else f"margin {lo:g}-{MARGIN_EDGES[band]:g}"


def tally_by_margin(tally: list[list[int]] | None, full_gaps: list[Any], hits: list[bool]) -> list[list[int]]:
    """Add one answer to `tally` ([full items, kept items] per margin band; None: a new one): the
    items the full cache found (`item_gaps` not None), and which of them `hits` finds too."""
    tally = tally if tally is not None else [[0, 0] for _ in range(len(MARGIN_EDGES) + 1)]
    for g, h in zip(full_gaps, hits):
        if g is not None:
            tally[margin_band(g)][0] += 1
            tally[margin_band(g)][1] += bool(h)
    return tally


def tasks_margin_markdown(rows: list[dict[str, Any]]) -> str:
    """The full cache's items split by how firmly it found them (its decision margin: the
    smallest top-1 minus runner-up logit gap up to the item), and per method and budget the
    share of each part it keeps: `kept/full items (x%)` per family, all lengths pooled. Only
    prompts whose full-cache row has `item_gaps` count; "" when none has."""
    ok = [r for r in rows if r.get("suite") == "tasks" and not r.get("error") and "hits" in r]
    full = {_task_key(r): r["item_gaps"] for r in ok if r["method"] == "full" and r.get("item_gaps") is not None}
    if not full:
        return ""
    counts: dict[tuple, list[list[int]]] = {}
    for r in ok:
        gaps = full.get(_task_key(r))
        if r["method"] == "full" or gaps is None:
            continue
        key = (r["method"], float(r["budget"]), r["family"])
        counts[key] = tally_by_margin(counts.get(key), gaps, r["hits"])
    cols = ["method", "budget", "family", *(margin_label(i) for i in range(len(MARGIN_EDGES) + 1))]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for (meth, b, fam), c in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2])):
        cells = [f"{k}/{n} ({100 * k / n:.0f}%)" if n else "-" for n, k in c]
        out.append("| " + " | ".join([meth, _budget(b), fam, *cells]) + " |")
    return "\n".join(out)


def tasks_forced_markdown(rows: list[dict[str, Any]]) -> str:
    """Per method, budget and family, of the full cache's items (rows with `forced_hits`,
    `task_suite forced`): how many the method's own greedy answer finds, and how many it
    writes when fed the full cache's answer (teacher forcing: `tasks.forced_items`), with the
    margins of the items it does not write (its logit for the full cache's token below its own
    top-1's). Rows whose recorded answer this tree's cache does not write (`forced_reproduces`
    False) are left out and counted. "" when no row has them."""
    counts: dict[tuple, list[Any]] = {}
    other = 0  # rows whose own answer this tree's cache does not write (`forced_reproduces`)
    for r in rows:
        forced = r.get("forced_hits")
        if r.get("suite") != "tasks" or r.get("error") or forced is None:
            continue
        if r.get("forced_reproduces") is False:
            other += 1
            continue
        c = counts.setdefault((r["method"], float(r["budget"]), r["family"]), [0, 0, 0, []])
        for h, f, m in zip(r["hits"], forced, r["forced_margins"]):
            if f is None:  # an item the full cache did not find
                continue
            c[0] += 1
            c[1] += bool(h)
            c[2] += bool(f)
            if not f:
                c[3].append(m)
    if not counts and not other:
        return ""
    cols = [
        "method",
        "budget",
        "family",
        "full's items",
        "its answer finds",
        "fed the full answer, writes",
        "margins of the rest",
    ]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for (meth, b, fam), (n, greedy, forced, lost) in sorted(
        counts.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2])
    ):
        rest = ", ".join(f"{m:.3f}" for m in sorted(lost)) or "-"
        cells = [str(n), f"{greedy} ({100 * greedy / n:.0f}%)", f"{forced} ({100 * forced / n:.0f}%)", rest]
        out.append("| " + " | ".join([meth, _budget(b), fam, *cells]) + " |")
    if other:
        out += ["", f"({other} rows left out: their recorded answer is not what this tree's cache writes.)"]
    return "\n".join(out)


def full_answers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompts the full cache answers (score > 0), with its score and output."""
    out = []
    for r in rows:
        if r.get("suite") == "tasks" and r.get("method") == "full" and not r.get("error") and r.get("score"):
            keep = ("model", "family", "haystack", "length", "seed", "wording", "score", "items", "output")
            out.append({k: r.get(k) for k in keep})
    return sorted(out, key=lambda r: (r["family"], r["haystack"], r["length"], r["seed"]))


def tasks_results_markdown(rows: list[dict[str, Any]]) -> str:
    """The tasks pivot per length and pooled, then the prompts the full cache answers."""
    tasks = [r for r in rows if r.get("suite") == "tasks"]
    lengths = sorted({int(r["length"]) for r in tasks})
    several = len({r.get("model") for r in tasks}) > 1  # then each heading names its models

    def heading(L: int) -> str:
        models = sorted({str(r.get("model")) for r in tasks if not L or int(r["length"]) == L})
        return (f"{L // 1024}K" if L else "All lengths") + (f" ({', '.join(models)})" if several else "") + ":"

    parts = []
    for L in [*lengths, 0] if len(lengths) > 1 else lengths:
        parts.append(heading(L))
        parts.append(tasks_markdown(rows, L))
    margins = tasks_margin_markdown(rows)
    if margins:
        parts.append(
            "The full cache's items by its decision margin (the smallest top-1 minus runner-up logit gap, "
            "in nats, of its answer's tokens up to the item; the prompts whose full-cache row has one):"
        )
        parts.append(margins)
    forced = tasks_forced_markdown(rows)
    if forced:
        parts.append(
            "The full cache's items each method writes when fed the full cache's answer token by token "
            "(teacher forcing; `task_suite forced`), beside what its own greedy answer finds:"
        )
        parts.append(forced)
    answered = full_answers(rows)
    lines = [
        f"- {a['family']}, {a['haystack']}, {a['length'] // 1024}K"
        + (f" ({a['model']})" if several else "")
        + f", seed {a['seed']}, wording {a['wording']}: score {a['score']:.2f}"
        for a in answered
    ]
    parts.append(f"Prompts the full cache answers ({len(answered)}):\n\n" + "\n".join(lines))
    return "\n\n".join(parts)
