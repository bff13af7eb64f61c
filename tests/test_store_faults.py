"""Cold-tier faults: damaged bytes, torn files, killed writers, unusable cold_dir,
full disk, concurrent stores, codec bounds. Nothing wrong is ever returned."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from flashmem.errors import ChecksumError, ColdStoreError
from flashmem.sizing.tiers import codec_bytes_per_element
from flashmem.store import DiskStore
from flashmem.store.codecs import get_codec
from flashmem.store.format import COMMIT_SIZE, HEADER_SIZE

SHAPE = (1, 2, 64, 32)


def block(layer: int, idx: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 7919 + layer * 100003 + idx)
    return torch.randn(SHAPE, generator=g).to(dtype), torch.randn(SHAPE, generator=g).to(dtype)


def same(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def record_len(codec="exact", dtype=torch.float32) -> int:
    return HEADER_SIZE + get_codec(codec).nbytes(SHAPE, dtype)


def persisted(tmp_path, n: int, codec="exact") -> str:
    with DiskStore(str(tmp_path), persist=True, codec=codec) as s:
        for i in range(n):
            s.put((0, i), *block(0, i))
        return s.path


def test_changed_bytes_raise_checksum_error_naming_file_and_key(tmp_path):
    with DiskStore(str(tmp_path)) as s:
        for i in range(5):
            s.put((2, i), *block(2, i))
        s.flush()
        seg = os.path.join(s.path, "seg-000000.dat")
        with open(seg, "r+b") as f:  # one byte inside block 3's payload
            f.seek(3 * record_len() + HEADER_SIZE + 1000)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x01]))
        with pytest.raises(ChecksumError) as err:
            s.get((2, 3))
        msg = str(err.value)
        assert seg in msg and "(layer 2, block 3)" in msg and "\n" not in msg
        with open(seg, "r+b") as f:  # a damaged header is caught too
            f.seek(1 * record_len() + 20)
            f.write(b"\xff")
        with pytest.raises(ChecksumError, match=r"block 1\)"):
            s.get((2, 1))
        assert same(s.get((2, 4))[0], block(2, 4)[0])  # the others are fine


def test_truncated_segment_keeps_every_complete_committed_record(tmp_path):
    path = persisted(tmp_path, 10)
    seg = os.path.join(path, "seg-000000.dat")
    os.truncate(seg, 7 * record_len() + HEADER_SIZE + 100)  # block 7 torn, 8 and 9 gone
    log = os.path.join(path, "commit.log")
    os.truncate(log, os.path.getsize(log) - COMMIT_SIZE // 2)  # torn commit entry too
    with DiskStore.reopen(path, persist=False) as r:
        assert sorted(r.keys()) == [(0, i) for i in range(7)]
        assert r.recovered["torn_log_bytes"] == COMMIT_SIZE // 2
        for i in range(7):
            k, v = r.get((0, i))
            assert same(k, block(0, i)[0]) and same(v, block(0, i)[1])
        r.put((0, 7), *block(0, 7))  # appending after recovery works
        r.flush()
        assert same(r.get((0, 7))[1], block(0, 7)[1])


def test_garbled_commit_tail_is_ignored(tmp_path):
    path = persisted(tmp_path, 6)
    log = os.path.join(path, "commit.log")
    with open(log, "r+b") as f:
        f.seek(5 * COMMIT_SIZE + 30)
        f.write(b"\x00\x01\x02")
    with DiskStore.reopen(path, persist=False, verify=True) as r:
        assert sorted(r.keys()) == [(0, i) for i in range(5)]


CHILD = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_store_faults import block
    from flashmem.store import DiskStore
    s = DiskStore({root!r}, persist=True, codec={codec!r})
    print("PATH", s.path, flush=True)
    i = 0
    while True:
        s.put((0, i), *block(0, i))
        i += 1
        if i % 4 == 0:
            s.flush()
            print("DURABLE", i, flush=True)
    """
)


@pytest.mark.parametrize("codec", ["exact", "int4"])
def test_sigkill_mid_write_then_reopen(tmp_path, codec):
    code = CHILD.format(tests=os.path.dirname(__file__), root=str(tmp_path), codec=codec)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)  # never hang the suite on a stuck child
    watchdog.start()
    try:
        path = proc.stdout.readline().split()[1]
        durable = 0
        while durable < 40:
            line = proc.stdout.readline()
            assert line, "writer exited early"
            durable = int(line.split()[1])
        os.kill(proc.pid, signal.SIGKILL)  # while it keeps writing
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()
    with DiskStore.reopen(path, persist=False, verify=True) as r:
        keys = r.keys()
        assert {(0, i) for i in range(durable)} <= set(keys)  # every flushed block survived
        c = get_codec(codec)
        for key in keys:  # every kept block decodes bit-exactly
            want = c.decode(c.encode(*block(*key)), SHAPE, torch.float32)
            k, v = r.get(key)
            assert same(k, want[0]) and same(v, want[1])


def test_cold_dir_under_a_file_is_a_one_line_error(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ColdStoreError) as err:
        DiskStore(str(f / "sub"))
    msg = str(err.value)
    assert str(f / "sub") in msg and "Not a directory" in msg and "\n" not in msg


def test_missing_cold_dir_is_created(tmp_path):
    with DiskStore(str(tmp_path / "a" / "b")) as s:
        s.put((0, 0), *block(0, 0))
        assert same(s.get((0, 0))[0], block(0, 0)[0])
        assert os.path.dirname(s.path) == str(tmp_path / "a" / "b")


def test_cold_dir_not_writable(tmp_path, monkeypatch):
    real = os.mkdir

    def deny(path, *a, **kw):
        if str(path).startswith(str(tmp_path)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "mkdir", deny)
    with pytest.raises(ColdStoreError, match=r"Permission denied \(EACCES\)"):
        DiskStore(str(tmp_path))


def test_full_disk_surfaces_on_next_put_and_loses_nothing(tmp_path, monkeypatch):
    s = DiskStore(str(tmp_path))
    s.put((0, 0), *block(0, 0))
    s.flush()  # block 0 is on disk

    def enospc(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", enospc)
    s.put((0, 1), *block(0, 1))
    s._core.wait_durable()  # the background write has failed by now
    with pytest.raises(ColdStoreError) as err:
        s.put((0, 2), *block(0, 2))
    assert "ENOSPC" in str(err.value) and "\n" not in str(err.value)
    s.put((0, 3), *block(0, 3))  # raised once; later puts keep blocks in memory
    with pytest.raises(ColdStoreError, match="ENOSPC"):
        s.flush()  # flush cannot promise durability
    for i in range(4):
        k, v = s.get((0, i))
        assert same(k, block(0, i)[0]) and same(v, block(0, i)[1])
    assert s.pending_blocks() == 3
    s.close()


def test_two_stores_in_one_cold_dir_never_mix(tmp_path):
    errors: list[BaseException] = []
    paths: list[str] = []

    def work(seed: int) -> None:
        try:
            with DiskStore(str(tmp_path), name="cache", codec="exact") as s:
                paths.append(s.path)
                for i in range(30):
                    s.put((i % 3, i), *block(i % 3, i, seed))
                    if i % 7 == 0:
                        s.flush()
                s.flush()
                for i in range(30):
                    k, v = s.get((i % 3, i))
                    assert same(k, block(i % 3, i, seed)[0]) and same(v, block(i % 3, i, seed)[1])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert len(set(paths)) == 2
    assert os.listdir(tmp_path) == []  # both folders removed on close


@pytest.mark.parametrize("codec", ["exact", "int8", "int4"])
def test_codec_round_trip_bound_and_bytes(codec):
    k, v = block(0, 0, dtype=torch.float16)
    c = get_codec(codec)
    p = c.encode(k, v)
    assert p.numel() == codec_bytes_per_element(codec, 2) * 2 * k.numel()
    k2, v2 = c.decode(p, SHAPE, torch.float16)
    if codec == "exact":
        assert same(k2, k) and same(v2, v)
        return
    levels = 255 if codec == "int8" else 15
    for x, y, dim in ((k, k2, 2), (v, v2, 3)):  # keys per channel (token groups), values per token
        x, y = x.float(), y.float()
        g = x.unflatten(dim, (-1, 32))
        step = (g.amax(dim + 1, keepdim=True) - g.amin(dim + 1, keepdim=True)) / levels
        err = (x - y).abs().unflatten(dim, (-1, 32))
        # half a step, plus fp16 rounding of the decoded value
        assert (err <= step / 2 * (1 + 2**-9) + g.abs() * 2**-10 + 1e-6).all()
