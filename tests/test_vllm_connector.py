"""The vLLM connector's logic without vLLM: options, keys, plans, copies, stores.

Two "engines" (a Planner and a Worker each, as vLLM's scheduler and worker hold)
share a real store (a folder, or an LMDB file; a Valkey/Redis server where one is
installed). The paged buffers have vLLM's CPU layout, [num_blocks, kv_heads,
block_size, 2 * head_size], filled from the tokens so that a copy is checked token
by token. The engine itself is tested in test_vllm_connector_engine.py; the last
tests here check the connector class against vLLM's interface where vLLM is
importable.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flashmem.errors import ConfigError
from flashmem.integrations.vllm import kv_transfer_config
from flashmem.integrations.vllm.plan import Options, Planner, Worker, fingerprint, request_salt
from flashmem.integrations.vllm.stores import LmdbPrefixStore, SharedFolderStore, open_backend

BS = 16  # vLLM block size in these tests
CHUNK = 32  # tokens per record: 2 blocks
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
H, D = 2, 4
NUM_BLOCKS = 64
FP = fingerprint("tiny", {"block_size": BS, "layers": ",".join(LAYERS)})


def kv_buffers(fill: float = float("nan")) -> dict[str, torch.Tensor]:
    return {name: torch.full((NUM_BLOCKS, H, BS, 2 * D), fill) for name in LAYERS}


def token_kv(layer: int, pos: int, tok: int) -> torch.Tensor:
    """What a forward would write for token `tok` at `pos` in `layer` ([H, 2D])."""
    base = torch.arange(H * 2 * D, dtype=torch.float32).reshape(H, 2 * D)
    return base * 0.001 + pos + 1000.0 * tok + 0.5 * layer


def forward(kv: dict[str, torch.Tensor], tokens: list[int], block_ids: list[int], start: int, stop: int) -> None:
    """Write tokens start..stop-1 into their slots, as an attention layer does."""
    for li, name in enumerate(LAYERS):
        for pos in range(start, stop):
            kv[name][block_ids[pos // BS], :, pos % BS] = token_kv(li, pos, tokens[pos])


def assert_holds(kv: dict[str, torch.Tensor], tokens: list[int], block_ids: list[int], start: int, stop: int) -> None:
    for li, name in enumerate(LAYERS):
        for pos in range(start, stop):
            torch.testing.assert_close(kv[name][block_ids[pos // BS], :, pos % BS], token_kv(li, pos, tokens[pos]))


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


class Engine:
    """A scheduler (Planner) and a worker (Worker) over one store path, as one vLLM engine."""

    def __init__(self, kind: str, path: str, **opts: object) -> None:
        where = {"path": path} if path else {}
        o = Options.parse({"store": kind, "chunk_tokens": CHUNK, **where, **opts}, BS)
        self.sched_store = open_backend(o.store, o.path, o.quota_bytes)
        self.work_store = open_backend(o.store, o.path, o.quota_bytes)  # vLLM opens one per role
        self.planner = Planner(self.sched_store, o, BS, FP)
        self.worker = Worker(self.work_store, o, BS, NUM_BLOCKS)
        self.kv = kv_buffers()
        self.worker.register(self.kv)

    def serve(
        self,
        req: str,
        tokens: list[int],
        block_ids: list[int],
        *,
        salt: str = "",
        local: int = 0,
        steps: tuple[int, ...] = (),
    ) -> tuple[int, set[int]]:
        """Run a prompt through lookup, allocation and prefill steps (sizes `steps`, the rest last).
        Returns (tokens loaded from the store, block ids the worker reported invalid)."""
        ext = self.planner.lookup(req, tokens, salt, local)
        self.planner.allocated(req, tokens, salt, ext)
        computed = local + ext
        errors: set[int] = set()
        sizes = list(steps) + [len(tokens) - computed - sum(steps)]
        for i, n in enumerate(sizes):
            if i == 0:
                plan = self.planner.build([(req, block_ids, computed)], [], {req: n})
            else:
                plan = self.planner.build([], [(req, None, False, computed)], {req: n})
            self.worker.load(plan.loads)
            errors |= self.worker.take_errors()
            forward(self.kv, tokens, block_ids, computed, computed + n)
            for name in LAYERS:
                self.worker.stage(name, self.kv[name], plan.saves)
            self.worker.flush(plan.saves)
            computed += n
        self.planner.build([], [], {}, finished=[req])
        return ext, errors


@pytest.fixture(params=["disk", "lmdb"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _flip(kind: str, path: Path, store: object, key: str) -> None:
    """Flip one payload byte of the record of `key`, where the store keeps it."""
    if kind == "disk":
        f = path / f"{key}.fmprefix"
        data = bytearray(f.read_bytes())
        data[-7] ^= 0x01
        f.write_bytes(bytes(data))
    else:
        assert isinstance(store, LmdbPrefixStore)
        with store._env.begin(write=True) as txn:
            data = bytearray(txn.get(key.encode(), db=store._records))
            data[-7] ^= 0x01
            txn.put(key.encode(), bytes(data), db=store._records)


# ------------------------------------------------------------------------------ options
def test_options_defaults_and_errors() -> None:
    assert Options.parse({}, 128).chunk_tokens == 256
    assert Options.parse({}, 16).chunk_tokens == 256
    assert Options.parse({}, 512).chunk_tokens == 512
    assert Options.parse({"chunk_tokens": 384}, 128).chunk_tokens == 384
    with pytest.raises(ConfigError, match="not a multiple of vLLM's block size 128"):
        Options.parse({"chunk_tokens": 200}, 128)
    with pytest.raises(ConfigError, match="unknown option.*'quota'.*allowed: store, path"):
        Options.parse({"quota": 5}, 128)
    with pytest.raises(ConfigError, match="quota_bytes -1; allowed: an integer >= 1"):
        Options.parse({"quota_bytes": -1}, 128)
    with pytest.raises(ConfigError, match="verify 'yes'; allowed: true or false"):
        Options.parse({"verify": "yes"}, 128)
    with pytest.raises(ConfigError, match="store 'ftp'; allowed: disk, lmdb, redis"):
        open_backend("ftp", "/tmp/x", None)
    with pytest.raises(ConfigError, match="needs a 'path'"):
        open_backend("disk", None, None)


def test_salt_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHMEM_VLLM_SALT", "s3cret")
    assert Options.parse({}, 16).salt == "s3cret"
    assert Options.parse({"salt": "given"}, 16).salt == "given"


def test_kv_transfer_config_selects_the_connector() -> None:
    cfg = kv_transfer_config(store="disk", path="/x")
    assert cfg["kv_connector"] == "FlashmemConnector"
    assert cfg["kv_connector_module_path"] == "flashmem.integrations.vllm.connector"
    assert cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector_extra_config"] == {"store": "disk", "path": "/x"}


def test_keys_name_the_prefix_model_and_tenant(tmp_path: Path) -> None:
    e = Engine("disk", str(tmp_path))
    a, b = prompt(100), prompt(100, seed=1)
    ka = e.planner.keys(a, "")
    assert len(ka) == 100 // CHUNK
    assert e.planner.keys(a[:64] + b[64:], "")[:2] == ka[:2]  # a shared prefix shares its chunks' keys
    assert e.planner.keys(a[:64] + b[64:], "")[2] != ka[2]
    assert set(e.planner.keys(a, request_salt("", "tenant-b", None, []))).isdisjoint(ka)
    assert set(e.planner.keys(a, request_salt("", None, "lora-1", []))).isdisjoint(ka)
    assert set(e.planner.keys(a, request_salt("", None, None, ["img0"]))).isdisjoint(ka)
    other = fingerprint("tiny", {"block_size": BS, "layers": ",".join(LAYERS), "dtype": "bf16"})
    assert other != FP


# ------------------------------------------------------------------------- round trips
def test_second_engine_loads_what_the_first_computed(tmp_path: Path, kind: str) -> None:
    tokens = prompt(5 * CHUNK + 7)
    a = Engine(kind, str(tmp_path / "s"))
    ext, errors = a.serve("r1", tokens, list(range(0, 12)), steps=(2 * CHUNK + 9,))  # chunked prefill
    assert ext == 0 and not errors
    assert a.worker.counters["saved_chunks"] == 5  # every full chunk of the prompt, none twice

    b = Engine(kind, str(tmp_path / "s"))  # another process: new store objects, other blocks
    blocks = list(range(30, 42))
    ext, errors = b.serve("r2", tokens, blocks)
    assert ext == 5 * CHUNK and not errors
    assert b.worker.counters["loaded_chunks"] == 5
    assert_holds(b.kv, tokens, blocks, 0, len(tokens))
    assert b.worker.counters["saved_chunks"] == 0  # nothing new to store


def test_last_token_is_always_computed(tmp_path: Path, kind: str) -> None:
    tokens = prompt(4 * CHUNK)  # a prompt of whole chunks: the last chunk is never loaded
    Engine(kind, str(tmp_path / "s")).serve("r1", tokens, list(range(8)))
    b = Engine(kind, str(tmp_path / "s"))
    assert b.planner.lookup("r2", tokens, "", 0) == 3 * CHUNK


def test_local_prefix_hit_is_not_overwritten(tmp_path: Path, kind: str) -> None:
    tokens = prompt(5 * CHUNK + 1)
    Engine(kind, str(tmp_path / "s")).serve("r1", tokens, list(range(11)))
    b = Engine(kind, str(tmp_path / "s"))
    blocks = list(range(20, 31))
    sentinel = b.kv[LAYERS[0]][blocks[0]].clone().fill_(-7.0)
    for name in LAYERS:
        b.kv[name][blocks[0]] = -7.0  # vLLM's own cached block 0 (one block computed locally)
    ext, _ = b.serve("r2", tokens, blocks, local=BS)
    assert ext == 5 * CHUNK - BS
    torch.testing.assert_close(b.kv[LAYERS[0]][blocks[0]], sentinel)  # the load skipped it
    assert_holds(b.kv, tokens, blocks, BS, 5 * CHUNK)


def test_another_tenant_finds_nothing(tmp_path: Path, kind: str) -> None:
    tokens = prompt(3 * CHUNK + 5)
    Engine(kind, str(tmp_path / "s")).serve("r1", tokens, list(range(7)), salt=request_salt("", "tenant-a", None, []))
    b = Engine(kind, str(tmp_path / "s"))
    assert b.planner.lookup("r2", tokens, request_salt("", "tenant-b", None, []), 0) == 0
    assert b.planner.lookup("r3", tokens, request_salt("", "tenant-a", None, []), 0) == 3 * CHUNK


def test_damaged_record_costs_reuse_from_it_on(tmp_path: Path, kind: str) -> None:
    tokens = prompt(5 * CHUNK + 3)
    a = Engine(kind, str(tmp_path / "s"))
    a.serve("r1", tokens, list(range(11)))
    keys = a.planner.keys(tokens, "")
    b = Engine(kind, str(tmp_path / "s"))
    _flip(kind, tmp_path / "s", b.sched_store, keys[2])
    blocks = list(range(40, 51))
    ext, errors = b.serve("r2", tokens, blocks)
    assert ext == 2 * CHUNK and not errors  # chunks 0-1 loaded, 2.. computed
    assert b.sched_store.damaged == 1
    assert_holds(b.kv, tokens, blocks, 0, len(tokens))
    assert b.worker.counters["saved_chunks"] == 3  # the damaged record is written again, checked
    c = Engine(kind, str(tmp_path / "s"))
    assert c.planner.lookup("r3", tokens, "", 0) == 5 * CHUNK


def test_damage_found_by_the_worker_marks_blocks_invalid(tmp_path: Path, kind: str) -> None:
    """Without `verify` (or damage between lookup and load) the worker finds it: the blocks of
    the damaged chunk and every later one are reported to vLLM, which recomputes them."""
    tokens = prompt(5 * CHUNK + 3)
    a = Engine(kind, str(tmp_path / "s"))
    a.serve("r1", tokens, list(range(11)))
    keys = a.planner.keys(tokens, "")
    b = Engine(kind, str(tmp_path / "s"), verify=False)
    _flip(kind, tmp_path / "s", b.work_store, keys[3])
    blocks = list(range(40, 51))
    ext = b.planner.lookup("r2", tokens, "", 0)
    assert ext == 5 * CHUNK  # not read at lookup
    b.planner.allocated("r2", tokens, "", ext)
    plan = b.planner.build([("r2", blocks, ext)], [], {"r2": len(tokens) - ext})
    b.worker.load(plan.loads)
    assert b.worker.take_errors() == set(blocks[3 * 2 : 5 * 2])  # chunks 3 and 4, two blocks each
    assert b.worker.take_errors() == set()  # reported once
    assert_holds(b.kv, tokens, blocks, 0, 3 * CHUNK)
    assert b.work_store.damaged == 1


def test_vanished_store_costs_reuse_not_the_request(tmp_path: Path) -> None:
    tokens = prompt(3 * CHUNK + 3)
    a = Engine("disk", str(tmp_path / "s"), verify=False)
    a.serve("r1", tokens, list(range(7)))
    b = Engine("disk", str(tmp_path / "s"), verify=False)
    ext = b.planner.lookup("r2", tokens, "", 0)
    shutil.rmtree(tmp_path / "s")  # evicted by another process meanwhile
    b.planner.allocated("r2", tokens, "", ext)
    blocks = list(range(7))
    plan = b.planner.build([("r2", blocks, ext)], [], {"r2": 3})
    b.worker.load(plan.loads)
    assert b.worker.take_errors() == set(blocks[:6])
    # and a save that cannot be written is counted, never raised
    for name in LAYERS:
        b.worker.stage(name, b.kv[name], plan.saves)
    b.worker.flush(plan.saves)


def test_quota_evicts_least_recently_used(tmp_path: Path, kind: str) -> None:
    a = Engine(kind, str(tmp_path / "s"))
    first = prompt(3 * CHUNK + 1, seed=10)
    a.serve("r1", first, list(range(7)))
    one = a.work_store.nbytes() // 3
    quota = int(one * 4.5)
    a = Engine(kind, str(tmp_path / "s"), quota_bytes=quota)
    second = prompt(3 * CHUNK + 1, seed=11)
    a.serve("r2", second, list(range(10, 17)))
    assert a.work_store.nbytes() <= quota
    assert a.work_store.evictions >= 2
    b = Engine(kind, str(tmp_path / "s"))
    assert b.planner.lookup("x", second, "", 0) == 3 * CHUNK  # the recent document stays
    assert b.planner.lookup("y", first, "", 0) < 3 * CHUNK  # the older one lost its tail first


def test_records_are_private(tmp_path: Path, kind: str) -> None:
    old = os.umask(0o022)
    try:
        Engine(kind, str(tmp_path / "s")).serve("r1", prompt(2 * CHUNK + 1), list(range(5)))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    files = [p for p in (tmp_path / "s").iterdir() if p.is_file()]
    assert files
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f.name


def test_folder_store_sees_other_processes_records(tmp_path: Path) -> None:
    reader = SharedFolderStore(tmp_path / "s")  # opened before anything was written
    writer = SharedFolderStore(tmp_path / "s")
    writer.save("k1", "", {"x": torch.ones(3)})
    writer.save("k2", "k1", {"x": torch.ones(3)})
    assert reader.longest(["k1", "k2", "k3"]) == 2
    assert len(reader.load(["k1", "k2"])) == 2


# -------------------------------------------------------------------- Valkey / Redis
SERVER = shutil.which("valkey-server") or shutil.which("redis-server")


@pytest.fixture
def redis_url() -> Iterator[str]:
    pytest.importorskip("redis")
    if SERVER is None:
        pytest.skip("neither valkey-server nor redis-server is installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("redis-server did not start")
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_redis_store_round_trip_and_outage(redis_url: str) -> None:
    tokens = prompt(4 * CHUNK + 2)
    a = Engine(redis_url, "")
    a.serve("r1", tokens, list(range(9)))
    b = Engine(redis_url, "")
    blocks = list(range(20, 29))
    ext, errors = b.serve("r2", tokens, blocks)
    assert ext == 4 * CHUNK and not errors
    assert_holds(b.kv, tokens, blocks, 0, len(tokens))


def test_unreachable_redis_serves_without_reuse() -> None:
    pytest.importorskip("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    e = Engine(f"redis://127.0.0.1:{port}/0", "")
    tokens = prompt(2 * CHUNK + 1)
    ext, errors = e.serve("r1", tokens, list(range(5)))
    assert ext == 0 and not errors
    assert e.sched_store.unreachable >= 1


# ------------------------------------------------------------------ vLLM's interface
def test_connector_implements_vllms_interface() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md)")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    from flashmem.integrations.vllm.connector import FlashmemConnector, FlashmemConnectorMetadata

    assert issubclass(FlashmemConnector, KVConnectorBase_V1)
    assert issubclass(FlashmemConnectorMetadata, KVConnectorMetadata)
    assert not FlashmemConnector.__abstractmethods__  # every abstract method is implemented
    for name in (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_block_ids_with_load_errors",
        "request_finished",
    ):
        assert getattr(FlashmemConnector, name) is not getattr(KVConnectorBase_V1, name), name


def test_preempted_request_saves_into_its_new_blocks(tmp_path: Path) -> None:
    """A request preempted mid-prefill resumes with new blocks (vLLM sends the whole list) and
    recomputes from 0: the chunks saved before are not saved twice, the rest come from the new blocks."""
    tokens = prompt(4 * CHUNK + 5)
    e = Engine("disk", str(tmp_path / "s"))
    ext = e.planner.lookup("r", tokens, "", 0)
    e.planner.allocated("r", tokens, "", ext)
    old = list(range(9))
    plan = e.planner.build([("r", old, 0)], [], {"r": CHUNK + 3})
    forward(e.kv, tokens, old, 0, CHUNK + 3)
    for name in LAYERS:
        e.worker.stage(name, e.kv[name], plan.saves)
    e.worker.flush(plan.saves)
    assert e.worker.counters["saved_chunks"] == 1
    new = list(range(30, 39))  # preempted; resumed in other blocks, recomputed from token 0
    plan = e.planner.build([], [("r", new, True, 0)], {"r": len(tokens)})
    assert [j for s in plan.saves for j, _, _ in s.chunks] == [1, 2, 3]
    assert plan.saves[0].block_ids == new
    forward(e.kv, tokens, new, 0, len(tokens))
    for name in LAYERS:
        e.worker.stage(name, e.kv[name], plan.saves)
    e.worker.flush(plan.saves)
    b = Engine("disk", str(tmp_path / "s"))
    blocks = list(range(50, 59))
    ext, errors = b.serve("r2", tokens, blocks)
    assert ext == 4 * CHUNK and not errors
    assert_holds(b.kv, tokens, blocks, 0, len(tokens))


def test_plan_survives_pickling(tmp_path: Path) -> None:
    """vLLM sends the step's metadata to its worker processes."""
    import pickle

    tokens = prompt(3 * CHUNK + 1)
    Engine("disk", str(tmp_path / "s")).serve("r1", tokens, list(range(7)))
    b = Engine("disk", str(tmp_path / "s"))
    ext = b.planner.lookup("r2", tokens, "", 0)
    b.planner.allocated("r2", tokens, "", ext)
    plan = b.planner.build([("r2", list(range(7)), ext)], [], {"r2": 1})
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again.loads["r2"].keys == plan.loads["r2"].keys
