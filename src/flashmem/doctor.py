"""`flashmem doctor`: troubleshooting as measurements (the library behind the command).

It measures what its advice talks about:

- the cold-tier folder: random block-sized reads (IOPS, bandwidth) of a probe
  file written there, with the page cache dropped for that file where the OS
  allows it (posix_fadvise DONTNEED after fsync; the report says when it could not);
- memory: device-resident and cold bytes the config needs at the context
  (`flashmem.sizing.calculator`), against what the machine has (RAM, accelerator,
  disk free under the cold folder);
- threads and device: torch threads, usable cores, CUDA;
- the config: keep_full_layers (or the layer split), window vs context, block size, selection,
  prefetch, and (on a CPU) whether the re-rank's candidates are every page at the context.

Advice is keyed to the three symptoms (accuracy drop, slow, out of memory), each
finding with the number behind it.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flashmem.config import FlashMemoryConfig
from flashmem.errors import FlashMemError

SYMPTOMS = ("accuracy", "slow", "memory")


@dataclass
class Finding:
    symptom: str  # accuracy | slow | memory
    level: str  # ok | warn | bad
    finding: str  # what was measured or found, with the number
    advice: str  # what to change ("" when nothing)
    number: float | int | str | None = None


@dataclass
class Report:
    context: int
    model: str
    config: dict[str, Any]
    io: dict[str, Any]
    memory: dict[str, Any]
    threads: dict[str, Any]
    device: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["findings"] = [asdict(f) for f in self.findings]
        return d


# ---------------------------------------------------------------- measurements
def probe_io(folder: str | Path, block_bytes: int, *, file_bytes: int = 64 * 2**20, seconds: float = 2.0,
             max_reads: int = 4000) -> dict[str, Any]:  # fmt: skip
    """Random reads of `block_bytes` from a probe file of `file_bytes` written in `folder`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FlashMemError(f"--cold-dir {folder}: not a folder")
    block_bytes = max(4096, int(block_bytes))
    file_bytes = max(file_bytes, 16 * block_bytes)
    path = folder / f".flashmem-doctor-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        t0 = time.perf_counter()
        try:
            with open(path, "wb") as fh:
                chunk = os.urandom(min(file_bytes, 4 * 2**20))
                left = file_bytes
                while left > 0:
                    left -= fh.write(chunk[: min(left, len(chunk))])
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise FlashMemError(f"--cold-dir {folder}: cannot write a probe file ({exc.strerror or exc})") from None
        write_s = time.perf_counter() - t0
        dropped, how = _drop_page_cache(path)
        n_slots = file_bytes // block_bytes
        fd = os.open(path, os.O_RDONLY)
        try:
            rng = random.Random(0)
            reads = 0
            t0 = time.perf_counter()
            while reads < max_reads and time.perf_counter() - t0 < seconds:
                off = rng.randrange(n_slots) * block_bytes
                got = os.pread(fd, block_bytes, off)
                if len(got) != block_bytes:
                    break
                reads += 1
            read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    iops = reads / read_s if read_s > 0 else 0.0
    return {
        "folder": str(folder),
        "block_bytes": block_bytes,
        "file_bytes": file_bytes,
        "reads": reads,
        "iops": iops,
        "read_mb_per_s": iops * block_bytes / 1e6,
        "write_mb_per_s": file_bytes / write_s / 1e6 if write_s > 0 else None,
        "page_cache_dropped": dropped,
        "page_cache_note": how,
        "disk_free_bytes": shutil.disk_usage(folder).free,
    }


def _drop_page_cache(path: Path) -> tuple[bool, str]:
    """Evict the probe file's pages, so reads measure the device, not RAM."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        return False, "not dropped: this OS has no posix_fadvise; reads may come from the page cache (optimistic)"
    fd = os.open(path, os.O_RDONLY)
    try:
        fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as exc:
        return False, f"not dropped: posix_fadvise failed ({exc.strerror}); reads may come from the page cache"
    finally:
        os.close(fd)
    return (
        True,
        "dropped for the probe file (fsync, then posix_fadvise DONTNEED); reads go to the block device (a virtual disk may still cache on its host)",
    )


def cpu_load() -> tuple[int, float | None]:
    """(cores this process may use, 1-minute load average or None where the OS has none)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        load1 = os.getloadavg()[0]  # runnable processes, other users' jobs included
    except (AttributeError, OSError):
        load1 = None
    return cores, load1


def suggest_threads(cores: int, load1: float | None) -> int:
    """Torch threads for a machine with `cores` usable cores and a 1-minute load average
    `load1`: one per idle core (at least one). OpenMP threads spin when the cores are
    taken: on a shared 2-core machine at load 8 a 256-token SmolLM2 chunk took ~35 s
    with 2 threads and ~4 s with 1."""
    if load1 is None:
        return max(1, cores)
    return max(1, min(cores, int(cores - load1 + 0.5)))


def machine() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(memory, threads, device) of this machine."""
    import psutil
    import torch

    vm = psutil.virtual_memory()
    mem = {"ram_total_bytes": vm.total, "ram_available_bytes": vm.available}
    cores, load1 = cpu_load()
    threads = {
        "torch_threads": torch.get_num_threads(),
        "usable_cores": cores,
        "cpu_count": os.cpu_count(),
        "load_average_1m": load1,
    }
    device: dict[str, Any] = {"kind": "cpu"}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        device = {"kind": "cuda", "name": torch.cuda.get_device_name(0), "free_bytes": free, "total_bytes": total}
    return mem, threads, device


# ---------------------------------------------------------------- diagnosis
def diagnose(cfg: FlashMemoryConfig, *, model: str = "smollm2", context: int = 8192, cold_dir: str | Path | None = None,
             dtype: str = "float32", probe_bytes: int = 64 * 2**20, probe_seconds: float = 2.0,
             machine_info: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None = None) -> Report:  # fmt: skip
    """Measure and check; `machine_info` replaces the machine's (tests)."""
    from flashmem.sizing.calculator import estimate

    est = estimate(model, tokens=context, dtype=dtype, config=cfg)
    fe = est.flashmem
    assert fe is not None  # config given
    layers = max(1, est.layers)
    managed = max(1, fe.managed_layers.count)
    per_token_layer = est.full_cache_bytes / max(1, context) / layers  # K+V bytes, one token, one layer
    block_bytes = int(per_token_layer * cfg.hca_chunk_size)
    folder = Path(cold_dir or cfg.cold_dir or tempfile.gettempdir())
    io = probe_io(folder, block_bytes, file_bytes=probe_bytes, seconds=probe_seconds)
    mem, threads, device = machine_info or machine()
    counts = fe.tier_counts
    sealed = int(counts.get("sealed_blocks", 0))
    selected_blocks = cfg.blocks_to_select(sealed * cfg.pages_per_block) // max(1, cfg.pages_per_block)
    memory = {
        "full_cache_bytes": est.full_cache_bytes,
        "device_resident_bytes": fe.device_resident_bytes,
        "cold_bytes": fe.cold_bytes,
        "device_fraction": fe.device_resident_bytes / est.full_cache_bytes if est.full_cache_bytes else None,
        "cold_store": cfg.cold_store,
        **mem,
    }
    report = Report(
        context=context,
        model=model,
        config=cfg.model_dump(),
        io=io,
        memory=memory,
        threads=threads,
        device=device,
    )
    report.findings += _accuracy_findings(cfg, context, layers, selected_blocks)
    report.findings += _slow_findings(cfg, io, threads, device, reads_per_step=selected_blocks * managed)
    report.findings += _rerank_findings(cfg, context, device)
    report.findings += _memory_findings(
        cfg, context, io, mem, device, est.full_cache_bytes, fe.device_resident_bytes, fe.cold_bytes
    )
    return report


def _accuracy_findings(cfg: FlashMemoryConfig, context: int, layers: int, selected_blocks: int) -> list[Finding]:
    """Accuracy drop: full layers, the window against the context, the share attended exactly, the codec."""
    f: list[Finding] = []
    n_full = len(cfg.resolve_full_layers(layers))
    if n_full == 0 and cfg.lsa_layer_shares is None:
        f.append(Finding("accuracy", "warn", "keep_full_layers is empty and every layer selects the same pages: every layer is compressed alike", "split pages by layer (lsa_layer_shares: profile, as configs/cpu-small.yaml) or keep one or two layers full (keep_full_layers: [0] or [-1])", 0))  # fmt: skip
    elif n_full == 0:
        # the recipe: no full layer, pages split over layers by how far each attends
        how = "by the measured layer profile" if cfg.lsa_layer_shares == "profile" else "by lsa_layer_shares"
        f.append(Finding("accuracy", "ok", f"no layer kept full: every layer is managed, pages split {how}", "", 0))  # fmt: skip
    else:
        f.append(Finding("accuracy", "ok", f"{n_full} layer(s) keep a full cache", "", n_full))
    if cfg.gpu_cache_limit >= context:
        f.append(Finding("accuracy", "ok", f"window {cfg.gpu_cache_limit} >= context {context}: nothing is compressed", "the cache saves nothing at this context; lower gpu_cache_limit to save memory", cfg.gpu_cache_limit))  # fmt: skip
    exact = cfg.sink_tokens + cfg.gpu_cache_limit + selected_blocks * cfg.hca_chunk_size
    share = min(1.0, exact / max(1, context))
    level = "warn" if share < 0.05 else "ok"
    f.append(Finding("accuracy", level, f"each step attends {exact} of {context} tokens exactly ({share:.1%}): sinks, window {cfg.gpu_cache_limit}, {selected_blocks} selected blocks of {cfg.hca_chunk_size}", "raise lsa_top_k (or lsa_keep_ratio) or the window if answers drift from the full cache" if level != "ok" else "", round(share, 4)))  # fmt: skip
    if cfg.cold_codec != "exact":
        f.append(Finding("accuracy", "warn", f"cold_codec {cfg.cold_codec}: selected blocks come back approximated", "use cold_codec: exact if accuracy drops", cfg.cold_codec))  # fmt: skip
    return f


def _slow_findings(cfg: FlashMemoryConfig, io: dict[str, Any], threads: dict[str, Any], device: dict[str, Any],
                   *, reads_per_step: int) -> list[Finding]:  # fmt: skip
    """Slow: cold-folder reads per decode step (`reads_per_step` blocks, nothing prefetched), threads, device."""
    f: list[Finding] = []
    step_ms = reads_per_step / io["iops"] * 1e3 if io["iops"] else float("inf")
    disk = cfg.cold_store in ("disk", "layered", "lmdb")
    f.append(Finding("slow", "warn" if disk and step_ms > 50 else "ok", f"cold folder {io['folder']}: {io['iops']:.0f} random reads/s of {io['block_bytes']} B ({io['read_mb_per_s']:.0f} MB/s; page cache {'dropped' if io['page_cache_dropped'] else 'NOT dropped'}); {reads_per_step} block reads per decode step would take {step_ms:.1f} ms unprefetched", ("keep prefetch_threads > 0, use the layered store (RAM in front), or a faster disk" if disk and step_ms > 50 else ""), round(step_ms, 2)))  # fmt: skip
    loaders = cfg.prefetch_threads_on(device["kind"])
    if disk and loaders == 0 and not (device["kind"] == "cpu" and cfg.reads_disk_pages()):
        # (a CPU reads a disk tier of exact blocks by pages, without loaders: `auto` settles on none)
        f.append(Finding("slow", "warn", f"cold_store {cfg.cold_store} with prefetch_threads 0: every block read waits on the disk", "set prefetch_threads: auto (or 2)", 0))  # fmt: skip
    bpr = io["block_bytes"]
    if disk and bpr < 16384:
        f.append(Finding("slow", "warn", f"blocks of {bpr} B are small reads: IOPS-bound", "raise hca_chunk_size (e.g. 128) so each read moves more bytes", bpr))  # fmt: skip
    t, c = threads["torch_threads"], threads["usable_cores"]
    load1 = threads.get("load_average_1m")
    if load1 is not None and t > 1 and load1 > c:
        # Measured on a shared 2-core machine at load 8: a 256-token SmolLM2 chunk took
        # ~35 s with 2 torch threads and ~4 s with 1 (OpenMP threads spin when oversubscribed).
        f.append(Finding("slow", "warn", f"load average {load1:.1f} on {c} usable cores with {t} torch threads: other jobs compete, threads spin", f"use --threads {suggest_threads(c, load1)} (one per idle core; `flashmem run` picks it when --threads is not given) while the machine is busy", round(load1, 2)))  # fmt: skip
    if t > c:
        f.append(Finding("slow", "warn", f"torch uses {t} threads on {c} usable cores: oversubscribed", f"set --threads {c} (or OMP_NUM_THREADS)", t))  # fmt: skip
    else:
        f.append(Finding("slow", "ok", f"torch threads {t} on {c} usable cores; prefetch threads {loaders}", "", t))  # fmt: skip
    if device["kind"] == "cpu":
        f.append(Finding("slow", "ok", "no CUDA device: attention runs on the CPU", "a GPU serves long contexts much faster", "cpu"))  # fmt: skip
    return f


def _rerank_findings(cfg: FlashMemoryConfig, context: int, device: dict[str, Any]) -> list[Finding]:
    """Slow, on a CPU: a context short enough that every page is a re-rank candidate, so a
    decode step scores every key and then attends its selection, where the full cache attends
    every key once."""
    if device["kind"] != "cpu" or cfg.lsa_rerank <= 1:
        return []
    from flashmem.sizing.tiers import rerank_candidates

    pages = max(0, context - cfg.sink_tokens - cfg.gpu_cache_limit) // cfg.page_tokens
    k = cfg.blocks_to_select(pages)
    cand = rerank_candidates(cfg, pages, k)  # 0 past lsa_rerank_max_tokens: no re-rank there
    if not pages or not cand or cand < pages or k >= pages:
        return []
    return [Finding("slow", "warn", f"every one of the {pages} sealed pages at {context} tokens is a re-rank candidate ({cfg.lsa_rerank} x {k} selected, at least lsa_rerank_min_pages {cfg.lsa_rerank_min_pages}): each decode step scores every key, then attends its selection; on a CPU that is slower than the full cache's one pass (SmolLM2 at 8K and 1/8: 0.77x its decode speed; a tiny model at 32K: 3.7x faster, docs/results.md)", "at this length the cache saves memory, not decode time; lower lsa_rerank_min_pages to trade accuracy for speed", cand)]  # fmt: skip


def _memory_findings(cfg: FlashMemoryConfig, context: int, io: dict[str, Any], mem: dict[str, Any],
                     device: dict[str, Any], full_bytes: int, dev_need: int, cold_need: int) -> list[Finding]:  # fmt: skip
    """Out of memory: device-resident and cold bytes against what the machine has (`full_bytes`: the full cache)."""
    f: list[Finding] = []
    dev_have = device.get("free_bytes", mem["ram_available_bytes"])
    where = "GPU free" if device["kind"] == "cuda" else "RAM available"
    ratio = dev_need / dev_have if dev_have else float("inf")
    f.append(Finding("memory", "bad" if ratio > 1 else "warn" if ratio > 0.5 else "ok", f"device-resident KV at {context} tokens: {dev_need / 2**20:.1f} MiB of {dev_have / 2**20:.0f} MiB {where} ({ratio:.1%}); the full cache would be {full_bytes / 2**20:.1f} MiB", "lower gpu_cache_limit, lsa_top_k or the context; weights are not counted here" if ratio > 0.5 else "", dev_need))  # fmt: skip
    if cfg.cold_store == "memory":
        cold_have, cold_where = mem["ram_available_bytes"], "RAM available (cold_store memory)"
    else:
        cold_have, cold_where = io["disk_free_bytes"], f"disk free under {io['folder']}"
    cr = cold_need / cold_have if cold_have else float("inf")
    f.append(Finding("memory", "bad" if cr > 1 else "warn" if cr > 0.5 else "ok", f"cold tier at {context} tokens: {cold_need / 2**20:.1f} MiB of {cold_have / 2**20:.0f} MiB {cold_where} ({cr:.1%})", ("use cold_store: disk (or layered) with cold_dir on a disk with room, or cold_codec: int8" if cr > 0.5 else ""), cold_need))  # fmt: skip
    if device["kind"] == "cpu" and cfg.cold_store == "memory" and full_bytes:
        both = dev_need + cold_need  # one RAM holds both tiers
        f.append(Finding("memory", "bad" if both > mem["ram_available_bytes"] else "ok", f"on a CPU the device tiers and the memory cold tier are the same RAM: {both / 2**20:.1f} MiB together, {both / full_bytes:.0%} of the full cache", "the saving is on an accelerator, or with cold_store: disk on a CPU", round(both / full_bytes, 4)))  # fmt: skip
    loaders = cfg.prefetch_threads_on(device["kind"])
    if device["kind"] == "cpu" and cfg.reads_disk_pages() and loaders > 0:
        # `auto` settles on none here (recipe.HOST_DISK): only a number set by hand gets this far
        f.append(Finding("memory", "warn", f"a disk tier on a CPU with {loaders} prefetch threads: the loaders hold whole blocks in RAM, the RAM the disk tier saves, and read whole blocks where a step reads pages (SmolLM2 at 8K and 1/8: RSS 7.6x the budget against 1.13x without them, steps 2.7x slower; docs/results.md)", "prefetch_threads: auto (none on a CPU with a disk tier)", loaders))  # fmt: skip
    return f


def format_report(r: Report) -> str:
    """Human-readable report: measurements, then advice per symptom."""
    io, mem = r.io, r.memory
    lines = [
        f"flashmem doctor: model {r.model}, context {r.context} tokens",
        f"  device: {r.device.get('name', r.device['kind'])}; torch threads {r.threads['torch_threads']}, usable cores {r.threads['usable_cores']}",
        f"  cold folder {io['folder']}: {io['iops']:.0f} IOPS, {io['read_mb_per_s']:.1f} MB/s random {io['block_bytes']} B reads; write {io['write_mb_per_s'] or 0:.0f} MB/s",
        f"    page cache: {io['page_cache_note']}",
        f"  KV memory: full {mem['full_cache_bytes'] / 2**20:.1f} MiB; device-resident {mem['device_resident_bytes'] / 2**20:.1f} MiB; cold {mem['cold_bytes'] / 2**20:.1f} MiB; RAM available {mem['ram_available_bytes'] / 2**30:.1f} GiB",
    ]
    titles = {"accuracy": "Accuracy drop", "slow": "Slow", "memory": "Out of memory"}
    for s in SYMPTOMS:
        lines.append(f"{titles[s]}:")
        for fd in (x for x in r.findings if x.symptom == s):
            mark = {"ok": "ok  ", "warn": "WARN", "bad": "BAD "}[fd.level]
            lines.append(f"  [{mark}] {fd.finding}")
            if fd.advice:
                lines.append(f"         -> {fd.advice}")
    return "\n".join(lines)
