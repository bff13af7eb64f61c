import json

import pytest

from flashmem.errors import FlashMemError
from flashmem_eval import harness as H
from flashmem_eval import report, suites
from flashmem_eval.baselines import parse_method
from flashmem_eval.suites import BenchArgs, make_probe, run_suite, score_answer
from flashmem_eval.tiny import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def loaded():
    return H.Loaded("tiny", tiny_llama(layers=2), tiny_tokenizer())


def _args(tmp_path, suite, **kw):
    base = dict(
        suite=suite,
        model="tiny",
        methods=["full", "streaming", "snapkv"],
        budgets=[0.25, 0.125],
        lengths=[256],
        json_out=tmp_path / f"{suite}.json",
        n_cont=32,
        progress=False,
        depths=[0.0, 1.0],
        tasks=["passkey", "multikey"],
        decode_tokens=4,
    )
    base.update(kw)
    return BenchArgs(**base)


def test_kl_of_full_vs_full_is_zero(loaded):
    prompt, cont = suites.fidelity_ids(loaded.tokenizer, 200, 40, 0)
    pre = H.prefill_full(loaded.model, prompt)
    full = parse_method("full")
    a = H.teacher_forced(loaded.model, H.eviction_cache(full, pre, 1), pre.last_logits, cont, 16)
    b = H.teacher_forced(loaded.model, H.eviction_cache(full, pre, 1), pre.last_logits, cont, 7)
    m = H.fidelity_metrics(a, b, cont[0])
    assert m["kl_mean"] == pytest.approx(0, abs=1e-6)
    assert m["top1_agree"] == 1.0 and m["ppl_diff"] == pytest.approx(0, abs=1e-3)


def test_fidelity_suite_and_resume(tmp_path, loaded, monkeypatch):
    args = _args(tmp_path, "fidelity")
    store = run_suite(args, loaded)
    rows = list(store.rows.values())
    assert len(rows) == 5 and not any(r.get("error") for r in rows)
    full = [r for r in rows if r["method"] == "full"][0]
    assert full["kl_mean"] == pytest.approx(0, abs=1e-6) and full["ratio"] == 1.0
    for r in rows:
        if r["method"] != "full":
            assert r["ratio"] == pytest.approx(r["budget"], rel=0.02)
            assert r["kl_mean"] >= 0
    doc = json.loads(args.json_out.read_text())
    assert len(doc["rows"]) == 5 and doc["meta"]["suite"] == "fidelity"
    # rerun: every cell is done, nothing is measured again
    calls = []
    monkeypatch.setattr(H, "prefill_full", lambda *a, **k: calls.append(1))
    store2 = run_suite(args, loaded)
    assert calls == [] and len(store2.rows) == 5
    # an added budget runs only the new cells
    monkeypatch.undo()
    args3 = _args(tmp_path, "fidelity", budgets=[0.25, 0.125, 0.5])
    store3 = run_suite(args3, loaded)
    assert len(store3.rows) == 7
    lines = args.json_out.with_name(args.json_out.name + ".partial.jsonl").read_text().splitlines()
    assert len(lines) == 7
    summary = report.print_table(list(store3.rows.values()), "fidelity")
    assert {s["method"] for s in summary} == {"full", "streaming", "snapkv"}


def test_a_rerun_keeps_the_notes_a_file_carries(tmp_path):
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"meta": {"suite": "tasks", "note": "full rows copied", "runs": [{"a": 1}]}, "rows": []}))
    store = H.ResultStore(out, meta={"suite": "tasks", "model": "smollm2"})
    store.meta["runs"].append({"b": 2})
    meta = store.write()["meta"]
    assert meta["note"] == "full rows copied" and meta["runs"] == [{"a": 1}, {"b": 2}] and meta["model"] == "smollm2"


def test_resume_ignores_cut_line_and_errors(tmp_path):
    out = tmp_path / "r.json"
    part = out.with_name("r.json.partial.jsonl")
    part.write_text('{"cell": "a", "x": 1}\n{"cell": "b", "error": "boom"}\n{"cell": "c", "x"')
    store = H.ResultStore(out)
    assert store.done("a") and not store.done("b") and not store.done("c")


def test_retrieval_probe_and_suite(tmp_path, loaded, monkeypatch):
    tok = loaded.tokenizer
    p = make_probe(tok, "passkey", 400, 0.5, 0)
    assert p.answer in p.context and "pass key" in p.question
    n = len(tok(p.context + p.question)["input_ids"])
    assert 300 < n <= 400
    m = make_probe(tok, "multikey", 600, 0.0, 1)
    assert m.context.count("special magic number") == 4 and m.answer in m.context
    assert score_answer(" 12345. The", "12345") and not score_answer(" 1234", "12345")
    # a third needle format, and a second haystack: both change the prompt, the answer stays in it once
    lk = make_probe(tok, "locker", 500, 0.3, 0)
    doc = make_probe(tok, "locker", 500, 0.3, 0, hay="stdlib-doc")
    assert lk.context.count(lk.answer) == 1 and "locker code" in lk.question
    assert doc.context.count(doc.answer) == 1 and doc.context != lk.context
    assert "LORD" not in doc.context.split(doc.answer)[0] and " the " in doc.context
    with pytest.raises(FlashMemError, match="allowed: passkey, multikey, locker"):
        make_probe(tok, "riddle", 500, 0.3, 0)
    # kvpress cells go to the runner as jobs; here the runner is faked
    seen = {}

    def fake_run_jobs(model_dir, jobs, work, threads=2, python=None, on_row=None):
        seen["jobs"] = jobs
        for j in jobs:
            on_row(
                {
                    "cell": j["cell"],
                    "generated": tok(" 7", add_special_tokens=False)["input_ids"],
                    "ratio": 1 - j["compression_ratio"],
                }
            )
        return []

    import flashmem_eval.baselines.kvpress_env as kp

    monkeypatch.setattr(kp, "run_jobs", fake_run_jobs)
    args = _args(
        tmp_path,
        "retrieval",
        methods=["full", "snapkv", "kvpress:SnapKVPress"],
        budgets=[0.25],
        lengths=[300],
        tasks=["passkey"],
    )
    store = run_suite(args, loaded)
    rows = list(store.rows.values())
    assert len(rows) == 6 and not any(r.get("error") for r in rows)
    kv = [r for r in rows if r["method"].startswith("kvpress")]
    assert len(kv) == 2 and all(r["compression_ratio"] == 0.75 and r["correct"] is False for r in kv)
    assert all(j["press"] == "SnapKVPress" and j["question"] for j in seen["jobs"])
    files = report.plot(rows, "retrieval", tmp_path / "ret.png")
    assert [f.name for f in files] == ["ret.png", "ret_heatmap.png"] and all(f.is_file() for f in files)


def test_memory_and_speed_suites(tmp_path, loaded):
    mem = run_suite(_args(tmp_path, "memory", lengths=[256]), loaded)
    rows = list(mem.rows.values())
    assert len(rows) == 5 and all(r["rss_peak"] >= r["rss_model"] > 0 for r in rows), rows
    full = [r for r in rows if r["method"] == "full"][0]
    assert full["bytes_per_token"] == pytest.approx(2 * 2 * 2 * 16 * 4)  # 2 layers, 2 kv heads, hd 16, fp32
    sp = run_suite(_args(tmp_path, "speed", methods=["streaming"], budgets=[0.25], lengths=[256]), loaded)
    rows = list(sp.rows.values())
    assert {r["method"] for r in rows} == {"full", "streaming"}
    s = [r for r in rows if r["method"] == "streaming"][0]
    assert s["prefill_tok_s"] > 0 and s["decode_ms_per_token"] > 0 and "decode_time_vs_full" in s
    report.plot(rows, "speed", tmp_path / "speed.png")


def test_cli_errors(tmp_path):
    from typer.testing import CliRunner

    from flashmem.cli.main import _register, app

    _register()
    r = CliRunner().invoke(app, ["bench", "nope", "--json-out", str(tmp_path / "x.json")])
    assert r.exit_code != 0 and isinstance(r.exception, FlashMemError)
    r = CliRunner().invoke(app, ["bench", "fidelity", "--budgets", "2", "--json-out", str(tmp_path / "x.json")])
    assert isinstance(r.exception, FlashMemError)
    for opt, bad in (("--haystacks", "kjv,novel"), ("--tasks", "passkey,riddle")):
        r = CliRunner().invoke(app, ["bench", "retrieval", opt, bad, "--json-out", str(tmp_path / "x.json")])
        assert isinstance(r.exception, FlashMemError) and bad.split(",")[1] in str(r.exception)


def test_cli_runs_tiny(tmp_path):
    from typer.testing import CliRunner

    from flashmem.cli.main import _register, app

    _register()
    out = tmp_path / "f.json"
    r = CliRunner().invoke(
        app,
        [
            "bench",
            "fidelity",
            "--model",
            "tiny",
            "--methods",
            "full,streaming",
            "--budgets",
            "1/4",
            "--lengths",
            "256",
            "--n-cont",
            "16",
            "--no-progress",
            "--json-out",
            str(out),
            "--plot",
            str(tmp_path / "f.png"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert out.is_file() and (tmp_path / "f.png").is_file() and "streaming" in r.output


def test_flashmem_method_adapter(tmp_path, loaded):
    pytest.importorskip("flashmem.cache.attach")
    impl = loaded.model.config._attn_implementation
    methods = ["full", "flashmem", "flashmem:static-rr"]
    args = _args(tmp_path, "fidelity", methods=methods, budgets=[0.25], lengths=[1024], n_cont=16)
    store = run_suite(args, loaded)
    rows = {r["method"]: r for r in store.rows.values()}
    assert not rows["flashmem"].get("error"), rows["flashmem"].get("error")
    # the row says whether its decode steps ran static: the recipe's are eager, the variant's not
    assert rows["flashmem"]["static_decode_steps"] == 0
    assert not rows["flashmem:static-rr"].get("error"), rows["flashmem:static-rr"].get("error")
    assert rows["flashmem:static-rr"]["static_decode_steps"] > 0
    assert 0.15 < rows["flashmem"]["ratio"] < 0.35
    # the recipe's exact prompt is streamed from the tiers: nothing held, the peak within the budget
    assert rows["flashmem"]["prompt_kv_bytes"] == 0
    assert rows["flashmem"]["ratio_prompt_end"] < rows["flashmem"]["ratio"] <= rows["flashmem"]["ratio_peak"] < 0.35
    assert 0.15 < rows["flashmem"]["ratio_end"] < 0.35
    # the CPU recipe decides near ties exactly: its 15 one-token steps checked, counted in the row;
    # this random model's ties are flat (under exact_on_doubt_min_mass), so none is redone
    r = rows["flashmem"]
    assert r["doubt_steps"] == 15 and r["doubt_redone"] == r["doubt_capped"] == r["doubt_changed"] == 0
    assert 0 < r["doubt_flat"] <= 15
    assert loaded.model.config._attn_implementation == impl  # restored for the other methods


def test_retrieval_ratio_with_an_exact_prompt_is_what_decoding_holds(tmp_path, loaded):
    """At the context's end an exact prompt's cache has selected nothing yet: the row's
    ratio is measured after the answer, with the working set, the prompt end's kept apart."""
    pytest.importorskip("flashmem.cache.attach")
    args = _args(tmp_path, "retrieval", methods=["flashmem"], budgets=[0.25], lengths=[1024], tasks=["passkey"])
    args.depths = [0.5]
    args.max_new = 6
    rows = list(run_suite(args, loaded).rows.values())
    assert len(rows) == 1 and not rows[0].get("error"), rows[0].get("error")
    r = rows[0]
    assert r["prompt_kv_bytes"] == 0  # streamed from the tiers, not held
    assert r["ratio"] > r["ratio_prompt_end"] + 0.02  # the working set, held from the first token on
    assert 0.15 < r["ratio"] <= r["ratio_peak"] < 0.35


def test_done_local_closes_the_flashmem_cache():
    import torch

    loaded = H.load("tiny")
    shared: dict = {}
    ids = torch.randint(3, 100, (1, 300))
    cache, _, _ = suites.local_cache(loaded, parse_method("flashmem"), 0.25, ids, shared)
    assert not cache.closed
    suites.done_local(shared, loaded)
    assert cache.closed
