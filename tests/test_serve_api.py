"""flashmem serve over HTTP on loopback: the openai client, streaming, errors, auth, limits, disconnect."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_helpers import MODEL, make_engine, serving, wait_for  # noqa: E402

# a sampled answer that runs until it is stopped: the tiny tokenizer's <eos> (id 1) never drawn,
# else at temperature 1 it comes after a few hundred tokens, and a slow test thread sees it ended
LONG = {"logit_bias": {"1": -100, "2": -100}}  # the tiny tokenizer's two EOS ids: a stream that must not end


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    engine = make_engine(tmp_path_factory.mktemp("prefix"), max_concurrent=2, max_queue=1)
    with serving(engine) as url:
        yield engine, url


def test_openai_client_completions_and_chat(server) -> None:
    openai = pytest.importorskip("openai")
    engine, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    prompt = "In the beginning God created the heaven and the earth."
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop")
    assert c.usage.prompt_tokens == len(engine.tokenizer(prompt).input_ids)
    assert 1 <= c.usage.completion_tokens <= 6
    # Streaming gives the same greedy text, chunk by chunk.
    parts = [
        ch.choices[0].text
        for ch in client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    ]
    assert "".join(parts) == c.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Who made the earth?"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who made the earth?"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_sse_wire_format_ends_with_done(server) -> None:
    _, url = server
    body = {"model": MODEL, "prompt": "And the earth was", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": 7}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "n": 3}, 400, "n"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ({"model": MODEL, "prompt": "x" * 10, "stop": ["", "a"]}, 400, "stop"),
    ],
)
def test_bad_requests_are_4xx_with_openai_error_body(server, body, status, param) -> None:
    _, url = server
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_malformed_json_over_context_and_unknown_route(server) -> None:
    engine, url = server
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
    long = list(range(1, 100)) * (engine.max_context // 99 + 1)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": long}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(url + "/health").json()["status"] == "ok"  # still alive


def test_metrics_exposition(server) -> None:
    _, url = server
    httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "metrics", "max_tokens": 2}, timeout=30)
    text = httpx.get(url + "/metrics").text
    for name in (
        "flashmem_device_resident_bytes",
        "flashmem_cold_bytes",
        "flashmem_prefix_hits_total",
        "flashmem_prefix_misses_total",
        "flashmem_prefix_reused_tokens_total",
        "flashmem_cold_stalls_total",
        "flashmem_time_to_first_token_seconds_bucket",
        "flashmem_inter_token_latency_seconds_bucket",
        "flashmem_tokens_per_second",
        "flashmem_active_sequences",
        "flashmem_decode_forwards_total",
        "flashmem_decode_rows_total",
        "flashmem_decode_forward_seconds_total",
        "flashmem_worker_busy_seconds_total",
    ):
        assert name in text, name
    count = [ln for ln in text.splitlines() if ln.startswith("flashmem_time_to_first_token_seconds_count")]
    assert float(count[0].split()[-1]) >= 1


def test_disconnect_mid_stream_frees_the_sequence(server) -> None:
    engine, url = server
    body = {
        "model": MODEL,
        "prompt": "Let there be light",
        "max_tokens": 4000,
        "stream": True,
        "temperature": 1,
        **LONG,
    }
    before = _outcome(url, "cancelled")
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
        assert engine.active == 1
    # Closing the response drops the connection: the sequence and its cache go at the next token
    # it would send (30 s: a shared 2-core machine under load once took longer than 10)
    assert wait_for(lambda: engine.active == 0, 30)
    assert wait_for(lambda: _outcome(url, "cancelled") == before + 1, 5)


def test_queue_beyond_max_concurrent_gets_429(server) -> None:
    engine, url = server
    body = {"model": MODEL, "prompt": "busy", "max_tokens": 4000, "stream": True, "temperature": 1, **LONG}
    streams = [httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) for _ in range(3)]
    try:
        responses = [s.__enter__() for s in streams]  # 2 running + 1 waiting
        assert wait_for(lambda: engine.active == 2, 10)
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert [x.status_code for x in responses] == [200, 200, 200]
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    assert wait_for(lambda: engine.active == 0, 10)


def test_api_keys_401_and_tenant_isolation(tmp_path) -> None:
    from flashmem.serve.auth import load_api_keys

    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# key tenant\nkey-a team-a\nkey-a2 team-a\nkey-b team-b\n")
    keys = load_api_keys(keys_file)
    engine = make_engine(tmp_path / "prefix")
    prompt = list(range(3, 103))  # 100 tokens: 3 full prefix blocks of 32
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    with serving(engine, api_keys=keys) as url:
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        bad = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models").status_code == 401

        def cached(key: str) -> int:
            r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert cached("key-a") == 0
        assert cached("key-a") == 98  # the same tenant reuses its 3 stored blocks and its end record
        assert cached("key-b") == 0  # tenant B never reuses tenant A's records, same text
        assert cached("key-a2") == 98  # another key of tenant A does
        assert cached("key-b") == 98


def _outcome(url: str, outcome: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'flashmem_requests_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_long_prefill_does_not_freeze_other_streams(tmp_path) -> None:
    """A 3000-token prompt prefills in ~94 chunks; a short request admitted after it
    streams all its tokens while the long one is still prefilling (round-robin)."""
    import threading
    import time

    engine = make_engine(None, max_concurrent=2)
    done: dict[str, float] = {}

    def run(name: str, prompt: list[int], n: int) -> None:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200
        done[name] = time.perf_counter()

    with serving(engine) as url:
        long = threading.Thread(target=run, args=("long", list(range(3, 123)) * 25, 1))
        long.start()
        assert wait_for(lambda: engine.active == 1, 10)
        run("short", [5, 6, 7, 8], 8)
        long.join(timeout=120)
    assert done["short"] < done["long"]


def test_prefixes_survive_a_server_restart(tmp_path) -> None:
    prompt = list(range(3, 83))  # 80 tokens: 2 full prefix blocks before the last token, an end record at 78
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    answers = []
    for expect in (0, 78):
        engine = make_engine(tmp_path / "prefix")  # a new engine and store: a restarted server
        with serving(engine) as url:
            r = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == expect
        answers.append(r["choices"][0]["text"])
    assert answers[0] == answers[1]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--api-keys", "MISSING"], "--api-keys"),
        (["--api-keys", "EMPTY"], "no keys"),
        (["--config", "MISSING.yaml"], "MISSING.yaml"),
        (["--cold-quota", "lots"], "--cold-quota"),
        (["--port", "BUSY"], "cannot listen"),
        (["--prefix-codec", "zstd"], "--prefix-codec 'zstd': allowed: exact, int4, int8"),
        (["--dtype", "int8"], "--dtype 'int8': allowed: float32, bfloat16, float16"),
        (["--weight-layout", "rows"], "--weight-layout 'rows': allowed: auto, out_major, in_major, onednn"),
    ],
)
def test_cli_user_mistakes_are_one_line_exit_2(tmp_path, capsys, args, message) -> None:
    import socket

    from flashmem.cli.main import main

    (tmp_path / "EMPTY").write_text("# nothing\n")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    subst = {"MISSING": str(tmp_path / "nokeys"), "EMPTY": str(tmp_path / "EMPTY"), "BUSY": str(busy.getsockname()[1])}
    subst["MISSING.yaml"] = str(tmp_path / "MISSING.yaml")
    try:
        with pytest.raises(SystemExit) as ex:
            main(["serve", "--prefix-dir", str(tmp_path / "p"), *[subst.get(a, a) for a in args]])
    finally:
        busy.close()
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and message in err


def test_keepalive_comments_do_not_disturb_clients(server, monkeypatch) -> None:
    """While the first token is far away a stream sends SSE comments (read timeouts
    restart); the openai client and a raw SSE reader skip them."""
    openai = pytest.importorskip("openai")
    from flashmem.serve import app as app_module

    engine, url = server
    monkeypatch.setattr(app_module, "KEEPALIVE_S", 0.001)
    # each round takes at least 20 ms, so the first token is always past a keep-alive interval
    # (a tiny model's whole answer can otherwise be queued before the stream starts waiting)
    step = engine.step

    def slow_step() -> None:
        time.sleep(0.02)
        step()

    monkeypatch.setattr(engine, "step", slow_step)
    body = {"model": MODEL, "prompt": "And God said", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert any(ln.startswith(": keep-alive") for ln in lines)
    raw = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines if ln.startswith("data: {"))
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    text = "".join(c.choices[0].text for c in client.completions.create(**{**body, "stream": True}))
    assert text == raw


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_sequence(server) -> None:
    engine, url = server
    body = {"model": MODEL, "prompt": "Let there be light", "max_tokens": 4000, "temperature": 1, **LONG}
    before = _outcome(url, "cancelled")
    eos, engine.eos_ids = engine.eos_ids, set()  # a sampled EOS must not end it before the client gives up
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    finally:
        engine.eos_ids = eos
    # The client gave up and closed its socket: the server notices and cancels.
    assert wait_for(lambda: engine.active == 0, 15)
    # the metric is counted by the request's own thread after it sees the disconnect: on a loaded
    # machine that came after 5 s once (the same wait as above then)
    assert wait_for(lambda: _outcome(url, "cancelled") == before + 1, 15)


def test_prefix_codec_reaches_the_store(tmp_path) -> None:
    """`--prefix-codec` picks the records' codec for a folder store (and a shared one, the same
    keyword); the flag's default is the store's."""
    import inspect

    from flashmem.cli.serve_cmd import _prefix_backend, serve
    from flashmem.serve.prefix import DEFAULT_CODEC

    store, where = _prefix_backend(False, None, tmp_path / "p", 2**20, "exact")
    assert store is not None and store.codec == "exact" and "exact records" in where
    assert inspect.signature(serve).parameters["prefix_codec"].default.default == DEFAULT_CODEC
