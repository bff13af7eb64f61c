"""Fault and abuse suite, on-disk cold tiers (issue 11 items 2-7).

Every test runs on each on-disk backend through `persisted`/`open_new`/`reopen`,
so the same promises hold whichever store `cold_store` names.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import warnings

import pytest
import torch

from flashmem.errors import ChecksumError, ColdStoreError
from flashmem.store import DiskStore
from flashmem.store.format import COMMIT_SIZE

SHAPE = (1, 2, 16, 8)


def block(layer: int, idx: int):
    g = torch.Generator().manual_seed(layer * 1000 + idx)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


BACKENDS = {"disk": DiskStore}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]


def persisted(cls, root, n: int) -> str:
    with cls(str(root), persist=True) as s:
        for i in range(n):
            s.put((0, i), *block(0, i))
        return s.path


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------ 2. private files
@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_folders_0700_files_0600_whatever_the_umask(backend, tmp_path, umask):
    """Issue 11 item 2: no other local user can read the KV blocks (they encode prompts)."""
    old = os.umask(umask)
    try:
        root = tmp_path / "new" / "cold"
        with backend(str(root), persist=True) as s:
            for i in range(4):
                s.put((0, i), *block(0, i))
            s.flush()
            path = s.path
            names = os.listdir(path)
            assert len(names) >= 3
            assert mode(path) == 0o700 and mode(root) == 0o700 and mode(tmp_path / "new") == 0o700
            for name in names:
                assert mode(os.path.join(path, name)) == 0o600, name
        with backend.reopen(path, persist=False) as r:  # reopen keeps it so
            r.put((0, 9), *block(0, 9))
            r.flush()
            assert all(mode(os.path.join(path, n)) == 0o600 for n in os.listdir(path))
    finally:
        os.umask(old)


def test_reopen_tightens_an_older_world_readable_folder(backend, tmp_path):
    path = persisted(backend, tmp_path, 2)
    os.chmod(path, 0o755)
    for n in os.listdir(path):
        os.chmod(os.path.join(path, n), 0o644)
    with backend.reopen(path, persist=False):
        assert mode(path) == 0o700 and all(mode(os.path.join(path, n)) == 0o600 for n in os.listdir(path))


# ------------------------------------------------------------------ 3. links and owners
@pytest.mark.parametrize("name", ["commit.log", "meta.json", "meta.json.tmp", "lock"])
def test_planted_symlink_never_redirects_a_write(backend, tmp_path, name):
    """Issue 11 item 3: a link planted in the folder neither truncates nor overwrites its target."""
    path = persisted(backend, tmp_path, 3)
    if not os.path.exists(os.path.join(path, name)) and name != "meta.json.tmp":
        pytest.skip(f"{name} is not a file of this backend")
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious " * 100)
    target = os.path.join(path, name)
    if os.path.exists(target):
        os.unlink(target)
    os.symlink(victim, target)
    try:
        with backend.reopen(path, persist=True) as r:
            r.put((0, 7), *block(0, 7))
    except ColdStoreError as exc:
        one_line(exc)
    assert victim.read_bytes() == b"precious " * 100


def test_symlinked_store_folder_is_refused(backend, tmp_path):
    path = persisted(backend, tmp_path, 1)
    link = tmp_path / "link"
    os.symlink(path, link)
    with pytest.raises(ColdStoreError, match="symbolic link"):
        backend.reopen(str(link))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_folder_owned_by_someone_else_is_refused(backend, tmp_path):
    path = persisted(backend, tmp_path, 1)
    os.chown(path, 12345, 12345)
    with pytest.raises(ColdStoreError) as err:
        backend.reopen(path)
    assert "owned by uid 12345" in one_line(err.value)


# ------------------------------------------------------------------ 4. one writer per folder
def test_one_writer_per_folder_also_in_process(backend, tmp_path):
    """Issue 11 item 4: a second opener of a live folder is refused, so no block can vanish."""
    with backend(str(tmp_path), persist=True) as live:
        for i in range(30):
            live.put((0, i), *block(0, i))
        with pytest.raises(ColdStoreError) as err:
            backend.reopen(live.path)
        assert "already open" in one_line(err.value)
        path = live.path
    with backend.reopen(path, persist=False) as r:  # released by close: every block is there
        assert sorted(r.keys()) == [(0, i) for i in range(30)]
        with pytest.raises(ColdStoreError, match="already open"):
            backend.reopen(path)


# ------------------------------------------------------------------ 7. metadata
@pytest.mark.parametrize(
    "field,value,allowed",
    [("dtype", "complex32", "float32"), ("codec", "zstd", "int8"), ("format", 99, "allowed"), ("dtype", 5, "bfloat16")],
)
def test_damaged_meta_is_refused_not_rewritten(backend, tmp_path, field, value, allowed):
    """Issue 11 item 7: meta.json decides how payloads decode; a bad field is a one-line error."""
    path = persisted(backend, tmp_path, 1)
    meta_path = os.path.join(path, "meta.json")
    meta = json.loads(open(meta_path).read())
    meta[field] = value
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    before = open(meta_path).read()
    with pytest.raises(ColdStoreError) as err:
        backend.reopen(path)
    msg = one_line(err.value)
    assert "meta.json" in msg and field in msg and repr(value) in msg and allowed in msg
    assert open(meta_path).read() == before
    with pytest.raises(ColdStoreError):  # and the lock was released: the error repeats, no "already open"
        backend.reopen(path)


@pytest.mark.parametrize("content", [b"", b"\xff\xfe", b"[1, 2]", b"{" * 100000])
def test_garbage_meta_is_one_line(backend, tmp_path, content):
    path = persisted(backend, tmp_path, 1)
    with open(os.path.join(path, "meta.json"), "wb") as f:
        f.write(content)
    with pytest.raises(ColdStoreError) as err:
        backend.reopen(path)
    assert "meta.json" in one_line(err.value)


# ------------------------------------------------------------------ 6. cleanup that says what it left
def test_close_reports_what_it_could_not_remove(backend, tmp_path, monkeypatch):
    """Issue 11 item 6: a folder that cannot be removed is reported, never silently left."""
    s = backend(str(tmp_path))
    s.put((0, 0), *block(0, 0))
    s.flush()
    path = s.path
    real = os.unlink

    def deny(p, *a, **kw):
        if "dir_fd" in kw or str(p).startswith(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return real(p, *a, **kw)

    monkeypatch.setattr(os, "unlink", deny)
    with pytest.raises(ColdStoreError) as err:
        s.close()
    monkeypatch.undo()
    msg = one_line(err.value)
    assert path in msg and "Permission denied" in msg and "remove it by hand" in msg
    assert os.path.isdir(path)
    s.close()  # reported once; a second close is quiet


# ------------------------------------------------------------------ corruption is named
def test_flipped_payload_bit_is_a_checksum_error(backend, tmp_path):
    path = persisted(backend, tmp_path, 5)
    want = block(0, 3)
    data = sorted(
        (os.path.join(path, n) for n in os.listdir(path) if n.endswith((".dat", ".mdb"))), key=os.path.getsize
    )
    victim = data[-1]
    raw = bytearray(open(victim, "rb").read())
    needle = want[0].numpy().tobytes()[:32]
    at = bytes(raw).find(needle)
    assert at >= 0
    raw[at + 5] ^= 0x10
    open(victim, "wb").write(raw)
    with backend.reopen(path, persist=False) as r:
        with pytest.raises(ChecksumError) as err:
            r.get((0, 3))
        assert "(layer 0, block 3)" in one_line(err.value)
        assert torch.equal(r.get((0, 4))[0], block(0, 4)[0])


# ------------------------------------------------------------------ 5. commit log (DiskStore's own format)
def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))


def test_damaged_commit_entry_in_the_middle_is_reported_and_nothing_is_dropped(tmp_path):
    """Issue 11 item 5: entry 5 of 40 damaged -> one line naming file and offset; the
    intact entries (and the damaged one's record, verified from the segment) are kept;
    the log is not truncated."""
    path = persisted(DiskStore, tmp_path, 40)
    log = os.path.join(path, "commit.log")
    size = os.path.getsize(log)
    flip(log, 5 * COMMIT_SIZE + 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = DiskStore.reopen(path, persist=True)
    with r:
        assert sorted(r.keys()) == [(0, i) for i in range(40)]
        assert all(torch.equal(r.get((0, i))[0], block(0, i)[0]) for i in range(40))
        assert r.recovered["corrupt_log_entries"] == 1 and r.recovered["torn_log_bytes"] == 0
        msg = one_line(r.problems[0])
        assert log in msg and f"offset {5 * COMMIT_SIZE}" in msg
        assert any(str(w.message) == msg for w in caught)
        r.put((0, 40), *block(0, 40))
    assert os.path.getsize(log) == size + COMMIT_SIZE  # appended, never cut
    with DiskStore.reopen(path, persist=False) as again:  # still reported, still all kept
        assert len(again) == 41 and again.recovered["corrupt_log_entries"] == 1


def test_damaged_entry_and_record_loses_only_that_block(tmp_path):
    path = persisted(DiskStore, tmp_path, 10)
    log = os.path.join(path, "commit.log")
    flip(log, 3 * COMMIT_SIZE + 20)
    rec = os.path.getsize(os.path.join(path, "seg-000000.dat")) // 10
    flip(os.path.join(path, "seg-000000.dat"), 3 * rec + 70)  # its record's payload too
    with pytest.warns(Warning, match="blocks are lost"):
        r = DiskStore.reopen(path, persist=False)
    with r:
        assert sorted(r.keys()) == [(0, i) for i in range(10) if i != 3]


def test_torn_tail_is_still_cut(tmp_path):
    path = persisted(DiskStore, tmp_path, 6)
    log = os.path.join(path, "commit.log")
    flip(log, 5 * COMMIT_SIZE + 20)  # the last entry: indistinguishable from a torn write
    with open(log, "ab") as f:
        f.write(b"\x00" * 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn tail is not corruption: no warning
        r = DiskStore.reopen(path, persist=False)
    with r:
        assert sorted(r.keys()) == [(0, i) for i in range(5)]
        assert r.recovered["torn_log_bytes"] == COMMIT_SIZE + 10 and r.problems == []
