"""The `tasks` suite: the task families of :mod:`flashmem_eval.tasks` under every method.

Laid out as the retrieval suite (`flashmem_eval.suites._retrieval`): one prompt per
(family, haystack, length, seed, wording), the eviction baselines sharing one
full-attention prefill, flashmem its own prefill per budget, the question fed
through the cache and the answer decoded greedily. Each row holds the output, its
score (share of the items found) and `hits` (item by item), so the report can say
what share of the full cache's answers a method keeps (`report.tasks_summary`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from flashmem.errors import FlashMemError
from flashmem_eval import harness as H
from flashmem_eval.baselines import Method
from flashmem_eval.tasks import (
    FAMILIES,
    WORDING_SETS,
    TaskProbe,
    forced_items,
    item_gaps,
    make_task,
    score_output,
    wordings,
)


def prompts_for(args: Any) -> list[tuple[str, str, int, int, int]]:
    """(family, haystack, length, seed, wording): seed s takes wording s mod the set's size, so
    three seeds cover three wordings without tripling the runs, and a seed keeps its wording
    whatever other seeds a run names (by position, `--seeds 1` alone took seed 1's prompts with
    wording 0, unlike `--seeds 0,1`, and a resumed run could not reuse them). Shorter lengths and
    earlier seeds first, every family and haystack in each: a run cut short holds whole rounds."""
    ws = wordings(args.wordings)
    return [
        (fam, hay, L, s, ws[s % len(ws)])
        for L in args.lengths
        for s in args.seeds
        for hay in args.haystacks
        for fam in args.families
    ]


def stored_prompts(args: Any, store: H.ResultStore) -> list[tuple[str, str, int, int, int]]:
    """(family, haystack, length, seed, wording) of every full-cache row in `store` of the run's
    families, haystacks and lengths (`--stored-prompts`), by seed, then haystack and family."""
    keys = {
        (r["family"], r["haystack"], r["length"], r["seed"], r["wording"])
        for r in store.rows.values()
        if r.get("suite") == "tasks" and r.get("method") == "full"
        and r.get("family") in args.families and r.get("haystack") in args.haystacks and r.get("length") in args.lengths
    }  # fmt: skip
    return sorted(keys, key=lambda k: (k[2], k[3], k[1], k[0], k[4]))


def full_answered(args: Any, store: H.ResultStore, key: dict[str, Any]) -> bool:
    """Whether the full cache's row for this prompt (family, haystack, length, seed, wording)
    found at least one item; a prompt without a full-cache row counts as answered (run it)."""
    row = store.rows.get(H.cell_id(suite=args.suite, model=args.model, method="full", budget=1.0, **key))
    return row is None or any(row.get("hits") or [])


def run_tasks(args: Any, loaded: H.Loaded, methods: list[Method], store: H.ResultStore) -> None:
    from flashmem_eval.suites import (
        _base_row,
        _cell,
        _err_row,
        _progress,
        _run_kvpress,
        answer_job,
        cells_for,
        done_local,
        local_answer,
    )

    model, tok = loaded.model, loaded.tokenizer
    cells = cells_for(methods, args.budgets)
    prompts = stored_prompts(args, store) if args.stored_prompts else prompts_for(args)
    prog = _progress(args, len(cells) * len(prompts))
    jobs: list[dict[str, Any]] = []
    bases: dict[str, dict[str, Any]] = {}
    probes: dict[str, TaskProbe] = {}
    stop = [i for i in [getattr(tok, "eos_token_id", None)] if i is not None]
    for fam, hay, L, s, w in prompts:
        key = dict(family=fam, haystack=hay, length=L, seed=s, wording=w)
        todo = [(m, b) for m, b in cells if not store.done(_cell(args, m, b, **key))]
        # the full cache first, so that answered_only can read its row
        todo.sort(key=lambda mb: mb[0].kind != "full")
        if hasattr(prog, "bar"):
            prog.bar.update(len(cells) - len(todo))
        if not todo:
            continue
        probe = make_task(tok, fam, L, s, hay=hay, wording=w)
        ctx, q = H.prompt_ids(tok, probe)
        shared: dict[str, Any] = {}
        for m, b in todo:
            cell = _cell(args, m, b, **key)
            if m.kind != "full" and getattr(args, "answered_only", False) and not full_answered(args, store, key):
                prog.step(f"{m.name} b={b:.3g} {fam} L={L} s={s}: skipped, the full cache answered nothing")
                continue
            row = _base_row(args, m, b, **key, cell=cell, context_tokens=int(ctx.shape[1]), items=probe.items)
            if m.kind == "kvpress":
                from flashmem_eval.baselines.kvpress_env import press_ratio

                row["compression_ratio"] = press_ratio(b)
                bases[cell], probes[cell] = row, probe
                jobs.append(answer_job(cell, m, b, ctx, q, probe.max_new, stop, model))
                continue
            t0 = time.perf_counter()
            try:
                # as in the retrieval suite: what decoding holds, measured after the answer
                gaps: list[float] = []
                gen, info = local_answer(loaded, m, b, ctx, q, probe.max_new, stop, shared, row, gaps)
                text = tok.decode(gen, skip_special_tokens=True)
                score, hits = score_output(text, probe)
                row.update(output=text, score=score, hits=hits)
                row.update(gaps=[round(g, 3) for g in gaps], item_gaps=item_gaps(tok, gen, gaps, probe))
                row.update({k: v for k, v in info.items() if k != "config"})
            except Exception as exc:  # recorded; the sweep goes on
                _err_row(row, exc)
            finally:
                done_local(shared, loaded) if m.kind == "flashmem" else None
            row["seconds"] = time.perf_counter() - t0
            store.add(row)
            prog.step(f"{m.name} b={b:.3g} {fam} L={L} s={s}")

    def finish(row: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
        text = tok.decode(r.get("generated", []), skip_special_tokens=True)
        row.pop("generated", None)
        score, hits = score_output(text, probes[row["cell"]])
        row.update(output=text, score=score, hits=hits)
        return row

    _run_kvpress(args, loaded, jobs, bases, store, finish, prog)
    prog.close()


def add_margins(store: H.ResultStore, loaded: H.Loaded) -> tuple[int, int]:
    """Give the full cache's rows of a tasks run without decision margins (runs from before
    `gaps` were recorded) their `gaps` and `item_gaps`, by decoding each prompt again with the
    full cache; a row whose output the new decode does not reproduce gets `margin_error`
    instead. Returns (rows given margins, rows not reproduced)."""
    done = bad = 0
    for r in list(store.rows.values()):
        if r.get("suite") != "tasks" or r.get("method") != "full" or "output" not in r:
            continue
        if "item_gaps" in r or "margin_error" in r:  # done, or tried and not reproduced
            continue
        again = _full_answer(loaded, r)
        if again is None:
            r["margin_error"] = "the full cache's output was not reproduced"
            bad += 1
        else:
            probe, _, _, gen, gaps = again
            r.update(gaps=[round(g, 3) for g in gaps], item_gaps=item_gaps(loaded.tokenizer, gen, gaps, probe))
            done += 1
        store.add(r)
    if done or bad:  # the file says which of its full-cache rows got their margins later, and when
        note = {"date": time.strftime("%Y-%m-%d"), "rows": done, "not_reproduced": bad}
        store.meta.setdefault("margins_added", []).append(note)
    store.write()
    return done, bad


def _full_answer(
    loaded: H.Loaded, row: dict[str, Any]
) -> tuple[TaskProbe, torch.Tensor, torch.Tensor, list[int], list[float]] | None:
    """The full cache's greedy answer to a full-cache row's prompt, decoded again -> (the
    probe, context ids, question ids, the answer's ids, each token's decision margin); None
    where it is not the row's recorded output."""
    from flashmem_eval.baselines import parse_method
    from flashmem_eval.suites import local_cache

    tok = loaded.tokenizer
    probe = make_task(tok, row["family"], row["length"], row["seed"], hay=row["haystack"], wording=row["wording"])
    ctx, q = H.prompt_ids(tok, probe)
    cache, _, _ = local_cache(loaded, parse_method("full"), 1.0, ctx, {})
    stop = [i for i in [getattr(tok, "eos_token_id", None)] if i is not None]
    gaps: list[float] = []
    gen = H.greedy(loaded.model, cache, q, probe.max_new, stop, gaps)
    if tok.decode(gen, skip_special_tokens=True) != row["output"]:
        return None
    return probe, ctx, q, gen, gaps


def add_forced(store: H.ResultStore, loaded: H.Loaded) -> tuple[int, int]:
    """Give each row of a method run here (flashmem, the eviction baselines) whose full-cache
    row found an item `forced_hits` and `forced_margins` (`tasks.forced_items`): the method's
    cache fed the full cache's answer, token by token, and asked whether it writes each item
    the full cache wrote; `forced_reproduces` says whether that agrees with the row's own
    answer (`agrees_with_answer`: else the row came from other code). The full cache's answer
    is decoded again and must reproduce the recorded output (else the prompt's rows get
    `forced_error`). Returns (rows given them, prompts not reproduced)."""
    from flashmem_eval.baselines import parse_method
    from flashmem_eval.suites import done_local, local_cache

    model, tok = loaded.model, loaded.tokenizer
    rows = list(store.rows.values())
    done = bad = 0
    for f in rows:
        if f.get("suite") != "tasks" or f.get("method") != "full" or not any(f.get("hits") or []):
            continue
        key = _prompt_key(f)
        todo = [
            r
            for r in rows
            if r is not f
            and _prompt_key(r) == key
            and not r.get("error")
            and "forced_hits" not in r
            and "forced_error" not in r
            and _runs_here(r["method"])
        ]
        if not todo:
            continue
        again = _full_answer(loaded, f)
        if again is None:
            for r in todo:
                r["forced_error"] = "the full cache's output was not reproduced"
                store.add(r)
            bad += 1
            continue
        probe, ctx, q, gen, _ = again
        for r in todo:
            shared: dict[str, Any] = {}
            try:
                cache, _, _ = local_cache(loaded, parse_method(r["method"]), float(r["budget"]), ctx, shared)
                tops, margins = H.forced(model, cache, q, gen)
            finally:
                done_local(shared, loaded)
            r["forced_hits"], r["forced_margins"] = forced_items(tok, gen, tops, margins, probe)
            r["forced_reproduces"] = agrees_with_answer(tok, gen, tops, r["output"])
            store.add(r)
            done += 1
    if done or bad:
        store.meta.setdefault("forced_added", []).append(
            {"date": time.strftime("%Y-%m-%d"), "rows": done, "prompts_not_reproduced": bad}
        )
    store.write()
    return done, bad


def agrees_with_answer(tok: Any, gen: list[int], tops: list[int], output: str) -> bool:
    """Whether a method's recorded greedy answer `output` is what this tree's cache writes, as
    far as teacher forcing on the full cache's answer `gen` shows it: the same tokens up to the
    first its top-1 `tops` writes otherwise, then that token (all of gen where none is). False
    means the row came from another recipe or code, and its forced items describe this one."""
    k = next((j for j, (a, b) in enumerate(zip(tops, gen)) if a != b), None)
    if k is None:
        return output == tok.decode(gen, skip_special_tokens=True)
    return output.startswith(tok.decode(gen[:k] + [tops[k]], skip_special_tokens=True))


def _runs_here(method: str) -> bool:
    """Whether a row's method builds its cache in this process (flashmem, the eviction
    baselines; not kvpress's runner, nor a name this tree does not know)."""
    from flashmem_eval.baselines import parse_method

    try:
        return parse_method(method).kind in ("flashmem", "eviction")
    except FlashMemError:
        return False


def _prompt_key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r.get("model"), r.get("family"), r.get("haystack"), r.get("length"), r.get("seed"), r.get("wording"))


def rescore(rows: list[dict[str, Any]], tok: Any) -> int:
    """Score the rows' saved outputs again with the current `score_output` (the prompt rebuilt
    from its seed: no model run); returns how many rows changed."""
    changed = 0
    probes: dict[tuple, TaskProbe] = {}
    for r in rows:
        if r.get("suite") != "tasks" or r.get("error") or "output" not in r:
            continue
        k = (r["family"], r["length"], r["seed"], r["haystack"], r["wording"])
        if k not in probes:
            probes[k] = make_task(tok, r["family"], r["length"], r["seed"], hay=r["haystack"], wording=r["wording"])
        score, hits = score_output(r["output"], probes[k])
        if hits != r.get("hits"):
            changed += 1
            r.update(score=score, hits=hits)
    return changed


def summary_markdown(rows: Any) -> str:
    """The share of the full cache's answers per family, dev and held-out wordings apart
    (`report.tasks_markdown` on each set's rows), with the prompts each set holds."""
    from flashmem_eval.report import tasks_forced_markdown, tasks_margin_markdown, tasks_markdown

    ok = [r for r in rows if r.get("suite") == "tasks" and not r.get("error")]
    out = []
    for name in ("dev", "heldout"):
        rs = [r for r in ok if r.get("wording") in WORDING_SETS[name]]
        if not rs:
            continue
        seeds = sorted({r["seed"] for r in rs})
        n = len({(r["family"], r["haystack"], r["length"], r["seed"]) for r in rs if r["method"] == "full"})
        out += [f"{name} wordings {list(WORDING_SETS[name])}, seeds {seeds}: {n} prompts", "", tasks_markdown(rs), ""]
    margins = tasks_margin_markdown(ok)
    if margins:
        out += ["The full cache's items by its decision margin (nats), all wordings:", "", margins, ""]
    forced = tasks_forced_markdown(ok)
    if forced:
        out += ["The full cache's items written when fed its answer (teacher forcing), all wordings:", "", forced, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """`python -m flashmem_eval.task_suite rescore FILE.json [--model smollm2]`: rescore a tasks
    run's rows (its .json and .partial.jsonl) in place, with the model's tokenizer only.
    `python -m flashmem_eval.task_suite run FILE.json --answered-only [--methods ...] ...`: the
    `flashmem bench tasks` run, with the other methods only where the full cache answered.
    `python -m flashmem_eval.task_suite margins FILE.json [--model smollm2]`: the full cache's
    decision margins for a run made before they were recorded (`add_margins`).
    `python -m flashmem_eval.task_suite forced FILE.json [--model smollm2]`: whether each
    method's cache writes the full cache's items when fed its answer (`add_forced`).
    `python -m flashmem_eval.task_suite prompts FILE.json --to NEW.json`: NEW.json with FILE's
    full-cache rows only (a row NEW already has stays), for `run NEW.json --stored-prompts` to
    rerun other methods on the prompts of a committed run (benchmarks/reproduce.sh, `stored`)."""
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("command", choices=["rescore", "run", "summary", "margins", "forced", "prompts"])
    ap.add_argument("file", type=Path)
    ap.add_argument("--to", type=Path, default=None, help="prompts: the file the full-cache rows go to")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--methods", default="full,flashmem")
    ap.add_argument("--budgets", default="1/16,1/32")
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--haystacks", default="kjv,stdlib-doc")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--wordings", default="dev", choices=list(WORDING_SETS))
    ap.add_argument("--answered-only", action="store_true")
    ap.add_argument(
        "--stored-prompts", action="store_true",
        help="run the prompts FILE's full-cache rows name (of --families, --haystacks, --lengths) instead of "
        "--seeds x --wordings: other methods on an earlier run's prompts",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    if a.command == "summary":
        print(summary_markdown(H.ResultStore(a.file).rows.values()))
        return
    if a.command == "prompts":
        full = [r for r in H.ResultStore(a.file).rows.values() if r.get("method") == "full"]
        if a.to is None or not full:
            why = "no --to file" if a.to is None else f"{a.file} has no full-cache rows"
            raise SystemExit(f"task_suite prompts: {why}; allowed: a tasks run's JSON with them and --to NEW.json")
        dst = H.ResultStore(a.to, meta={"prompts_from": str(a.file)})
        new = [r for r in full if not dst.done(r["cell"])]
        dst.rows.update((r["cell"], r) for r in new)
        dst.write()
        print(f"{a.to}: {len(new)} full-cache rows copied from {a.file} ({len(full)} there)")
        return
    if a.command == "margins":
        torch.set_num_threads(a.threads)
        done, bad = add_margins(H.ResultStore(a.file), H.load(a.model))
        print(f"{a.file}: {done} full-cache rows given margins, {bad} not reproduced")
        return
    if a.command == "forced":
        torch.set_num_threads(a.threads)
        done, bad = add_forced(H.ResultStore(a.file), H.load(a.model))
        print(f"{a.file}: {done} rows fed the full cache's answer, {bad} prompts not reproduced")
        return
    if a.command == "run":
        from flashmem_eval.suites import BenchArgs, run_suite

        def frac(t: str) -> float:
            n, _, d = t.partition("/")
            return float(n) / float(d) if d else float(n)

        args = BenchArgs(
            suite="tasks",
            model=a.model,
            methods=a.methods.split(","),
            budgets=[frac(b) for b in a.budgets.split(",")],
            lengths=[int(x) for x in a.lengths.split(",")],
            json_out=a.file,
            seeds=[int(x) for x in a.seeds.split(",")],
            haystacks=a.haystacks.split(","),
            families=a.families.split(","),
            wordings=a.wordings,
            answered_only=a.answered_only,
            stored_prompts=a.stored_prompts,
            threads=a.threads,
            progress=False,
        )
        run_suite(args)
        print(f"wrote {a.file}")
        return

    from transformers import AutoTokenizer

    from flashmem.models.loading import resolve

    src = resolve(a.model)
    tok = AutoTokenizer.from_pretrained(str(src.cache_dir() if src.kind != "folder" else src.path))
    partial = a.file.with_name(a.file.name + ".partial.jsonl")
    if partial.is_file():
        rows = [json.loads(line) for line in partial.read_text().splitlines() if line.strip()]
        n = rescore(rows, tok)
        partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{partial}: {n} rows rescored")
    if a.file.is_file():
        doc = json.loads(a.file.read_text())
        n = rescore(doc["rows"], tok)
        a.file.write_text(json.dumps(doc, indent=1))
        print(f"{a.file}: {n} rows rescored")


if __name__ == "__main__":
    main()
