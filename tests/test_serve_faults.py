"""Issue 30: faults of `flashmem serve` that must cost one request at most, never wrong output.

Damaged prefix records (checksummed: never used, counted, removed), index and files
after outside deletions, the prefix folder's mode; 10 MB bodies and multi-MB prompts
(413 / 400 at once, /health answering meanwhile, memory back), tokenizing off the
event loop; max_tokens beyond the context; logit_bias and the penalties; parameters
refused rather than ignored; huge seeds and lone surrogates; /docs behind the key;
the CLI's --api-keys on devices and FIFOs, absurd sizes.
"""

from __future__ import annotations

import gc
import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from flashmem.serve.engine import Sampling, Sequence, process_logits  # noqa: E402
from flashmem.serve.prefix import MAGIC, SUFFIX, PrefixStore  # noqa: E402
from serve_helpers import MODEL, make_engine, serving, tiny_model  # noqa: E402

torch.set_num_threads(1)

N_LOGITS = 4


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


def _run(engine, prompt: list[int]) -> Sequence:
    seq = Sequence(prompt, Sampling(max_tokens=N_LOGITS, temperature=0), "t", None)
    seq.record_logits = N_LOGITS
    return engine.run_sync(seq)


def _damaged(engine) -> float:
    return engine.metrics.registry.get_sample_value("flashmem_prefix_damaged_records_total") or 0.0


def _payload_start(data: bytes) -> int:
    body = len(MAGIC) + 16
    return body + 8 + int.from_bytes(data[body : body + 8], "little")


def _flip_exponent(data: bytearray) -> None:  # one float's top exponent bit, mid-payload
    p = _payload_start(bytes(data))
    i = p + ((len(data) - p) // 2) // 4 * 4 + 3
    data[i] ^= 0x40


def _flip_signs(data: bytearray) -> None:  # the sign bit of every float32 in the payload
    p = _payload_start(bytes(data))
    for i in range(p + 3, len(data), 4):
        data[i] ^= 0x80


def _random_4k(data: bytearray) -> None:
    p = _payload_start(bytes(data))
    n = min(4096, len(data) - p)
    data[p : p + n] = os.urandom(n)


def _zeros_64k(data: bytearray) -> None:
    data[:] = bytes(max(len(data), 65536))


def _header_bit(data: bytearray) -> None:  # inside the safetensors JSON header
    data[len(MAGIC) + 16 + 8 + 5] ^= 0x01


def _truncate(data: bytearray) -> None:
    del data[len(data) // 2 :]


@pytest.mark.parametrize(
    "damage", [_flip_exponent, _flip_signs, _random_4k, _zeros_64k, _header_bit, _truncate], ids=lambda f: f.__name__
)
def test_damaged_prefix_record_is_never_used_counted_and_removed(tmp_path, damage) -> None:
    """The issue's probes: one flipped exponent bit gave '' instead of the answer, random
    bytes and zeros were reused undetected. Now the record fails its checksum: the blocks
    from it on are prefilled again (same logits as fresh), it is counted and removed."""
    engine = make_engine(tmp_path)
    first = fresh = _run(engine, _prompt(150))  # the cold request
    assert first.reused_tokens == 0 and len(first.keys) == 4
    victim = tmp_path / (first.keys[1] + SUFFIX)  # the second block: the first is still reused
    data = bytearray(victim.read_bytes())
    damage(data)
    victim.write_bytes(bytes(data))
    again = _run(engine, _prompt(150))
    assert again.reused_tokens == 32  # block 0 only
    assert again.generated == fresh.generated
    for a, b in zip(fresh.logits, again.logits):
        assert (a - b).abs().max().item() <= 1e-4
    assert _damaged(engine) == 1
    # removed, then written again (verified) by the prefill that recomputed it
    assert victim.exists() and victim.read_bytes() != bytes(data)
    assert _run(engine, _prompt(150)).reused_tokens == 148  # 4 blocks and the end record
    assert _damaged(engine) == 1


def test_record_renamed_to_another_key_is_not_used(tmp_path) -> None:
    engine = make_engine(tmp_path)
    seq = _run(engine, _prompt(150))
    a, b = (tmp_path / (k + SUFFIX) for k in seq.keys[:2])
    b.write_bytes(a.read_bytes())  # valid bytes, wrong place in the chain
    assert _run(engine, _prompt(150)).reused_tokens == 32
    assert _damaged(engine) == 1


def test_index_follows_files_deleted_from_outside(tmp_path) -> None:
    """An outside cleanup deleted every record: the next send recomputes and writes them
    all again, the one after reuses them (before: 'cached 0' on both)."""
    engine = make_engine(tmp_path)
    prompt = _prompt(100)
    assert _run(engine, prompt).reused_tokens == 0
    for f in tmp_path.glob("*" + SUFFIX):
        f.unlink()
    assert _run(engine, prompt).reused_tokens == 0
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 4 == len(engine.prefix_store)  # 3 blocks, 1 end
    assert _run(engine, prompt).reused_tokens == 98
    # only the middle one gone: the first block is still reused, and all of it next time
    middle = sorted(tmp_path.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)[1]
    middle.unlink()
    assert _run(engine, prompt).reused_tokens == 32
    assert _run(engine, prompt).reused_tokens == 98
    assert _damaged(engine) == 0  # a missing file is not damage


def test_prefix_folder_is_0700_and_records_0600(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        store = PrefixStore(tmp_path / "a" / "prefix")
        store.save("k", "", {"x": torch.zeros(4)})
        loose = tmp_path / "loose"
        loose.mkdir(mode=0o755)
        PrefixStore(loose)  # an existing, looser folder is tightened
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "prefix").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a" / "prefix" / ("k" + SUFFIX)).stat().st_mode) == 0o600
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_records_of_the_unchecked_format_are_removed(tmp_path) -> None:
    old = tmp_path / ("ab" * 20 + ".safetensors")
    old.write_bytes(b"unchecked")
    store = PrefixStore(tmp_path)
    assert not old.exists() and len(store) == 0


def test_damaged_record_counted_in_metrics_over_http(tmp_path) -> None:
    engine = make_engine(tmp_path)
    body = {"model": MODEL, "prompt": _prompt(100), "max_tokens": 2, "temperature": 0}
    with serving(engine) as url:
        r1 = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        for f in tmp_path.glob("*" + SUFFIX):
            f.write_bytes(bytes(f.stat().st_size))  # all zeros
        r2 = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(url + "/metrics").text
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r2["choices"][0]["text"] == r1["choices"][0]["text"]
    line = [ln for ln in metrics.splitlines() if ln.startswith("flashmem_prefix_damaged_records_total")]
    assert float(line[0].split()[-1]) == 1


# ------------------------------------------------------------------ one request cannot freeze the server
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    engine = make_engine(tmp_path_factory.mktemp("prefix"), max_concurrent=2, max_queue=4)
    with serving(engine) as url:
        yield engine, url


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _while_polling_health(url: str, fn) -> tuple[object, list[float]]:
    """Run fn() in a thread; poll /health until it ends. -> (fn's result, health latencies)."""
    out: dict[str, object] = {}
    th = threading.Thread(target=lambda: out.setdefault("r", fn()))
    th.start()
    waits = []
    while th.is_alive():
        t = time.perf_counter()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        waits.append(time.perf_counter() - t)
        time.sleep(0.05)
    th.join()
    return out["r"], waits


def test_10mb_body_is_413_at_once_and_memory_comes_back(server) -> None:
    """Before: a 10 MB prompt was tokenized on the event loop for 43 s (every stream and
    /health waited) and resident memory grew by 770 MB for good."""
    _, url = server
    gc.collect()
    before = _rss_mb()
    held = {"raw": json.dumps({"model": MODEL, "prompt": "In the beginning " * 625_000}).encode()}  # 10.6 MB

    def send() -> tuple[int, dict, float]:
        t = time.perf_counter()
        headers = {"content-type": "application/json"}
        r = httpx.post(url + "/v1/completions", content=held["raw"], headers=headers, timeout=60)
        return r.status_code, r.json(), time.perf_counter() - t

    (status, body, took), waits = _while_polling_health(url, send)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert "allowed: at most" in body["error"]["message"]
    assert took < 10 and max(waits, default=0) < 1.0
    held.clear()
    gc.collect()
    assert _rss_mb() - before < 64


def test_chunked_body_over_the_limit_is_413(server) -> None:
    """No Content-Length (chunked upload): counted as it arrives, dropped, 413."""
    _, url = server
    head = b'{"model": "tiny", "prompt": "'

    def body():
        yield head
        for _ in range(80):
            yield b"x" * 2**17  # 10 MiB in all

    r = httpx.post(url + "/v1/completions", content=body(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_multi_mb_prompt_is_refused_before_tokenizing(server) -> None:
    """3 MB of prompt text (under the body limit) cannot fit 4096 tokens: 400 at once."""
    engine, url = server
    text = "In the beginning " * 180_000  # 3 MB

    def send() -> tuple[int, dict, float]:
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": text}, timeout=60)
        return r.status_code, r.json(), time.perf_counter() - t

    (status, body, took), waits = _while_polling_health(url, send)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert took < 3 and max(waits, default=0) < 1.0
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # text just under the bound is tokenized and judged by its tokens
    assert engine.max_context * 2 < len(text)


def test_tokenizing_runs_off_the_event_loop_and_the_worker(server, monkeypatch) -> None:
    """A prompt whose tokenization takes 2 s holds neither /health nor another request."""
    from flashmem.serve import app as app_module

    _, url = server
    real = app_module.encode

    def slow(tok, text, **kw):
        if "SLOW" in text:
            time.sleep(2.0)
        return real(tok, text, **kw)

    monkeypatch.setattr(app_module, "encode", slow)
    done: dict[str, float] = {}

    def post(name: str, prompt: str) -> None:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        done[name] = time.perf_counter()

    t0 = time.perf_counter()
    slow_req = threading.Thread(target=post, args=("slow", "SLOW words"))
    slow_req.start()
    time.sleep(0.2)
    health = time.perf_counter()
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    health = time.perf_counter() - health
    post("fast", "And God said")
    slow_req.join(30)
    assert health < 0.5
    assert done["fast"] < done["slow"] and done["fast"] - t0 < 1.8


# ------------------------------------------------------------------ context, parameters, inputs
@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"max_tokens": 9000}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 100_000_000}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": 5000}, "max_completion_tokens"),
        ("/v1/chat/completions", {"max_tokens": 5000}, "max_tokens"),
    ],
)
def test_prompt_plus_max_tokens_beyond_the_context_is_400(server, path, extra, param) -> None:
    _, url = server
    body = {"model": MODEL, **extra}
    body.update({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})
    t = time.perf_counter()
    r = httpx.post(url + path, json=body, timeout=30)
    assert time.perf_counter() - t < 5
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param and "allowed:" in err["message"]


def test_without_max_tokens_the_answer_stops_at_the_context(server) -> None:
    engine, url = server
    prompt = _prompt(engine.max_context - 3)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


def _greedy_first(engine, prompt: str) -> int:
    ids = engine.tokenizer(prompt).input_ids
    seq = engine.run_sync(Sequence(ids, Sampling(max_tokens=1, temperature=0), "x", None))
    return seq.generated[0]


def test_logit_bias_changes_the_output(server) -> None:
    engine, url = server
    prompt = "And God said, Let there be"
    g = _greedy_first(engine, prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    plain = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    assert plain == engine.tokenizer.decode([g])
    banned = httpx.post(url + "/v1/completions", json={**body, "logit_bias": {str(g): -100}}, timeout=30).json()
    assert banned["choices"][0]["text"] != plain
    t = engine.tokenizer(" light").input_ids[-1]
    forced = httpx.post(
        url + "/v1/completions", json={**body, "max_tokens": 4, "logit_bias": {str(t): 100}}, timeout=30
    ).json()
    assert forced["choices"][0]["text"] == engine.tokenizer.decode([t] * 4)


def test_penalties_follow_openai() -> None:
    logits = torch.tensor([0.0, 3.0, 2.5, 1.0])
    s = Sampling(frequency_penalty=1.0)
    assert int(process_logits(logits, s, [1, 1]).argmax()) == 2  # 3 - 2 x 1.0 < 2.5
    assert int(process_logits(logits, Sampling(frequency_penalty=0.2), [1, 1]).argmax()) == 1
    assert int(process_logits(logits, Sampling(presence_penalty=0.6), [1, 1, 1]).argmax()) == 2  # once, not x3
    assert int(process_logits(logits, Sampling(presence_penalty=0.4), [1, 1, 1]).argmax()) == 1
    assert int(process_logits(logits, Sampling(presence_penalty=-2.0), [2]).argmax()) == 2  # negative: favour
    biased = process_logits(logits, Sampling(logit_bias={0: 5.0}), [])
    assert int(biased.argmax()) == 0 and torch.equal(logits, torch.tensor([0.0, 3.0, 2.5, 1.0]))  # not in place


def test_penalties_change_a_repetitive_answer(server) -> None:
    _, url = server
    body = {"model": MODEL, "prompt": "the the the the", "max_tokens": 24, "temperature": 0}
    plain = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] != plain, extra


def test_min_tokens_holds_eos_and_process_logits_rules_it_out() -> None:
    logits = torch.tensor([0.0, 3.0, 2.5, 1.0])  # id 1: EOS here
    s = Sampling(min_tokens=2)
    assert int(process_logits(logits, s, [0], {1}).argmax()) == 2  # 1 token so far: EOS ruled out
    assert int(process_logits(logits, s, [0, 0], {1}).argmax()) == 1  # 2: allowed again
    assert int(process_logits(logits, s, [], set()).argmax()) == 1  # no EOS known: nothing to rule out
    assert torch.equal(logits, torch.tensor([0.0, 3.0, 2.5, 1.0]))  # not in place


def _answer(url: str, body: dict) -> dict:
    r = httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": "a b c", "temperature": 0, **body}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_ignore_eos_and_min_tokens_set_the_answer_length(server) -> None:
    """vLLM's extensions, with EOS made the model's choice at every step (logit_bias)."""
    engine, url = server
    eos = min(engine.eos_ids)
    bias = {"logit_bias": {str(eos): 100}, "max_tokens": 7}
    plain = _answer(url, bias)
    assert plain["usage"]["completion_tokens"] == 0 and plain["choices"][0]["finish_reason"] == "stop"
    forced = _answer(url, {**bias, "ignore_eos": True})  # EOS after EOS, to the length
    assert forced["usage"]["completion_tokens"] == 7 and forced["choices"][0]["finish_reason"] == "length"
    held = _answer(url, {**bias, "min_tokens": 4})  # 4 other tokens, then EOS ends it
    assert held["usage"]["completion_tokens"] == 4 and held["choices"][0]["finish_reason"] == "stop"
    # streamed, the same lengths
    with httpx.stream(
        "POST", url + "/v1/completions", timeout=60,
        json={"model": MODEL, "prompt": "a b c", "temperature": 0, **bias, "min_tokens": 4, "stream": True,
              "stream_options": {"include_usage": True}},
    ) as r:  # fmt: skip
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_min_tokens_defers_stop_strings(server) -> None:
    """A stop string counts only once it ends past the first min_tokens tokens' text."""
    _, url = server
    plain = _answer(url, {"max_tokens": 16})["choices"][0]["text"]
    stop = next(ch for ch in plain if not ch.isspace())  # it first occurs in the first tokens' text
    cut = _answer(url, {"max_tokens": 16, "stop": stop})
    late = _answer(url, {"max_tokens": 16, "stop": stop, "min_tokens": 6})
    text = late["choices"][0]["text"]
    assert plain.startswith(text) and len(text) > len(cut["choices"][0]["text"])
    assert late["usage"]["completion_tokens"] >= 6
    if late["choices"][0]["finish_reason"] == "stop":  # cut at a later occurrence, never an earlier one
        assert plain[len(text) :].startswith(stop)


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"logprobs": 2}, "logprobs"),
        ("/v1/completions", {"logprobs": 0}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"top_k": 5}, "top_k"),
        ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"min_tokens": 3}, "min_tokens"),  # more than max_tokens (2)
        ("/v1/completions", {"ignore_eos": "maybe"}, "ignore_eos"),
        ("/v1/completions", {"seed": 2**70}, "seed"),
        ("/v1/completions", {"seed": -(2**64)}, "seed"),
        ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
        ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ],
)
def test_parameters_not_implemented_or_invalid_are_400_naming_them(server, path, extra, param) -> None:
    _, url = server
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})
    body.update(extra)
    r = httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] or param == "prompt" and "surrogate" in err["message"]


@pytest.mark.parametrize(
    "path,extra",
    [
        ("/v1/completions", {"echo": False, "logprobs": None, "best_of": 1, "suffix": "", "user": "u"}),
        ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}}),
        ("/v1/completions", {"seed": 2**63 - 1, "presence_penalty": 0.5, "logit_bias": {}}),
        ("/v1/chat/completions", {"min_tokens": 0, "ignore_eos": False}),
    ],
)
def test_defaults_of_unsupported_parameters_are_accepted(server, path, extra) -> None:
    _, url = server
    body = {"model": MODEL, "max_tokens": 2, **extra}
    body.update({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_docs_and_schema_need_the_key_when_keys_are_set(tmp_path, server) -> None:
    from flashmem.serve.auth import salt_for

    _, open_url = server
    assert httpx.get(open_url + "/openapi.json").status_code == 200  # no keys: open
    assert httpx.get(open_url + "/docs").status_code == 200
    engine = make_engine(None)
    with serving(engine, api_keys={"k1": salt_for("t")}) as url:
        for path in ("/openapi.json", "/docs", "/redoc"):
            r = httpx.get(url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(url + path, headers={"Authorization": "Bearer k1"}).status_code == 200, path
        schema = httpx.get(url + "/openapi.json", headers={"Authorization": "Bearer k1"}).json()
        assert "/v1/completions" in schema["paths"]
        assert httpx.get(url + "/health").status_code == 200  # health stays open


# ------------------------------------------------------------------ the CLI
def _cli(args: list[str], capsys) -> str:
    from flashmem.cli.main import main

    with pytest.raises(SystemExit) as ex:
        main(["serve", *args])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    return err


def test_api_keys_device_or_fifo_is_one_line_exit_2(tmp_path, capsys) -> None:
    err = _cli(["--api-keys", "/dev/zero", "--prefix-dir", str(tmp_path / "p")], capsys)
    assert "--api-keys /dev/zero" in err and "regular file" in err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t = time.perf_counter()
    err = _cli(["--api-keys", str(fifo), "--prefix-dir", str(tmp_path / "p")], capsys)
    assert time.perf_counter() - t < 5 and "regular file" in err
    big = tmp_path / "big"
    big.write_bytes(b"k " * 2**20)
    assert "at most" in _cli(["--api-keys", str(big), "--prefix-dir", str(tmp_path / "p")], capsys)


@pytest.mark.parametrize("value", ["1e400", "inf", "nan", "0", "-5G", "1e30"])
def test_absurd_sizes_are_one_line_exit_2(tmp_path, capsys, value) -> None:
    err = _cli(["--cold-quota", value, "--prefix-dir", str(tmp_path / "p")], capsys)
    assert "--cold-quota" in err and "allowed:" in err
    err = _cli(["--max-request-bytes", value, "--prefix-dir", str(tmp_path / "p")], capsys)
    assert "--max-request-bytes" in err


def test_a_tokenizer_that_cannot_be_copied_is_shared_under_a_lock() -> None:
    import asyncio

    from flashmem.serve.app import Tokenizing

    class Tok:
        def __deepcopy__(self, memo):
            raise TypeError("not copyable")

        def __call__(self, text: str) -> list[int]:
            return [len(text)]

    tokenize = Tokenizing(Tok())
    try:
        got = asyncio.run(tokenize.run(lambda tok: tok("abcd")))
    finally:
        tokenize.close()
    assert got == [4]


@pytest.mark.parametrize("flag, packed", [([], True), (["--no-pack-prefill"], False)])
def test_serve_passes_pack_prefill_to_the_engine(tmp_path, monkeypatch, flag, packed) -> None:
    """`flashmem serve --no-pack-prefill` turns the packed prompt chunks off (Engine(pack_prefill=False))."""
    from flashmem.cli import serve_cmd
    from flashmem.cli.main import main

    seen: dict = {}

    class Stop(Exception):
        pass

    def load(model, cfg, threads, store, **options):
        seen.update(options)
        raise Stop

    monkeypatch.setattr(serve_cmd, "_load_engine", load)
    with pytest.raises(Stop):
        main(["serve", "--prefix-dir", str(tmp_path / "p"), *flag])
    assert seen["pack_prefill"] is packed


@pytest.mark.parametrize(
    "flags, dtype, sized",
    [([], torch.float32, False), (["--dtype", "bfloat16"], torch.bfloat16, True),
     (["--dtype", "bfloat16", "--config", "CFG"], torch.bfloat16, False),
     (["--weight-layout", "out_major"], torch.float32, False)],
)  # fmt: skip
def test_serve_dtype_and_layout_reach_the_model_and_size_the_default_recipe(tmp_path, monkeypatch, flags, dtype, sized):
    """`flashmem serve --dtype` loads the model in that dtype (and --weight-layout in that layout). Without --config a dtype other than
    float32 gets the recipe sized for the loaded model's bytes (configs/cpu-small.yaml is the one
    for float32); a --config given is served as it is."""
    import flashmem
    from flashmem.cli.main import main
    from flashmem.config import FlashMemoryConfig

    seen: dict = {}
    small = Path(__file__).resolve().parents[1] / "configs" / "cpu-small.yaml"

    class Stop(Exception):
        pass

    def load_model(name, dtype=None, weight_layout="auto"):
        seen["dtype"], seen["layout"] = dtype, weight_layout
        return tiny_model().to(dtype), None

    def engine(model, tok, cfg, **options):
        seen["cfg"] = cfg
        raise Stop

    monkeypatch.setattr(flashmem, "load_model", load_model)
    monkeypatch.setattr("flashmem.serve.engine.Engine", engine)
    argv = [str(small) if f == "CFG" else f for f in flags]
    with pytest.raises(Stop):
        main(["serve", "--prefix-dir", str(tmp_path / "p"), *argv])
    assert seen["dtype"] == dtype
    assert seen["layout"] == ("out_major" if "--weight-layout" in flags else "auto")
    batched = {"exact_on_doubt": 0.0}  # served batched (--max-concurrent 4): the recipe's redo off
    if sized:
        want = FlashMemoryConfig.for_budget(1 / 8, 8192, tiny_model().to(dtype), prefetch_threads=0)
        assert want.exact_on_doubt > 0 and seen["cfg"] == want.model_copy(update=batched)
        # float32's pages would be twice the share of a bf16 cache: sized for 2 bytes, fewer
        assert (
            seen["cfg"].lsa_top_k
            < FlashMemoryConfig.for_budget(1 / 8, 8192, tiny_model(), prefetch_threads=0).lsa_top_k
        )
    else:
        assert seen["cfg"] == FlashMemoryConfig.from_yaml(small).model_copy(update=batched)


@pytest.mark.parametrize(("flags", "doubt"), [([], 0.0), (["--max-batch", "1"], 0.5), (["--max-concurrent", "1"], 0.5)])
def test_serve_turns_the_recipes_near_tie_redo_off_where_it_batches(tmp_path, monkeypatch, capsys, flags, doubt):
    """configs/cpu-small.yaml decides near ties exactly (exact_on_doubt), which one sequence's
    forward can undo and a batched one cannot: a batching server turns it off and says so."""
    import flashmem
    from flashmem.cli.main import main

    seen: dict = {}

    class Stop(Exception):
        pass

    def engine(model, tok, cfg, **options):
        seen["cfg"] = cfg
        raise Stop

    monkeypatch.setattr(flashmem, "load_model", lambda *a, **k: (tiny_model(), None))
    monkeypatch.setattr("flashmem.serve.engine.Engine", engine)
    with pytest.raises(Stop):
        main(["serve", "--prefix-dir", str(tmp_path / "p"), *flags])
    assert seen["cfg"].exact_on_doubt == doubt
    said = "exact_on_doubt: off" in capsys.readouterr().err
    assert said is (doubt == 0)
