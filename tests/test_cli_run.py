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
    assert "device resident" in capsys.readouterr().out


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
