"""`flashmem run` end to end on a tiny random model saved as an HF folder."""

from __future__ import annotations

import json

import pytest

from flashmem.cli.main import main
from flashmem_eval.tiny import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _config(tmp_path, **keys):
    path = tmp_path / "cfg.yaml"
    body = "\n".join(f"  {k}: {v}" for k, v in keys.items())
    path.write_text("flash_memory:\n" + body + "\n")
    return path


def test_run_generates_reports_memory_and_compares_with_full(tiny_folder, tmp_path, capsys):
    text = tmp_path / "in.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 40)
    cfg = _config(
        tmp_path,
        gpu_cache_limit=32,
        hca_chunk_size=16,
        csa_band_tokens=32,
        lsa_keep_ratio=1.0,
        prefill_chunk=64,
        prefetch_threads=0,
        prefill_exact_tokens=4096,
    )
    out = tmp_path / "run.json"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "run",
                "--model",
                str(tiny_folder),
                "--config",
                str(cfg),
                "--input",
                str(text),
                "--max-new-tokens",
                "6",
                "--compare-full",
                "--json-out",
                str(out),
            ]
        )
    assert exc.value.code == 0
    result = json.loads(out.read_text())
    assert result["generated_tokens"] == 6
    mem = result["memory"]
    assert mem["tokens_seen"] == result["context_tokens"] + 5
    assert mem["sealed_blocks"] > 0 and mem["cold_bytes"] > 0
    # every block selected: the cache is exact, so it agrees with the full cache
    assert result["compare_full"]["top1_agree"] == 1.0
    assert result["compare_full"]["kl_mean"] < 1e-6
    # no exact prompt's K/V is left after the first token; a peak above it gets its own row
    assert mem["tiers"]["prefill_kv"] == 0
    printed = capsys.readouterr().out
    peaked = mem["peak_managed_resident_bytes"] > mem["managed_resident_bytes"]
    assert "device resident" in printed and ("peak (any step)" in printed) == peaked
    assert "prefill_kv" not in printed  # all-zero tiers are left out
    # what a decode step moved, beside a full cache's reads (cache.traffic_report())
    traffic = result["traffic"]
    assert traffic["steps"]["decode_steps"] == 5 and traffic["totals"]["h2d_bytes"] > 0
    assert "per decode step (median)" in printed and "a full cache reads" in printed


@pytest.mark.parametrize(
    "args,message",
    [
        (["--input", "/no/such/file.txt"], "no such file"),
        (["--input", "x.txt", "--text", "kjv"], "both given"),
    ],
)
def test_run_bad_input_is_one_line_exit_2(tiny_folder, tmp_path, capsys, args, message):
    cfg = _config(tmp_path, gpu_cache_limit=32)
    with pytest.raises(SystemExit) as exc:
        main(["run", "--model", str(tiny_folder), "--config", str(cfg), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_run_asks_about_a_fact_planted_far_back(tiny_folder, tmp_path, capsys):
    """The default main job with a packaged text: fact at the given depth, question at
    the end; with every block selected flashmem's answer is the full cache's."""
    cfg = _config(
        tmp_path, gpu_cache_limit=32, hca_chunk_size=16, lsa_keep_ratio=1.0, prefill_chunk=64, prefetch_threads=0
    )
    out = tmp_path / "ask.json"
    args = ["run", "--model", str(tiny_folder), "--config", str(cfg), "--text", "kjv", "--context-tokens", "600"]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--fact-depth", "0.25", "-n", "5", "--compare-full", "--json-out", str(out)])
    assert exc.value.code == 0
    r = json.loads(out.read_text())
    assert r["context_tokens"] == 600
    q = r["question"]
    assert 0.15 < q["fact_token"] / 600 < 0.35  # where it was asked to go
    assert r["text"] == r["compare_full"]["full_text"]  # exact when everything is selected
    assert q["flashmem_found"] == q["full_found"]
    printed = capsys.readouterr().out
    assert q["answer"] in printed and "full cache:" in printed


def test_plant_fact_puts_the_fact_in_the_context_and_the_question_last(tiny_folder):
    from transformers import AutoTokenizer

    from flashmem.cli.fact import found, plant_fact
    from flashmem.errors import FlashMemError
    from flashmem.texts import load_text

    tok = AutoTokenizer.from_pretrained(tiny_folder)
    p = plant_fact(tok, load_text(), 1000, depth=0.5, seed=3)
    text = tok.decode(p.ids)
    assert len(p.ids) == 1000 and p.fact in text and text.rstrip().endswith(p.question)
    assert 400 < p.fact_token < 600 and p.answer in p.fact
    assert found(" 12 and 34", "12") and not found(" 34 then 12", "12") and not found("none", "12")
    with pytest.raises(FlashMemError, match="fact-depth"):
        plant_fact(tok, load_text(), 1000, depth=1.5)


def test_run_ask_and_prompt_together_is_one_line_error(tiny_folder, tmp_path, capsys):
    cfg = _config(tmp_path, gpu_cache_limit=32)
    with pytest.raises(SystemExit) as exc:
        main(["run", "--model", str(tiny_folder), "--config", str(cfg), "--ask", "--prompt", "hi"])
    assert exc.value.code == 2
    assert "--ask and --prompt" in capsys.readouterr().err


# ---------------------------------------------------------------- the first run, fast and legible


@pytest.mark.parametrize(
    "args,message",
    [
        (["--fact-depth", "1.5"], "--fact-depth"),
        (["--text", "kjv", "--context-tokens", "50"], "--context-tokens: 50"),
        (["--model", "no-such-model"], "unknown model"),
        (["--ask", "--prompt", "hi"], "--ask and --prompt"),
        (["--dtype", "int8"], "--dtype 'int8': allowed: float32, bfloat16, float16"),
    ],
)
def test_bad_arguments_are_refused_before_a_model_loads(monkeypatch, capsys, args, message):
    """`flashmem run --fact-depth 1.5` was refused after 33 s of model loading."""
    import time

    from flashmem.models import loading

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model", no_load)
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exc:
        main(["run", *args])
    assert exc.value.code == 2
    assert time.perf_counter() - t0 < 10  # no model load, no prefill
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_streamed_answer_has_no_special_tokens_and_whole_characters(tiny_folder, capsys):
    from transformers import AutoTokenizer

    from flashmem.cli.run_cmd import _Stream

    tok = AutoTokenizer.from_pretrained(tiny_folder)
    ids = tok("the café at Zürich", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert len(ids) > 5
    stream = _Stream(tok, "answer: ")
    for i in ids:
        stream.add(i)
    stream.end()
    out = capsys.readouterr().out
    assert out == "answer: the café at Zürich\n"  # byte-level pieces joined, <eos> not printed
    assert tok.eos_token not in out and "\ufffd" not in out


def _result(**memory):
    mem = {
        "tokens_seen": 8208,
        "tiers": {"sinks": 100, "window": 900, "csa_entries": 0, "prefill_kv": 0, "working_set": 1000},
        "full_layer_bytes": 0,
        "sliding_layer_bytes": 0,
        "device_resident_bytes": 2000,
        "peak_managed_resident_bytes": 10300,
        "cold_bytes": 9000,
        **memory,
    }
    return {
        "memory": mem,
        "full_cache_bytes": 10000,
        "context_tokens": 8192,
        "device": "cpu",
        "config": {"prefill_exact_tokens": 32768, "cold_store": "memory", "cold_codec": "int8"},
    }


def test_memory_table_drops_zero_tiers_and_explains_the_peak_and_the_shared_ram():
    from flashmem.cli.run_cmd import memory_rows

    rows, notes = memory_rows(_result())
    names = [n for n, _ in rows]
    assert names == ["sinks", "window", "working_set", "device resident", "peak (any step)", "cold tier",
                     "full cache (DynamicCache)"]  # fmt: skip
    text = " ".join(notes)
    assert "held the prompt's K/V until the first generated token" in text  # a lossy cold tier: buffered
    assert "same RAM" in text and "11,000 bytes (110% of the full cache)" in text  # device + cold
    exact = _result()
    exact["config"]["cold_codec"] = "exact"  # the prompt is streamed from the tiers, not held
    exact["config"]["cold_low_rank"] = "none"  # as a real config says it
    assert not any("held the prompt" in n for n in memory_rows(exact)[1])
    # memory_report's own full-cache bytes win over run's estimate
    rows, _ = memory_rows(_result(full_cache_bytes=20000))
    assert dict(rows)["full cache (DynamicCache)"] == 20000
    # on an accelerator, or with a disk cold tier, the RAM note is not shown
    gpu = _result()
    gpu["device"] = "cuda:0"
    assert not any("same RAM" in n for n in memory_rows(gpu)[1])
    disk = _result()
    disk["config"]["cold_store"] = "disk"
    assert not any("same RAM" in n for n in memory_rows(disk)[1])


def test_memory_table_says_how_many_near_ties_were_redone_and_what_the_redo_holds():
    from flashmem.cli.run_cmd import memory_rows

    assert not any("near ties" in n for n in memory_rows(_result())[1])  # exact_on_doubt off: no note
    r = _result(
        doubt_steps=40, doubt_redone=13, doubt_capped=5, doubt_changed=4, doubt_held_bytes=700, sliding_layer_bytes=800
    )
    r["config"]["exact_on_doubt"] = 0.5
    rows, notes = memory_rows(r)
    assert dict(rows)["sliding tokens held to redo"] == 700
    assert "within 0.5 nats): 13 of 40 decode steps run again" in " ".join(notes)
    assert "5 left as selected by the cap" in " ".join(notes)
    assert "exactly (4 of them given another token)" in " ".join(notes)
    assert "flat distribution" not in " ".join(notes)
    r["memory"]["doubt_flat"] = 3
    assert "5 left as selected by the cap (exact_on_doubt_share), 3 in a flat distribution" in " ".join(
        memory_rows(r)[1]
    )


def test_traffic_lines_give_the_redos_apart_from_the_decode_steps():
    from flashmem.cli.run_cmd import traffic_lines

    zero = dict.fromkeys(("device_read_bytes", "h2d_bytes", "host_read_bytes", "disk_read_bytes"), 0)
    t = {
        "steps": {"prefill_forwards": 2, "decode_steps": 40, "redo_forwards": 0, "redo_tokens": 0},
        "totals": dict(zero, h2d_bytes=9 * 10**6),
        "per_decode_step_median": dict(zero, h2d_bytes=10**5, full_cache_bytes=10**7),
        "per_redo_forward_median": dict(zero),
        "page_cache": {"hit_rate": 0.5},
    }
    lines = traffic_lines({"traffic": t})
    assert len(lines) == 2 and "(the prompt read back included)" in lines[1]
    t["steps"].update(redo_forwards=5, redo_tokens=12)
    t["per_redo_forward_median"]["h2d_bytes"] = 3 * 10**6
    lines = traffic_lines({"traffic": t})
    assert "near ties redone: 5 of 40 decode steps, each copying 3.0 MB from the cold tier" in lines[1]
    assert "(the prompt read back and the redos included)" in lines[2]


def test_speed_lines_give_time_per_token_in_readable_units():
    from flashmem.cli.run_cmd import speed_lines

    r = {"context_tokens": 8192, "prefill_s": 394.0, "generated_tokens": 16, "decode_s": 150.0}
    prefill, decode = speed_lines(r)
    assert prefill == "prefill: 8,192 tokens in 394.0 s (48.1 ms/token, 20.8 tokens/s)"
    assert decode == "decode:  15 tokens after the first in 150.0 s (10.0 s/token, 0.10 tokens/s)"
    fast = speed_lines({**r, "decode_s": 0.3})[1]
    assert "(20 ms/token, 50.0 tokens/s)" in fast


def test_progress_in_a_log_is_a_few_lines(monkeypatch, capsys):
    import time

    from flashmem import progress

    monkeypatch.setenv("FLASHMEM_PROGRESS", "1")  # capsys' stderr is not a TTY: lines
    with progress.step("quick", total=10, unit="tokens") as s:
        s.advance(10)
    assert capsys.readouterr().err == ""  # done before SHOW_AFTER_S: nothing to say

    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.05)
    monkeypatch.setattr(progress, "LOG_EVERY_S", (0.1,))
    with progress.step("prefill", total=100, unit="tokens") as s:
        for _ in range(10):
            time.sleep(0.05)
            s.advance(10)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "prefill (100 tokens)..."
    assert lines[-1].startswith("prefill: done, 100 tokens in ")
    assert 2 <= len(lines) <= 8  # one per gap, not one per advance
    assert all("/100 tokens (" in line for line in lines[1:-1])

    monkeypatch.setenv("FLASHMEM_PROGRESS", "0")
    with progress.step("off", total=1) as s:
        time.sleep(0.1)
    assert capsys.readouterr().err == ""


def test_layer_profile_reports_progress_per_layer(tiny_folder, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashmem import progress
    from flashmem.calibration.layer_profile import measure_layer_profile

    monkeypatch.setenv("FLASHMEM_PROGRESS", "1")
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    seen = []
    real = progress.Step.advance
    monkeypatch.setattr(progress.Step, "advance", lambda self, n=1: (seen.append(n), real(self, n)))
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    prof = measure_layer_profile(model, AutoTokenizer.from_pretrained(tiny_folder), tokens=512, seq_tokens=256)
    layers = model.config.num_hidden_layers
    assert len(seen) == 2 * layers and sum(seen) == pytest.approx(prof["tokens"])  # each layer of each sequence
    assert "layer profile (measured once per model): done, 512 tokens in" in capsys.readouterr().err


def test_run_dtype_loads_the_model_in_it_with_the_recipe_sized_for_it(tiny_folder, tmp_path, capsys):
    """`flashmem run --dtype bfloat16` without --config: the model in bf16, its cache in bf16, and
    the recipe sized for 2-byte K/V (configs/cpu-small.yaml is the recipe for float32)."""
    out = tmp_path / "run.json"
    with pytest.raises(SystemExit) as exc:
        main(["run", "--model", str(tiny_folder), "--dtype", "bfloat16", "--text", "kjv", "--context-tokens", "300",
              "--prompt", "And", "--max-new-tokens", "3", "--json-out", str(out)])  # fmt: skip
    assert exc.value.code == 0
    result = json.loads(out.read_text())
    assert result["generated_tokens"] == 3
    assert "the recipe at 1/8 of 8K for bfloat16" in capsys.readouterr().err
    mem = result["memory"]
    # 2 bytes a K/V element (float32's 4 would double it): the full cache of what was seen
    c = json.loads((tiny_folder / "config.json").read_text())
    per_token = c["num_hidden_layers"] * c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    assert mem["full_cache_bytes"] == mem["tokens_seen"] * 2 * 2 * per_token
