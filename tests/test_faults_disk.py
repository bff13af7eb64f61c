"""Fault and abuse suite, on-disk cold tiers (issue 11 items 2-7).

Every test runs on each on-disk backend through `persisted`/`open_new`/`reopen`,
so the same promises hold whichever store `cold_store` names.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import warnings

import pytest
import torch

from flashmem.errors import ChecksumError, ColdStoreError
from flashmem.store import DiskStore
from flashmem.store.format import COMMIT_SIZE
from flashmem.store.lmdb_store import LmdbStore

SHAPE = (1, 2, 16, 8)


def block(layer: int, idx: int):
    g = torch.Generator().manual_seed(layer * 1000 + idx)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


BACKENDS = {"disk": DiskStore, "lmdb": LmdbStore}


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
@pytest.mark.parametrize("name", ["commit.log", "meta.json", "meta.json.tmp", "lock", "data.mdb", "lock.mdb"])
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


def test_one_writer_per_folder_across_processes(backend, tmp_path):
    """A live store in another process makes a reopen here a one-line refusal; once that
    process is killed (no clean close), the kernel drops its lock and the reopen works."""
    import subprocess
    import sys

    path = persisted(backend, tmp_path, 3)
    name = next(k for k, v in BACKENDS.items() if v is backend)
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys, time; sys.path[:0] = [{here!r}, {os.path.join(here, '..', 'src')!r}]\n"
        f"from test_faults_disk import BACKENDS\ns = BACKENDS[{name!r}].reopen({path!r})\n"
        "print('OPEN', flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "OPEN"
        with pytest.raises(ColdStoreError) as err:
            backend.reopen(path)
        assert "already open" in one_line(err.value)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()
    with backend.reopen(path, persist=False) as r:
        assert sorted(r.keys()) == [(0, i) for i in range(3)]


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


# ------------------------------------------------------------------ random damage
FUZZ = """
import os, random, shutil, sys, warnings
sys.path[:0] = [{tests!r}, {src!r}]
import torch
from test_faults_disk import block, BACKENDS
from flashmem.errors import ChecksumError, ColdStoreError
warnings.simplefilter("ignore")
cls = BACKENDS[{name!r}]
for seed in range(6):
    dst = {path!r} + "-" + str(seed)
    shutil.copytree({path!r}, dst)
    rng = random.Random(seed)
    files = [os.path.join(dst, n) for n in sorted(os.listdir(dst)) if n.endswith((".dat", ".log", ".mdb")) and n != "lock.mdb"]
    for _ in range({flips}):
        f = rng.choice(files)
        raw = bytearray(open(f, "rb").read())
        i = rng.randrange(len(raw)); raw[i] ^= 1 << rng.randrange(8)
        open(f, "wb").write(raw)
    try:
        r = cls.reopen(dst, persist=False)
    except ColdStoreError as e:
        assert "\\n" not in str(e); print("refused", seed); shutil.rmtree(dst); continue
    good = bad = 0
    for key in r.keys():
        try:
            k, v = r.get(key)
        except ChecksumError:
            bad += 1
            continue
        assert torch.equal(k, block(*key)[0]) and torch.equal(v, block(*key)[1]), key
        good += 1
    r.close()
    print("ok", seed, good, bad)
"""


@pytest.mark.parametrize("flips", [12, 200])
def test_random_bit_flips_never_return_wrong_data(backend, tmp_path, flips):
    """Whatever bytes are damaged: a block comes back bit-exact, or a ChecksumError, or
    the folder is refused in one line; never wrong data, a traceback or a crash (LMDB
    included: issue 30 saw 200 flips kill its reader with SIGBUS)."""
    import subprocess
    import sys

    path = persisted(backend, tmp_path, 60)
    name = next(k for k, v in BACKENDS.items() if v is backend)
    here = os.path.dirname(os.path.abspath(__file__))
    code = FUZZ.format(tests=here, src=os.path.join(here, "..", "src"), name=name, path=path, flips=flips)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.returncode, p.stdout[-500:], p.stderr[-2000:])
    assert len(p.stdout.splitlines()) == 6


def _end_inside_the_last_value(path: str) -> None:
    """Cut data.mdb inside its one value's overflow pages and make both meta pages agree
    with the new length (LMDB has no checksums): the open-time checks pass, the value's
    header page is in the file, and copying the value reads past the end of the file."""
    import struct

    data = os.path.join(path, "data.mdb")
    raw = bytearray(open(data, "rb").read())
    psize = struct.unpack_from("<I", raw, 40)[0]  # MDB_meta: mm_dbs[FREE_DBI].md_pad is the page size
    first = raw.find(b"FMB1") // psize  # the record header's page (flashmem.store.format.RECORD_MAGIC)
    assert first > 1 and len(raw) > (first + 2) * psize
    for meta in (0, 1):
        struct.pack_into("<Q", raw, meta * psize + 136, first)  # MDB_meta.mm_last_pg
    open(data, "wb").write(raw[: (first + 1) * psize])


def test_lmdb_read_that_would_fault_is_refused_in_one_line(tmp_path):
    """Issue 30: LMDB maps its file, and a damaged page can send a read past its end,
    which kills the reader with SIGBUS (the previous main did, on this very file).
    Reopen makes every read first in a child process and refuses the file in one line."""
    import subprocess
    import sys

    with LmdbStore(str(tmp_path), persist=True) as s:
        g = torch.Generator().manual_seed(0)
        s.put((0, 0), torch.randn(1, 2, 64, 64, generator=g), torch.randn(1, 2, 64, 64, generator=g))
        path = s.path
    _end_inside_the_last_value(path)
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {os.path.join(here, '..', 'src')!r})\n"
        "from flashmem.store.lmdb_store import LmdbStore\nfrom flashmem.errors import ColdStoreError\n"
        f"try:\n    r = LmdbStore.reopen({path!r}); [r.get(k) for k in r.keys()]; print('READ')\n"
        "except ColdStoreError as e:\n    print('ERR', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.returncode, p.stderr[-500:])
    msg = p.stdout.strip()
    assert msg.startswith("ERR ") and "\n" not in msg and "SIGBUS" in msg and "data.mdb" in msg, msg


# ------------------------------------------------------------------ crashes and write errors
CHILD = """
import sys, torch
sys.path[:0] = [{tests!r}, {src!r}]
from test_faults_disk import block, BACKENDS
s = BACKENDS[{name!r}]({root!r}, persist=True)
print("PATH", s.path, flush=True)
i = 0
while True:
    s.put((0, i), *block(0, i))
    i += 1
    if i % 4 == 0:
        s.flush()
        print("DURABLE", i, flush=True)
"""


def test_kill_9_mid_write_keeps_every_flushed_block(backend, tmp_path):
    """A writer killed mid-write: every block flushed before is back, bit-exact."""
    import subprocess
    import sys

    name = next(k for k, v in BACKENDS.items() if v is backend)
    here = os.path.dirname(os.path.abspath(__file__))
    code = CHILD.format(tests=here, src=os.path.join(here, "..", "src"), name=name, root=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        path = proc.stdout.readline().split()[1]
        durable = 0
        while durable < 40:
            line = proc.stdout.readline()
            assert line, "writer exited early"
            durable = int(line.split()[1])
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()
    with backend.reopen(path, persist=False, verify=True) as r:
        keys = set(r.keys())
        assert {(0, i) for i in range(durable)} <= keys
        for key in keys:
            k, v = r.get(key)
            assert torch.equal(k, block(*key)[0]) and torch.equal(v, block(*key)[1])


def _store_that_fills_up(backend, tmp_path, monkeypatch):
    """A store whose writes fail: every disk write raises ENOSPC; an LMDB map of 256 KiB fills up."""
    if backend is DiskStore:
        import flashmem.store.disk_core as dc

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(dc, "pwrite_all", full)
        return backend(str(tmp_path))
    return backend(str(tmp_path), map_size=256 * 1024)


def test_background_write_error_is_raised_once_and_loses_nothing(backend, tmp_path, monkeypatch):
    """After a write error every block stays readable; the error is one line, raised once."""
    with _store_that_fills_up(backend, tmp_path, monkeypatch) as s:
        raised = []
        for i in range(200):
            try:
                s.put((0, i), *block(0, i))
            except ColdStoreError as exc:
                raised.append(one_line(exc))
            # the writer is asynchronous: wait for it, so the put after the failing
            # commit is the one that reports (without this the writer may fail only
            # after the last put on a loaded machine, and no put sees it)
            s._core.wait_durable()
        assert len(raised) == 1 and ("ENOSPC" in raised[0] or "MapFull" in raised[0])
        for i in range(200):
            assert torch.equal(s.get((0, i))[0], block(0, i)[0])


def test_write_error_after_the_last_put_is_raised_by_flush(backend, tmp_path, monkeypatch):
    """A commit that fails after every put returned is not lost: flush raises it, blocks stay readable."""
    with _store_that_fills_up(backend, tmp_path, monkeypatch) as s:
        n = 200
        raised = 0
        for i in range(n):  # no waiting: the writer may fail during or after these
            try:
                s.put((0, i), *block(0, i))
            except ColdStoreError:
                raised += 1
        with pytest.raises(ColdStoreError, match="ENOSPC|MapFull"):
            s.flush()
        assert raised <= 1
        for i in range(n):
            assert torch.equal(s.get((0, i))[1], block(0, i)[1])


def test_truncated_lmdb_file_is_one_line_not_a_crash(tmp_path):
    """LMDB maps its file: a truncated data.mdb would fault (SIGBUS) on read; refused on open."""
    import subprocess
    import sys

    path = persisted(LmdbStore, tmp_path, 20)
    data = os.path.join(path, "data.mdb")
    os.truncate(data, os.path.getsize(data) // 2)
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {os.path.join(here, '..', 'src')!r})\n"
        "from flashmem.store.lmdb_store import LmdbStore\nfrom flashmem.errors import ColdStoreError\n"
        f"try:\n    r = LmdbStore.reopen({path!r}); [r.get(k) for k in r.keys()]\n"
        "except ColdStoreError as e:\n    print('ERR', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("ERR ") and "truncated" in p.stdout, (
        p.returncode,
        p.stderr[-500:],
    )


@pytest.mark.parametrize("damage", ["emptied", "missing", "inside the meta pages"])
def test_emptied_or_missing_lmdb_file_is_refused_and_left_as_found(tmp_path, damage):
    """Issue 30: data.mdb is an LMDB store's whole content. Emptied (truncated to 0) or
    deleted, LMDB would start a fresh environment in its place and the store would
    reopen empty (`dropped: 0`), every block gone without a word: refused in one line
    instead, and the file is not rewritten."""
    path = persisted(LmdbStore, tmp_path, 20)
    data = os.path.join(path, "data.mdb")
    if damage == "missing":
        os.unlink(data)
    else:
        os.truncate(data, 0 if damage == "emptied" else 100)
    with pytest.raises(ColdStoreError) as err:
        LmdbStore.reopen(path, persist=True)
    msg = one_line(err.value)
    assert path in msg and "data.mdb" in msg and "allowed:" in msg
    if damage == "missing":
        assert not os.path.exists(data)
    else:
        assert os.path.getsize(data) == (0 if damage == "emptied" else 100)
    with pytest.raises(ColdStoreError):  # still refused: nothing was initialised by the first try
        LmdbStore.reopen(path, persist=True)


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
