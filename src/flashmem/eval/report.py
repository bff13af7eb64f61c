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
}


def _mean(vals: list[Any]) -> float | None:
    xs = [float(v) for v in vals if isinstance(v, (int, float, bool)) and v is not None and not (isinstance(v, float) and math.isnan(v))]
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
        s: dict[str, Any] = {"method": method, "budget": budget, "length": length, "n": len(ok),
                             "errors": len(rs) - len(ok)}
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

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if r.get("suite") == suite and not r.get("error")]
    summary = summarize(rows, suite)
    written = []
    lengths = sorted({s["length"] for s in summary})
    methods = sorted({s["method"] for s in summary})
    if suite in ("fidelity", "retrieval"):
        metric = {"fidelity": ["kl_mean", "top1_agree"], "retrieval": ["correct"]}[suite]
        fig, axes = plt.subplots(len(metric), len(lengths), figsize=(4.5 * len(lengths), 3.6 * len(metric)),
                                 squeeze=False)
        for i, mname in enumerate(metric):
            for j, L in enumerate(lengths):
                ax = axes[i][j]
                for meth in methods:
                    # x = measured resident fraction (the nominal budget where none was measured)
                    pts = sorted((s.get("ratio") or s["budget"], s[mname]) for s in summary
                                 if s["method"] == meth and s["length"] == L and s[mname] is not None)
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
                ax.set_ylabel({"kl_mean": "mean KL(full||method)", "top1_agree": "top-1 agreement",
                               "correct": "accuracy"}[mname])
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
        metric = {"memory": ["bytes_per_token", "rss_peak_over_model"],
                  "speed": ["prefill_tok_s", "decode_ms_per_token"]}[suite]
        fig, axes = plt.subplots(1, len(metric), figsize=(5.5 * len(metric), 4), squeeze=False)
        for j, mname in enumerate(metric):
            ax = axes[0][j]
            for meth in methods:
                for b in sorted({s["budget"] for s in summary if s["method"] == meth}):
                    pts = sorted((s["length"], s[mname]) for s in summary
                                 if s["method"] == meth and s["budget"] == b and s[mname] is not None)
                    if pts:
                        lab = meth if meth == "full" else f"{meth} b={b:.3g}"
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lab,
                                ls="--" if meth == "full" else "-")
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
    fig, axes = plt.subplots(nrows, cols, figsize=(3.8 * cols, 1.4 + 0.5 * 5 * nrows), squeeze=False,
                             constrained_layout=True)
    for k, (meth, b) in enumerate(keys):
        ax = axes[k // cols][k % cols]
        rs = groups[(meth, b)]
        Ls = sorted({int(r["length"]) for r in rs})
        Ds = sorted({float(r["depth"]) for r in rs})
        grid = [[_mean([r["correct"] for r in rs if int(r["length"]) == L and float(r["depth"]) == d])
                 for d in Ds] for L in Ls]
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
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in summary:
        out.append("| " + " | ".join(f"{s[c]:.4g}" if c == "budget" else _fmt(s.get(c)) for c in cols) + " |")
    return "\n".join(out)
