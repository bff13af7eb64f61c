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
    # the exact prompt's K/V is gone after the first token, and the table shows the peak it made
    assert mem["tiers"]["prefill_kv"] == 0 and mem["peak_managed_resident_bytes"] > mem["managed_resident_bytes"]
    printed = capsys.readouterr().out
    assert "device resident" in printed and "peak (any step)" in printed


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
