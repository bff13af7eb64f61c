"""The task families (issue 31): generators, scoring, the suite's rows and summary, the CLI."""

import re

import pytest

from flashmem.errors import FlashMemError
from flashmem_eval import harness as H
from flashmem_eval import report
from flashmem_eval.tasks import (
    DEV_WORDINGS,
    FAMILIES,
    HELDOUT_WORDINGS,
    TaskProbe,
    make_task,
    score_output,
    wordings,
)
from flashmem_eval.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("family", FAMILIES)
def test_generators_are_deterministic_per_seed(tok, family):
    a = make_task(tok, family, 1024, 3, hay="kjv", wording=1)
    b = make_task(tok, family, 1024, 3, hay="kjv", wording=1)
    assert (a.context, a.question, a.items) == (b.context, b.question, b.items)
    c = make_task(tok, family, 1024, 4, hay="kjv", wording=1)
    assert c.items != a.items and c.context != a.context
    # another wording asks about the same facts in other words
    d = make_task(tok, family, 1024, 3, hay="kjv", wording=3)
    assert d.items == a.items and d.question != a.question


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("hay", ["kjv", "stdlib-doc"])
@pytest.mark.parametrize("wording", DEV_WORDINGS + HELDOUT_WORDINGS)
def test_the_answer_is_in_the_prompt_and_the_length_is_near(tok, family, hay, wording):
    p = make_task(tok, family, 1024, 0, hay=hay, wording=wording)
    assert p.items and all(it in p.context for it in p.items)
    assert p.pieces and all(x in p.context for x in p.pieces)  # what the diagnosis looks up
    n = len(tok(p.context + p.question)["input_ids"])
    assert 0.85 * 1024 < n < 1.1 * 1024
    # every item stands in its own needle paragraph (a whole line, not inside the haystack's prose)
    paras = p.context.split("\n\n")
    assert all(any(it in para and len(para) < 200 for para in paras) for it in p.items)


def test_family_specific_layouts(tok):
    vt = make_task(tok, "vartrack", 2048, 1, wording=0)
    lines = [x for x in vt.context.split("\n\n") if x.startswith("VAR ")]
    # the chain in order: the first name takes the value, each next one copies the one before
    chain = vt.items
    value = re.search(r"value (\d+)", vt.question).group(1)
    assert f"VAR {chain[0]} = {value}" in lines
    pos = [lines.index(f"VAR {chain[i]} = VAR {chain[i - 1]}") for i in range(1, len(chain))]
    assert pos == sorted(pos) and lines.index(f"VAR {chain[0]} = {value}") < pos[0]
    assert len(lines) == 2 * len(chain)  # a distractor chain as long
    agg = make_task(tok, "aggregation", 2048, 1, wording=0)
    counts = {g: agg.context.count(f"crate of {g} was") for g in agg.vocab}
    top = sorted(counts, key=counts.get, reverse=True)[:3]
    assert sorted(top) == sorted(agg.items) and min(counts[g] for g in agg.items) > max(
        c for g, c in counts.items() if g not in agg.items
    )
    mv = make_task(tok, "multivalue", 2048, 1, wording=0)
    key = re.search(r"numbers for (.+)\?", mv.question).group(1)
    assert sum(f"numbers for {key} is" in x for x in mv.context.split("\n\n")) == 3
    kd = make_task(tok, "keyed", 2048, 1, wording=0)
    color, noun = re.search(r"number for (\w+) (\w+)\?", kd.question).groups()
    keys = re.findall(r"number for (\w+ \w+) is", kd.context)
    # distractors share the asked key's colour or its noun
    assert len(keys) == 5 and any(k.startswith(color + " ") for k in keys[0:]) and sum(noun in k for k in keys) >= 2


def _probe(scoring, items, vocab=()):
    return TaskProbe("x", "", "", list(items), 0, 8, scoring, list(vocab))


def test_scoring_on_hand_made_outputs():
    first = _probe("first", ["123456"])
    assert score_output(" 123456.", first) == (1.0, [True])
    assert score_output(" 654321, not 123456", first) == (0.0, [False])
    nums = _probe("numbers", ["111111", "222222", "333333"])
    assert score_output(" 222222, 111111 and 999999.", nums) == (2 / 3, [True, True, False])
    # listing many numbers does not score past the first len(items) distinct ones
    assert score_output(" 999999, 888888, 777777, 111111, 222222, 333333", nums)[0] == 0.0
    # a repeated number counts once; the answer stops at a blank line
    assert score_output(" 111111, 111111, 222222\n\n333333", nums)[1] == [True, True, False]
    assert score_output("\n\n111111, 333333\n\nQuestion", nums)[1] == [True, False, True]
    names = _probe("names", ["ABCDE", "FGHJK"])
    assert score_output(" ABCDE, FGHJK", names) == (1.0, [True, True])
    assert score_output(" VAR ABCDE and VAR ABCDEF", names)[1] == [True, False]
    goods = _probe("words", ["salt", "tea", "rice"], vocab=["salt", "tea", "rice", "wool", "honey"])
    assert score_output(" salt, wool and tea.", goods)[1] == [True, True, False]
    assert score_output(" wool, honey, salt, tea, rice", goods)[1] == [True, False, False]
    assert score_output(" Salt, TEA and rice", goods)[0] == 1.0
    facts = _probe("words", ["Oslo", "baker", "goat"])
    assert score_output(" Oslo in 1950; she worked as a Baker and kept goats.", facts)[1] == [True, True, False]


def test_bad_names_get_one_line_errors(tok):
    with pytest.raises(FlashMemError, match="'riddles' is not known; allowed: keyed, multivalue"):
        make_task(tok, "riddles", 1024, 0)
    with pytest.raises(FlashMemError, match="allowed: kjv, stdlib-doc"):
        make_task(tok, "keyed", 1024, 0, hay="novel")
    with pytest.raises(FlashMemError, match="allowed: dev, heldout, all"):
        wordings("test")


def test_cli_rejects_a_bad_family(tmp_path):
    from typer.testing import CliRunner

    from flashmem.cli.main import _register, app

    _register()
    r = CliRunner().invoke(
        app, ["bench", "tasks", "--families", "keyed,riddles", "--json-out", str(tmp_path / "x.json")]
    )
    assert isinstance(r.exception, FlashMemError)
    msg = str(r.exception)
    assert "--families: 'riddles' is not known" in msg and "vartrack" in msg and "\n" not in msg
    r = CliRunner().invoke(app, ["bench", "tasks", "--wordings", "tuned", "--json-out", str(tmp_path / "x.json")])
    assert isinstance(r.exception, FlashMemError) and "'tuned'" in str(r.exception)


def test_suite_rows_and_share_of_the_full_cache(tmp_path):
    """The suite on the tiny model: one row per method and prompt with items, hits and score;
    the summary counts only the items the full cache answers."""
    from flashmem_eval.suites import BenchArgs, run_suite

    args = BenchArgs(
        suite="tasks",
        model="tiny",
        methods=["full", "streaming"],
        budgets=[0.25],
        lengths=[512],
        json_out=tmp_path / "t.json",
        seeds=[0, 1],
        haystacks=["kjv"],
        families=["multivalue", "passage"],
        threads=1,
        progress=False,
    )
    rows = list(run_suite(args, H.load("tiny")).rows.values())
    assert len(rows) == 2 * 2 * 2 and not any(r.get("error") for r in rows)
    assert {(r["seed"], r["wording"]) for r in rows} == {(0, 0), (1, 1)}  # seed s: wording s mod 3
    for r in rows:
        assert len(r["hits"]) == len(r["items"]) and r["score"] == sum(r["hits"]) / len(r["hits"])
    # hand-made hits: the full cache answers 2 items of 3, the method one of those and one the full misses
    fake = [dict(rows[0], method="full", budget=1.0, hits=[True, True, False], score=2 / 3)]
    fake.append(dict(rows[0], method="x", budget=0.25, hits=[True, False, True], score=2 / 3))
    s = {x["method"]: x for x in report.tasks_summary(fake) if x["length"] == 0}
    assert s["x"]["full_items"] == 2 and s["x"]["kept_items"] == 1 and s["x"]["vs_full"] == 0.5
    assert "1/2 (50%)" in report.tasks_markdown(fake)
    assert [a["score"] for a in report.full_answers(fake)] == [2 / 3]
    md = report.results_markdown(fake, ["t.json"], [], "flashmem report t.json")
    assert "Task families" in md and "Prompts the full cache answers (1)" in md
    with pytest.raises(FlashMemError, match="--plot: the tasks suite has no figure"):
        report.plot(fake, "tasks", tmp_path / "t.png")


def test_rescore_rebuilds_the_prompt_and_scores_the_saved_output(tok):
    from flashmem_eval.task_suite import rescore

    p = make_task(tok, "multiquery", 1024, 2, hay="stdlib-doc", wording=2)
    row = {"suite": "tasks", "family": "multiquery", "length": 1024, "seed": 2, "haystack": "stdlib-doc"}
    row.update(wording=2, output=f"\n\n{p.items[1]}, 42", hits=[False, False, False], score=0.0)
    assert rescore([row], tok) == 1 and row["hits"] == [False, True, False] and row["score"] == 1 / 3
    assert rescore([row], tok) == 0  # already current


def test_answered_only_runs_the_other_methods_where_the_full_cache_answered(tmp_path):
    """answered_only: the full cache's row decides; a prompt it answered nothing of gets no row of
    the other methods, one it answered an item of gets them."""
    import json

    from flashmem_eval.suites import BenchArgs, run_suite

    out = tmp_path / "t.json"
    args = BenchArgs(
        suite="tasks",
        model="tiny",
        methods=["full", "streaming"],
        budgets=[0.25],
        lengths=[512],
        json_out=out,
        seeds=[0, 1],
        haystacks=["kjv"],
        families=["keyed"],
        answered_only=True,
        threads=1,
        progress=False,
    )
    # the full cache's rows given: seed 0 answered, seed 1 not
    full = []
    for seed, hits in ((0, [True]), (1, [False])):
        key = dict(family="keyed", haystack="kjv", length=512, seed=seed, wording=seed)
        cell = H.cell_id(suite="tasks", model="tiny", method="full", budget=1.0, **key)
        full.append(
            dict(
                suite="tasks",
                model="tiny",
                method="full",
                budget=1.0,
                **key,
                cell=cell,
                hits=hits,
                score=float(hits[0]),
            )
        )
    out.write_text(json.dumps({"meta": {}, "rows": full}))
    rows = list(run_suite(args, H.load("tiny")).rows.values())
    ran = sorted((r["method"], r["seed"]) for r in rows)
    assert ran == [("full", 0), ("full", 1), ("streaming", 0)]
    assert json.loads(out.read_text())["meta"]["runs"][-1]["answered_only"] is True
    from flashmem_eval.task_suite import summary_markdown

    held = [dict(r, wording=3, seed=r["seed"] + 10, cell=r["cell"] + "h") for r in rows]
    md = summary_markdown(rows + held)
    assert "dev wordings [0, 1, 2], seeds [0, 1]: 2 prompts" in md
    assert "heldout wordings [3], seeds [10, 11]: 2 prompts" in md and md.count("| streaming |") == 2


def test_stored_prompts_runs_the_prompts_the_full_caches_rows_name(tmp_path):
    """--stored-prompts: the prompts (seed and wording as stored, whatever --seeds says) are those of
    the file's full-cache rows of the run's families and haystacks; the full rows are not rerun."""
    import json

    from flashmem_eval.suites import BenchArgs, run_suite

    out = tmp_path / "t.json"
    full = []
    for fam, seed, wording, hits in (("keyed", 7, 2, [True]), ("keyed", 9, 0, [False]), ("passage", 5, 1, [True])):
        key = dict(family=fam, haystack="kjv", length=512, seed=seed, wording=wording)
        cell = H.cell_id(suite="tasks", model="tiny", method="full", budget=1.0, **key)
        full.append(dict(suite="tasks", model="tiny", method="full", budget=1.0, **key, cell=cell, hits=hits))
    out.write_text(json.dumps({"meta": {}, "rows": full}))
    args = BenchArgs(
        suite="tasks", model="tiny", methods=["full", "streaming"], budgets=[0.25], lengths=[512], json_out=out,
        seeds=[0], haystacks=["kjv"], families=["keyed"], answered_only=True, stored_prompts=True, threads=1,
        progress=False,
    )  # fmt: skip
    rows = list(run_suite(args, H.load("tiny")).rows.values())
    ran = sorted((r["method"], r["family"], r["seed"], r["wording"]) for r in rows)
    assert ran == [
        ("full", "keyed", 7, 2), ("full", "keyed", 9, 0), ("full", "passage", 5, 1), ("streaming", "keyed", 7, 2),
    ]  # fmt: skip
    assert "output" not in next(r for r in rows if r["method"] == "full")  # given, not rerun
    assert json.loads(out.read_text())["meta"]["runs"][-1]["stored_prompts"] is True


def test_prompts_copies_a_runs_full_cache_rows_for_a_rerun(tmp_path, capsys):
    """`task_suite prompts SRC --to NEW`: NEW holds SRC's full-cache rows only (the prompts a
    --stored-prompts rerun takes), and a second copy adds nothing; no full rows or no --to: one line."""
    import json

    from flashmem_eval.task_suite import main

    src, new = tmp_path / "src.json", tmp_path / "new.json"
    rows = []
    for method, budget in (("full", 1.0), ("flashmem", 0.0625), ("full", 1.0)):
        key = dict(family="keyed", haystack="kjv", length=512, seed=len(rows), wording=0)
        cell = H.cell_id(suite="tasks", model="tiny", method=method, budget=budget, **key)
        rows.append(dict(suite="tasks", model="tiny", method=method, budget=budget, **key, cell=cell, hits=[True]))
    src.write_text(json.dumps({"meta": {}, "rows": rows}))
    main(["prompts", str(src), "--to", str(new)])
    doc = json.loads(new.read_text())
    assert [r["cell"] for r in doc["rows"]] == [rows[0]["cell"], rows[2]["cell"]]
    assert doc["meta"]["prompts_from"] == str(src)
    main(["prompts", str(src), "--to", str(new)])
    assert "0 full-cache rows copied" in capsys.readouterr().out.splitlines()[-1]
    for argv in (["prompts", str(new)], ["prompts", str(tmp_path / "none.json"), "--to", str(new)]):
        with pytest.raises(SystemExit, match="allowed: a tasks run's JSON"):
            main(argv)


def test_a_seed_keeps_its_wording_whatever_other_seeds_a_run_names():
    """A run of seed 1 alone and a run of seeds 0, 1 give seed 1 the same wording, so a resumed
    or split run reuses (and never silently re-words) its prompts."""
    from types import SimpleNamespace

    from flashmem_eval.task_suite import prompts_for

    def run(seeds, which="dev"):
        args = SimpleNamespace(wordings=which, lengths=[4096], seeds=seeds, haystacks=["kjv"], families=["keyed"])
        return {s: w for _, _, _, s, w in prompts_for(args)}

    assert run([1]) == {1: 1} and run([0, 1]) == {0: 0, 1: 1} and run([2, 1]) == {2: 2, 1: 1}
    assert run([4]) == {4: 1}  # the dev set has 3 wordings
    assert run([11, 12], "heldout") == {11: 3, 12: 3}


def test_greedy_records_each_tokens_decision_margin():
    """harness.greedy's gaps: one per generated token, its logit minus the runner-up's, as a
    forward over the prompt and the answer computes them."""
    import torch

    ld = H.load("tiny")
    torch.manual_seed(0)
    ctx = torch.randint(5, 200, (1, 40))
    q = torch.randint(5, 200, (1, 6))
    from transformers import DynamicCache

    with torch.no_grad():
        ld.model(input_ids=ctx, cache=(cache := DynamicCache()), use_cache=True)
    gaps: list[float] = []
    gen = H.greedy(ld.model, cache, q, 8, (), gaps)
    assert len(gaps) == len(gen) == 8
    with torch.no_grad():
        logits = ld.model(input_ids=torch.cat([ctx, q, torch.tensor([gen[:-1]])], 1)).logits[0, -len(gen) :]
    top = logits.float().topk(2, dim=-1).values
    assert logits.argmax(-1).tolist() == gen
    assert torch.allclose(torch.tensor(gaps), top[:, 0] - top[:, 1], atol=1e-4)
    assert all(g >= 0 for g in gaps)
    assert len(H.greedy(ld.model, DynamicCache(), q, 3)) == 3  # without a list: no margins asked


def test_item_gaps_take_the_smallest_margin_up_to_where_each_item_stays_found():
    from flashmem_eval.tasks import item_gaps

    class Chars:  # token i is the string pieces[i]
        pieces = [" 111", "111", ",", " 222", "222", " 9", "99999"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.pieces[i] for i in ids)

    probe = _probe("numbers", ["111111", "222222", "333333"])
    gaps = [2.0, 0.5, 3.0, 0.2, 4.0, 0.01, 5.0]
    # 111111 is found at token 1 (min of 2.0, 0.5), 222222 at token 4 (min up to there: 0.2);
    # the coin flip at token 5 comes after both and counts for neither; 333333 is not found
    assert item_gaps(Chars(), list(range(7)), gaps, probe) == [0.5, 0.2, None]
    # "111" alone is not the item: found only once "111111" is complete
    assert item_gaps(Chars(), [0], [2.0], probe) == [None, None, None]


def test_margin_table_splits_the_full_caches_items_by_how_firmly_it_found_them():
    key = dict(suite="tasks", family="vartrack", haystack="kjv", length=512, seed=0, wording=0)
    full = dict(key, method="full", budget=1.0, hits=[True, True, True, False], score=0.75)
    full.update(item_gaps=[0.05, 0.5, 2.0, None])
    fm = dict(key, method="flashmem", budget=0.0625, hits=[False, True, True, True], score=0.75)
    md = report.tasks_margin_markdown([full, fm])
    line = next(x for x in md.splitlines() if x.startswith("| flashmem"))
    # the item the full cache found behind a coin flip is lost; the firm ones are kept; the one
    # the full cache missed does not count
    assert line == "| flashmem | 1/16 | vartrack | 0/1 (0%) | 1/1 (100%) | 1/1 (100%) |"
    assert line in report.tasks_results_markdown([full, fm])  # in `flashmem report`'s tasks section
    assert report.tasks_margin_markdown([dict(full, item_gaps=None), fm]) == ""


def test_add_margins_reproduces_the_full_caches_output_or_says_so(tmp_path):
    """`task_suite margins`: a full-cache row from before margins were recorded gets them from
    a decode that reproduces its output; a row whose output is not reproduced is flagged."""
    from flashmem_eval.suites import BenchArgs, run_suite
    from flashmem_eval.task_suite import add_margins

    out = tmp_path / "t.json"
    args = BenchArgs(
        suite="tasks", model="tiny", methods=["full"], budgets=[0.25], lengths=[512], json_out=out,
        seeds=[0, 1], haystacks=["kjv"], families=["multivalue"], threads=1, progress=False,
    )  # fmt: skip
    ld = H.load("tiny")
    rows = run_suite(args, ld).rows
    want = {c: (r["gaps"], r["item_gaps"]) for c, r in rows.items()}
    store = H.ResultStore(out)
    cells = sorted(store.rows)
    for c in cells:
        store.rows[c].pop("gaps"), store.rows[c].pop("item_gaps")
    store.rows[cells[1]]["output"] += " changed"
    assert add_margins(store, ld) == (1, 1)
    again = H.ResultStore(out).rows  # written back, the partial file's last rows winning
    assert (again[cells[0]]["gaps"], again[cells[0]]["item_gaps"]) == want[cells[0]]
    assert "item_gaps" not in again[cells[1]] and "not reproduced" in again[cells[1]]["margin_error"]
    import json

    assert json.loads(out.read_text())["meta"]["margins_added"][-1]["rows"] == 1
    assert add_margins(H.ResultStore(out), ld) == (0, 0)  # nothing left to do; the one flagged stays so


def test_forced_feeds_the_answer_as_greedy_feeds_its_own():
    """harness.forced: fed a cache's own greedy answer, its top-1 is that answer and each
    margin is greedy's; fed another token, the margin there is negative (its top-1 beat it)."""
    import torch
    from transformers import DynamicCache

    ld = H.load("tiny")
    torch.manual_seed(0)
    ctx = torch.randint(5, 200, (1, 40))
    q = torch.randint(5, 200, (1, 6))

    def prefilled() -> DynamicCache:
        with torch.no_grad():
            ld.model(input_ids=ctx, cache=(cache := DynamicCache()), use_cache=True)
        return cache

    gaps: list[float] = []
    gen = H.greedy(ld.model, prefilled(), q, 8, (), gaps)
    tops, margins = H.forced(ld.model, prefilled(), q, gen)
    assert tops == gen and torch.allclose(torch.tensor(margins), torch.tensor(gaps), atol=1e-4)
    other = list(gen)
    other[3] = (gen[3] + 1) % 200
    tops2, margins2 = H.forced(ld.model, prefilled(), q, other)
    assert tops2[:4] == gen[:4] and margins2[3] < 0 and margins2[:3] == pytest.approx(margins[:3], abs=1e-4)


def test_forced_items_ask_for_every_token_of_each_items_span():
    from flashmem_eval.tasks import forced_items, item_spans

    class Chars:  # token i is the string pieces[i]
        pieces = ["The", " code", " is", " 111", "111", ",", " then", " 222", "222"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.pieces[i] for i in ids)

    probe = _probe("numbers", ["111111", "222222", "333333"])
    gen = list(range(9))
    assert item_spans(Chars(), gen, probe) == [(3, 4), (7, 8), None]
    # another cache writes " then" otherwise (a phrasing near tie) and 222's second half otherwise
    tops = [0, 1, 2, 3, 4, 5, 99, 7, 98]
    margins = [1.0, 1.0, 1.0, 0.5, 0.2, 1.0, -0.01, 2.0, -0.3]
    assert forced_items(Chars(), gen, tops, margins, probe) == ([True, False, None], [0.2, -0.3, None])
    # the method's own greedy answer, as far as forcing shows it: the full answer's first six
    # tokens, then its own choice at the seventh (token 99: " and")
    from flashmem_eval.task_suite import agrees_with_answer

    Chars.pieces += [""] * 90 + [" and"]
    assert agrees_with_answer(Chars(), gen, tops, "The code is 111111, and so on")
    assert not agrees_with_answer(Chars(), gen, tops, "The code is 111111, then 222222")  # another tree's
    assert agrees_with_answer(Chars(), gen, gen, "The code is 111111, then 222222")
    assert not agrees_with_answer(Chars(), gen, gen, "The code is 111111")


def test_add_forced_feeds_each_method_the_full_caches_answer(tmp_path, monkeypatch):
    """`task_suite forced`: a flashmem row whose full-cache row found an item gets forced_hits
    and margins, from the full cache's answer decoded again; with every token attended (budget
    1) it writes each item as the full cache does; the table pools them."""
    import flashmem_eval.task_suite as ts
    from flashmem_eval.suites import BenchArgs, run_suite

    out = tmp_path / "t.json"
    args = BenchArgs(
        suite="tasks", model="tiny", methods=["full", "flashmem"], budgets=[1.0], lengths=[512], json_out=out,
        seeds=[0], haystacks=["kjv"], families=["multivalue"], threads=1, progress=False,
    )  # fmt: skip
    ld = H.load("tiny")
    run_suite(args, ld)
    store = H.ResultStore(out)
    full = next(r for r in store.rows.values() if r["method"] == "full")
    fm = next(r for r in store.rows.values() if r["method"] == "flashmem")
    assert fm["output"] == full["output"]  # budget 1: the same answer
    # the tiny model finds nothing: make the start of its answer the prompt's first item
    word = full["output"].strip()[:2]
    assert len(word) == 2, full["output"]
    real = ts.make_task

    def with_item(tok, fam, length, seed, hay, wording):
        p = real(tok, fam, length, seed, hay=hay, wording=wording)
        p.items[0], p.scoring = word, "words"
        return p

    monkeypatch.setattr(ts, "make_task", with_item)
    n = len(full["hits"])
    full["hits"] = [True] + [False] * (n - 1)
    assert ts.add_forced(store, ld) == (1, 0)
    again = H.ResultStore(out).rows[fm["cell"]]
    assert again["forced_hits"] == [True] + [None] * (n - 1) and again["forced_margins"][0] >= 0
    assert again["forced_reproduces"] is True
    assert "forced_hits" not in H.ResultStore(out).rows[full["cell"]]
    md = report.tasks_forced_markdown(list(H.ResultStore(out).rows.values()))
    assert "| flashmem | 1 | multivalue | 1 | 0 (0%) | 1 (100%) | - |" in md, md
    md = report.tasks_forced_markdown([dict(again, forced_reproduces=False)])
    assert "| flashmem" not in md and "1 rows left out" in md
    assert ts.add_forced(H.ResultStore(out), ld) == (0, 0)  # nothing left to do
    # an output that the full cache's decode does not reproduce: its prompt's rows say so
    store = H.ResultStore(out)
    fm2 = store.rows[fm["cell"]]
    del fm2["forced_hits"], fm2["forced_margins"]
    store.rows[full["cell"]].update(hits=[True] + [False] * (n - 1), output="something else")
    assert ts.add_forced(store, ld) == (0, 1)
    assert "not reproduced" in H.ResultStore(out).rows[fm["cell"]]["forced_error"]


def test_report_names_each_lengths_model_when_the_tables_pool_several():
    """Task runs of two models (SmolLM2 at 4K, Gemma3 at 16K) pool into one block: each length's
    heading and each answered prompt name the model, and one model's headings stay bare."""
    rows = []
    for model, length in (("smollm2", 4096), ("gemma3-270m", 16384)):
        key = dict(suite="tasks", model=model, family="keyed", haystack="kjv", length=length, seed=0, wording=0)
        rows.append(dict(key, method="full", budget=1.0, hits=[True], score=1.0, items=["1"], output="1"))
        rows.append(dict(key, method="flashmem", budget=0.0625, hits=[True], score=1.0))
    md = report.tasks_results_markdown(rows)
    assert "4K (smollm2):" in md and "16K (gemma3-270m):" in md and "All lengths (gemma3-270m, smollm2):" in md
    assert "- keyed, kjv, 16K (gemma3-270m), seed 0, wording 0: score 1.00" in md
    one = report.tasks_results_markdown([r for r in rows if r["model"] == "smollm2"])
    assert "4K:" in one and "(smollm2)" not in one
