"""`flashmem report`'s markdown names, under each suite's table, the runs behind it: date and command."""

import json

from flashmem_eval import report


def _retrieval_row(method, budget, correct):
    return {
        "suite": "retrieval",
        "model": "gemma3-270m",
        "method": method,
        "budget": budget,
        "task": "passkey",
        "length": 4096,
        "depth": 0.5,
        "seed": 1,
        "cell": f"{method}|{budget}",
        "correct": correct,
    }


def _fidelity_row(method, budget):
    return {
        "suite": "fidelity",
        "model": "smollm2",
        "method": method,
        "budget": budget,
        "length": 4096,
        "seed": 0,
        "cell": f"f|{method}|{budget}",
        "kl_mean": 0.01,
        "top1_agree": 0.9,
    }


def test_each_table_lists_its_runs_commands_and_dates(tmp_path):
    ret, fid = tmp_path / "ret.json", tmp_path / "fid.json"
    ret_run = {
        "methods": ["full", "flashmem", "kvpress:KeyDiffPress"],
        "budgets": [0.125, 0.0625],
        "lengths": [4096],
        "seeds": [1, 2],
        "depths": [0.15, 0.5],
        "tasks": ["passkey", "locker"],
        "haystacks": ["kjv", "stdlib-doc"],
        "n_cont": None,
        "chunk": 64,
        "threads": 1,
        "started": "2026-12-03T07:33:50",
    }
    ret.write_text(
        json.dumps(
            {
                "meta": {"suite": "retrieval", "model": "gemma3-270m", "runs": [ret_run]},
                "rows": [_retrieval_row("full", 1.0, True), _retrieval_row("flashmem", 0.125, True)],
            }
        )
    )
    fid_run = {"methods": ["full", "flashmem"], "budgets": [0.125], "lengths": [4096], "seeds": [0]}
    fid_run |= {"n_cont": 256, "chunk": 64, "threads": 1, "started": "2026-12-02T14:42:18"}
    fid.write_text(
        json.dumps(
            {
                "meta": {"suite": "fidelity", "model": "smollm2", "runs": [fid_run]},
                "rows": [_fidelity_row("full", 1.0), _fidelity_row("flashmem", 0.125)],
            }
        )
    )
    rows, runs = report.load_rows([ret, fid])
    text = report.results_markdown(rows, [str(ret), str(fid)], runs, "flashmem report ...")
    fid_cmd = (
        f"- 2026-12-02: `flashmem bench fidelity --model smollm2 --methods full,flashmem --budgets 1/8 "
        f"--lengths 4096 --seeds 0 --n-cont 256 --threads 1 --json-out {fid}`"
    )
    ret_cmd = (
        "- 2026-12-03: `flashmem bench retrieval --model gemma3-270m --methods full,flashmem,kvpress:KeyDiffPress "
        "--budgets 1/8,1/16 --lengths 4096 --seeds 1,2 --depths 0.15,0.5 --tasks passkey,locker "
        f"--haystacks kjv,stdlib-doc --threads 1 --json-out {ret}`"
    )
    fid_at, ret_at = text.index("**Fidelity"), text.index("**Retrieval")
    # each command sits under its own suite's table, not the other's
    assert fid_at < text.index(fid_cmd) < ret_at < text.index(ret_cmd)
    assert text.count("Measured by:") == 2


def test_merged_file_runs_keep_their_source_and_take_the_rows_model(tmp_path):
    merged = tmp_path / "common.json"
    run = {"methods": ["flashmem"], "budgets": [0.0625], "lengths": [2048], "seeds": [0], "threads": 1}
    run |= {"started": "2026-12-02T00:39:30", "file": "retrieval_src.json"}
    merged.write_text(
        json.dumps({"meta": {"suite": "retrieval", "runs": [run]}, "rows": [_retrieval_row("full", 1.0, True)]})
    )
    rows, runs = report.load_rows([merged])
    assert runs[0]["file"] == "retrieval_src.json" and runs[0]["path"] == str(tmp_path / "retrieval_src.json")
    text = report.results_markdown(rows, [str(merged)], runs, "flashmem report ...")
    assert (
        "`flashmem bench retrieval --model gemma3-270m --methods flashmem --budgets 1/16 --lengths 2048 "
        f"--seeds 0 --threads 1 --json-out {tmp_path / 'retrieval_src.json'}`"
    ) in text


def test_answered_only_tasks_run_is_the_task_suite_command_and_notes_are_kept():
    run = {
        "suite": "tasks",
        "model": "smollm2",
        "path": "results/t.json",
        "methods": ["full", "flashmem"],
        "budgets": [0.03125],
        "lengths": [4096],
        "seeds": [11, 12],
        "haystacks": ["kjv"],
        "families": ["keyed", "vartrack"],
        "wordings": "heldout",
        "answered_only": True,
        "chunk": 64,
        "threads": 1,
        "started": "2026-12-02T19:55:08",
        "note": "rows copied",
    }
    assert report.run_command(run) == (
        "python -m flashmem_eval.task_suite run results/t.json --answered-only --model smollm2 "
        "--methods full,flashmem --budgets 1/32 --lengths 4096 --seeds 11,12 --haystacks kjv "
        "--families keyed,vartrack --wordings heldout --threads 1"
    )
    assert report.runs_markdown([run]).endswith("--threads 1` (rows copied)")
    assert report.run_command({**run, "command": "flashmem bench tasks --exact"}) == "flashmem bench tasks --exact"
    # prompts taken from the file's full-cache rows: no seeds or wordings, which the run did not use
    assert report.run_command({**run, "stored_prompts": True}) == (
        "python -m flashmem_eval.task_suite run results/t.json --answered-only --stored-prompts --model smollm2 "
        "--methods full,flashmem --budgets 1/32 --lengths 4096 --haystacks kjv --families keyed,vartrack --threads 1"
    )
