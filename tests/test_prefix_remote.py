"""Prefix records on a real Valkey/Redis server shared by two replicas (no mocks).

Each test starts its own `valkey-server` (or `redis-server`) on a free loopback
port with no persistence; the tests skip, saying why, when neither is installed
(`.ci/run` installs one).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("prometheus_client")
redis = pytest.importorskip("redis")

from flashmem.errors import FlashMemError  # noqa: E402
from flashmem.serve.engine import Engine  # noqa: E402
from flashmem.serve.prefix import chain, encode_record  # noqa: E402
from flashmem.serve.prefix_remote import NAMESPACE, RedisPrefixStore, parse_url  # noqa: E402
from flashmem_eval.tiny import tiny_tokenizer  # noqa: E402
from serve_helpers import MODEL, free_port, serving, tiny_cfg, tiny_model  # noqa: E402

SERVER = shutil.which("valkey-server") or shutil.which("redis-server")


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    raw: redis.Redis

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """A fresh server on a free loopback port, no persistence (`indirect` param: a password)."""
    if SERVER is None:
        pytest.skip("neither valkey-server nor redis-server is installed (apt-get install valkey-server)")
    password = getattr(request, "param", None)
    port = free_port()
    args = [SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    raw = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, password=password)
    deadline = time.time() + 10
    while True:
        try:
            raw.ping()
            break
        except redis.ConnectionError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"{SERVER} did not start on port {port}")
            time.sleep(0.05)
    try:
        yield Server(f"redis://127.0.0.1:{port}/0", proc, raw)
    finally:
        raw.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _record(seed: int, n: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(n, generator=g), "v": torch.randn(n, generator=g)}


def _prompt(n: int, seed: int = 1, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize(
    "url",
    ["localhost:6379", "http://h:1/0", "redis://h", "redis://:6379", "redis://h:1/db", "redis://h:1/99", "redis://h:x"],
)
def test_bad_store_url_is_one_clear_error(url: str) -> None:
    with pytest.raises(FlashMemError, match=r"allowed: redis://\[:PASSWORD@\]HOST:PORT\[/DB\]"):
        parse_url(url)
    got = parse_url("redis://10.0.0.5:6380/3")
    assert (got.host, got.port, got.db, got.tls) == ("10.0.0.5", 6380, 3, False)
    secret = parse_url("rediss://:s%40cret@h:1")
    assert secret.password == "s@cret" and secret.tls and "cret" not in secret.shown
    with pytest.raises(FlashMemError) as ex:
        parse_url("redis://:hunter2@h:1/x")
    assert "hunter2" not in str(ex.value)


def test_a_record_written_by_one_replica_is_read_by_another(server: Server) -> None:
    a, b = RedisPrefixStore(server.url), RedisPrefixStore(server.url)
    keys = chain(_prompt(96), 32, "model-fp", "tenant-a")
    for j, k in enumerate(keys):
        a.save(k, keys[j - 1] if j else "", _record(j))
    assert b.longest(keys) == 3 and keys[0] in b
    got = b.load(keys)
    assert len(got) == 3
    for j, rec in enumerate(got):
        assert torch.equal(rec["k"], _record(j)["k"]) and torch.equal(rec["v"], _record(j)["v"])
    # another tenant's chain of the same tokens names other keys: nothing to reuse
    other = chain(_prompt(96), 32, "model-fp", "tenant-b")
    assert b.longest(other) == 0 and b.load(other) == []
    # every key has a TTL (the server forgets records nobody uses)
    assert 0 < server.raw.ttl(NAMESPACE + keys[0]) <= a.ttl_s
    assert a.unreachable == b.unreachable == 0


@pytest.mark.parametrize("server", ["s3cret"], indirect=True)
def test_a_password_protected_server(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    port = server.url.split(":")[2].split("/")[0]
    keys = chain(_prompt(32), 32, "model-fp", "t")
    wrong = RedisPrefixStore(server.url)  # no password: refused, counted, never raised
    wrong.save(keys[0], "", _record(0))
    assert wrong.dropped == 1 and wrong.unreachable == 1 and wrong.load(keys) == []
    RedisPrefixStore(f"redis://:s3cret@127.0.0.1:{port}/0").save(keys[0], "", _record(0))
    monkeypatch.setenv("FLASHMEM_PREFIX_STORE_PASSWORD", "s3cret")
    from_env = RedisPrefixStore(server.url)
    assert len(from_env.load(keys)) == 1 and from_env.unreachable == 0


def test_a_damaged_record_is_never_used_counted_and_deleted(server: Server) -> None:
    a, b = RedisPrefixStore(server.url), RedisPrefixStore(server.url)
    keys = chain(_prompt(96), 32, "model-fp", "t")
    for j, k in enumerate(keys):
        a.save(k, keys[j - 1] if j else "", _record(j))
    server.raw.set(NAMESPACE + keys[1], b"garbage" * 100)
    got = b.load(keys)
    assert len(got) == 1 and torch.equal(got[0]["k"], _record(0)["k"])  # reuse ends before the damaged block
    assert b.damaged == 1 and not server.raw.exists(NAMESPACE + keys[1])
    # a well-formed record stored under another key's name is damage too
    server.raw.set(NAMESPACE + keys[1], encode_record(keys[2], keys[1], _record(2)))
    assert len(b.load(keys)) == 1 and b.damaged == 2
    # one flipped bit in the payload
    data = bytearray(encode_record(keys[1], keys[0], _record(1)))
    data[-5] ^= 0x01
    server.raw.set(NAMESPACE + keys[1], bytes(data))
    assert len(b.load(keys)) == 1 and b.damaged == 3


def test_format_1_and_other_codec_values_are_refused_never_used(server: Server) -> None:
    """A value another (older) replica wrote: format 1 (full fp32 copies) or another codec's
    records. Not used, counted, deleted; the records this replica writes are int8 blocks."""
    import xxhash
    from safetensors.torch import save as st_save

    from flashmem.serve.prefix import MAGIC_V1

    keys = chain(_prompt(96), 32, "model-fp", "t")
    body = st_save({"0.sink_k": torch.zeros(1, 2, 4, 16)}, metadata={"key": keys[0], "parent": ""})
    server.raw.set(NAMESPACE + keys[0], MAGIC_V1 + xxhash.xxh3_128_digest(body) + body)
    b = RedisPrefixStore(server.url)
    assert b.load(keys[:1]) == [] and b.damaged == 1 and not server.raw.exists(NAMESPACE + keys[0])
    pair = {"0.kv.k": torch.randn(1, 2, 32, 32), "0.kv.v": torch.randn(1, 2, 32, 32)}
    RedisPrefixStore(server.url, codec="exact").save(keys[0], "", pair)
    assert b.load(keys[:1]) == [] and b.damaged == 2  # an exact record in an int8 store
    b.save(keys[0], "", pair)
    got = b.load(keys[:1])
    assert len(got) == 1 and (got[0]["0.kv.k"] - pair["0.kv.k"]).abs().max() < 0.05
    assert len(server.raw.get(NAMESPACE + keys[0])) < 0.4 * 2 * pair["0.kv.k"].nbytes  # coded, not fp32


def test_a_killed_server_costs_reuse_never_an_exception(server: Server) -> None:
    a = RedisPrefixStore(server.url, timeout_s=0.5, retry_s=0.2)
    keys = chain(_prompt(64), 32, "model-fp", "t")
    a.save(keys[0], "", _record(0))
    assert a.longest(keys) == 1
    server.kill()
    t0 = time.perf_counter()
    assert a.longest(keys) == 0
    assert a.load(keys) == []
    assert keys[0] not in a
    a.save(keys[1], keys[0], _record(1))
    assert a.dropped == 1
    time.sleep(0.3)  # past retry_s: the store tries the server again, and fails again quietly
    assert a.load(keys) == [] and a.nbytes() >= 0 and len(a) >= 0
    a.save(keys[1], keys[0], _record(1))
    assert time.perf_counter() - t0 < 5  # every call is bounded by the timeout
    assert a.dropped == 2 and a.unreachable >= 5


def test_a_hung_server_costs_one_timeout_then_is_skipped(server: Server) -> None:
    import os
    import signal

    a = RedisPrefixStore(server.url, timeout_s=0.5, retry_s=30)
    keys = chain(_prompt(64), 32, "model-fp", "t")
    a.save(keys[0], "", _record(0))
    os.kill(server.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        t0 = time.perf_counter()
        assert a.load(keys) == []
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert a.longest(keys) == 0 and a.load(keys) == []
        a.save(keys[1], keys[0], _record(1))
        after = time.perf_counter() - t0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert 0.4 < first < 2.0  # one timeout
    assert after < 0.1  # then skipped for retry_s, not waited on
    assert a.unreachable == 4 and a.dropped == 1


def test_the_quota_is_the_servers_lru(server: Server) -> None:
    base = int(server.raw.info("memory")["used_memory"])
    quota = base + 3 * 2**20
    a = RedisPrefixStore(server.url, quota_bytes=quota)
    cfg = server.raw.config_get("maxmemory*")
    assert int(cfg["maxmemory"]) == quota and cfg["maxmemory-policy"] == "allkeys-lru"
    keys = chain(_prompt(32 * 12), 32, "model-fp", "t")
    for j, k in enumerate(keys):  # 12 records of ~0.5 MiB each: 6 MiB under a 3 MiB quota
        a.save(k, keys[j - 1] if j else "", _record(j, n=2**16))
    left = [k for k in keys if server.raw.exists(NAMESPACE + k)]
    assert 0 < len(left) < len(keys) and keys[-1] in left  # evicted, and the newest kept
    assert a.dropped == 0
    # an operator's own limit and allkeys policy are kept
    server.raw.config_set("maxmemory", str(quota * 2))
    server.raw.config_set("maxmemory-policy", "allkeys-lfu")
    RedisPrefixStore(server.url, quota_bytes=quota)
    cfg = server.raw.config_get("maxmemory*")
    assert int(cfg["maxmemory"]) == quota * 2 and cfg["maxmemory-policy"] == "allkeys-lfu"


def test_a_store_down_at_start_sets_the_quota_when_the_server_comes_up() -> None:
    if SERVER is None:
        pytest.skip("neither valkey-server nor redis-server is installed (apt-get install valkey-server)")
    port = free_port()
    store = RedisPrefixStore(f"redis://127.0.0.1:{port}/0", quota_bytes=2**30, retry_s=0.1)  # nobody there
    args = [SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    raw = redis.Redis(port=port, socket_timeout=2)
    try:
        deadline = time.time() + 10
        while True:
            try:
                raw.ping()
                break
            except redis.ConnectionError:
                assert time.time() < deadline
                time.sleep(0.05)
        assert int(raw.config_get("maxmemory")["maxmemory"]) == 0
        time.sleep(0.2)  # past retry_s
        store.save(chain(_prompt(32), 32, "fp", "t")[0], "", _record(0))
        assert store.dropped == 0
        cfg = raw.config_get("maxmemory*")
        assert int(cfg["maxmemory"]) == 2**30 and cfg["maxmemory-policy"] == "allkeys-lru"
    finally:
        raw.close()
        proc.kill()
        proc.wait(timeout=10)


def _engine(store: RedisPrefixStore) -> Engine:
    return Engine(tiny_model(), tiny_tokenizer(), tiny_cfg(), model_name=MODEL, prefix_store=store)


def test_replica_b_answers_a_prompt_cached_by_replica_a(server: Server) -> None:
    import httpx

    prompt = _prompt(100)  # 3 full prefix blocks of 32 before the last token, then its end record
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    replica_a, replica_b = _engine(RedisPrefixStore(server.url)), _engine(RedisPrefixStore(server.url))
    with serving(replica_a) as url_a, serving(replica_b) as url_b:
        ra = httpx.post(url_a + "/v1/completions", json=body, timeout=60).json()
        rb = httpx.post(url_b + "/v1/completions", json=body, timeout=60).json()
        metrics_b = httpx.get(url_b + "/metrics").text
    assert ra["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert rb["usage"]["prompt_tokens_details"]["cached_tokens"] == 98  # 3 blocks and the end record
    assert rb["choices"][0]["text"] == ra["choices"][0]["text"]
    assert "flashmem_prefix_hits_total 1.0" in metrics_b


def test_replicas_keep_answering_when_the_store_dies(server: Server) -> None:
    import httpx

    prompt = _prompt(100, seed=2)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    replica = _engine(RedisPrefixStore(server.url, timeout_s=0.5))
    with serving(replica) as url:
        first = httpx.post(url + "/v1/completions", json=body, timeout=60)
        server.kill()
        after = [httpx.post(url + "/v1/completions", json=body, timeout=60) for _ in range(2)]
        metrics = httpx.get(url + "/metrics").text
    assert first.status_code == 200 and all(r.status_code == 200 for r in after)
    assert len({r.json()["choices"][0]["text"] for r in [first, *after]}) == 1  # the same answer, store or not
    assert all(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in after)
    down = [ln for ln in metrics.splitlines() if ln.startswith("flashmem_prefix_store_unreachable_total")]
    assert down and float(down[0].split()[-1]) > 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prefix-store", "localhost:6379"], "--prefix-store 'localhost:6379' is not a store URL"),
        (["--prefix-store", "redis://h:1/x"], "database 'x'"),
        (["--prefix-store", "redis://h:1", "--prefix-dir", "P"], "give one of them"),
    ],
)
def test_cli_bad_prefix_store_is_one_line_exit_2(tmp_path, capsys, args, message) -> None:
    from flashmem.cli.main import main

    with pytest.raises(SystemExit) as ex:
        main(["serve", *[str(tmp_path / "p") if a == "P" else a for a in args]])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and message in err
