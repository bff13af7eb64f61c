"""Traffic: the bytes each prefill chunk and decode step moves, by path.

On an accelerator what a step costs is what it reads, and where from
(docs/accelerator.md). The cache counts, per model forward:

- `device_read_bytes`: K/V and index bytes attention and the index read from the
  device-resident tiers (sinks, window, open block, summaries, the working set as
  held, the index, the exact prompt's K/V, the new tokens);
- `h2d_bytes`: bytes copied from the cold tier into the device's working set or
  the exact prompt's stream (host to device on a GPU; on a CPU the same copy
  within RAM). A coded cold tier counts its coded bytes;
- `host_read_bytes`: bytes read by compute where the cold tier holds them (the
  re-rank scoring a memory store's keys in place, on a CPU only);
- `disk_read_bytes`: bytes the store's disk tier read (prefetch included);
- `device_copy_bytes`: bytes a selecting step writes on the device and reads back to run
  attention, beside the tiers it holds: attention's K/V buffer (cache/assembly.py `concat`,
  written then read by SDPA; on a CPU an int8 part's scale pass too) and the index converted
  to the queries' dtype for its scores (written, read back). The hardware model charges
  them as HBM traffic (sizing/hardware.py `assembly_bytes`).

Page and candidate hits may be handed over as device tensors: they are read when the step
closes (the next forward's start, or `report()`), not in each layer, where reading them would
make the host wait for the device's queue.

One `Traffic` is shared by a cache's layers; the cache opens a step at the first
layer's update (`begin_step`) and `report()` gives totals and per-step medians
beside the full cache's bytes for the same steps (a full cache reads every
token's K/V in every layer each step). A decode step redone by `exact_on_doubt`
(cache/doubt.py) is its decode step plus a redo forward, counted apart: the decode
medians stay those of a selecting step, the prompt's those of the prompt, and the
redos' share and median give what near ties add.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from flashmem.store.base import ColdStore

PATHS = ("device_read_bytes", "h2d_bytes", "host_read_bytes", "disk_read_bytes", "device_copy_bytes")
# Store tiers that live in RAM: their reads are not disk reads.
_RAM_TIERS = frozenset({"memory", "ram"})


@dataclass
class StepTraffic:
    kind: str  # "prefill" (a forward of several tokens), "decode" (one token) or "redo" (exact_on_doubt's)
    tokens_before: int  # tokens the cache held when the step began
    queries: int
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    # selected pages the device already held from the step before (hits) and pages read (misses)
    page_hits: int = 0
    page_misses: int = 0
    # what the missed pages take as the cold tier hands them over: the least a step that
    # reads only what it newly attends can copy to the device
    new_page_bytes: int = 0
    # re-rank candidates the step before also had (with `lsa_rerank_on_device`: whose codes the
    # device held), and the others (copied to the device there)
    candidate_hits: int = 0
    candidate_misses: int = 0
    full_cache_bytes: int = 0  # what a full cache reads for the same step
    # counts still held as tensors (read when the step closes): (kind, hits, misses, page bytes)
    lazy: list[tuple[str, Any, Any, int]] = field(default_factory=list)

    def resolve(self) -> None:
        """Read the counts handed over as tensors into the fields: one read per device for
        the whole step (two a layer would each wait for the device's queue)."""
        if not self.lazy:
            return
        values = _read_all([x for _, hits, misses, _ in self.lazy for x in (hits, misses)])
        for i, (kind, _, _, page_bytes) in enumerate(self.lazy):
            h, m = values[2 * i], values[2 * i + 1]
            if kind == "pages":
                self.page_hits += h
                self.page_misses += m
                self.new_page_bytes += m * page_bytes
            else:
                self.candidate_hits += h
                self.candidate_misses += m
        self.lazy.clear()


class Traffic:
    """Byte counters per step, shared by one cache's layers."""

    def __init__(self) -> None:
        self.steps: list[StepTraffic] = []
        self._store: ColdStore | None = None
        self._disk_mark = 0
        self._redo_next = False

    def watch(self, store: ColdStore) -> None:
        """Count `store`'s disk-tier reads per step."""
        self._store = store
        self._disk_mark = self._disk_bytes()

    def expect_redo(self) -> None:
        """The next forward is exact_on_doubt's redo of a decode step (cache/doubt.py): counted
        apart, as what the step it redoes cost besides its own forward."""
        self._redo_next = True

    def begin_step(self, queries: int, tokens_before: int, full_cache_bytes: int) -> None:
        """A new model forward of `queries` tokens over `tokens_before` cached ones; a full
        cache reads `full_cache_bytes` of K/V for it (every earlier token's and the new ones')."""
        self._close_step()
        kind = "redo" if self._redo_next else "decode" if queries == 1 else "prefill"
        self._redo_next = False
        self.steps.append(StepTraffic(kind, tokens_before, queries, full_cache_bytes=full_cache_bytes))

    def add(self, path: str, nbytes: int) -> None:
        if self.steps:
            self.steps[-1].counts[path] += int(nbytes)

    def pages(self, hits: int | torch.Tensor, misses: int | torch.Tensor, page_bytes: int = 0) -> None:
        """A working set gathered: `hits` selected pages were held already, `misses` were read
        (`page_bytes` each, K and V as the cold tier hands them over); tensors are read later."""
        if self.steps and (isinstance(hits, torch.Tensor) or isinstance(misses, torch.Tensor)):
            self.steps[-1].lazy.append(("pages", hits, misses, int(page_bytes)))
        elif self.steps:
            self.steps[-1].page_hits += int(hits)
            self.steps[-1].page_misses += int(misses)
            self.steps[-1].new_page_bytes += int(misses) * int(page_bytes)

    def candidates(self, hits: int | torch.Tensor, misses: int | torch.Tensor) -> None:
        """Candidate codes held on the device: `hits` kept from the last step, `misses` copied
        (tensors are read later)."""
        if self.steps and (isinstance(hits, torch.Tensor) or isinstance(misses, torch.Tensor)):
            self.steps[-1].lazy.append(("candidates", hits, misses, 0))
        elif self.steps:
            self.steps[-1].candidate_hits += int(hits)
            self.steps[-1].candidate_misses += int(misses)

    def cold_read(self, store: ColdStore, device: torch.device, nbytes: int, in_place: bool = False) -> None:
        """`nbytes` of K/V read from the cold tier for `device`: copied to the device, or
        read where the store holds them (in_place: scored on the host, nothing copied)."""
        self.add("host_read_bytes" if in_place else "h2d_bytes", nbytes)

    def reset(self) -> None:
        self.steps.clear()
        self._disk_mark = self._disk_bytes()

    def report(self) -> dict[str, Any]:
        """Totals, per-step medians (decode steps, prefill forwards, redo forwards) and the full cache's."""
        self._close_step()
        redos = [s for s in self.steps if s.kind == "redo"]
        out: dict[str, Any] = {
            "steps": {
                "prefill_forwards": sum(s.kind == "prefill" for s in self.steps),
                "decode_steps": sum(s.kind == "decode" for s in self.steps),
                # exact_on_doubt's redone decode steps, and the tokens their forwards fed again
                "redo_forwards": len(redos),
                "redo_tokens": sum(s.queries for s in redos),
            },
            "totals": {p: sum(s.counts[p] for s in self.steps) for p in PATHS},
            "full_cache_bytes": sum(s.full_cache_bytes for s in self.steps),
        }
        decode = [s for s in self.steps if s.kind == "decode"]
        hits, misses = sum(s.page_hits for s in decode), sum(s.page_misses for s in decode)
        # the working set as a device-side page cache: pages a decode step found held
        out["page_cache"] = {
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        }
        c_hits, c_misses = sum(s.candidate_hits for s in decode), sum(s.candidate_misses for s in decode)
        if c_hits + c_misses:  # the re-rank's candidates as a cache (codes held on the device)
            out["candidate_cache"] = {"hits": c_hits, "misses": c_misses, "hit_rate": c_hits / (c_hits + c_misses)}
        for kind, name in (
            ("decode", "per_decode_step_median"),
            ("prefill", "per_prefill_forward_median"),
            ("redo", "per_redo_forward_median"),
        ):
            steps = [s for s in self.steps if s.kind == kind]
            med = {p: int(statistics.median(s.counts[p] for s in steps)) if steps else 0 for p in PATHS}
            med["full_cache_bytes"] = int(statistics.median(s.full_cache_bytes for s in steps)) if steps else 0
            out[name] = med
        # the link's bytes over the least a step must copy (its newly attended pages), per
        # decode step with any: 1.0 reads only what it attends; the candidates' keys or whole
        # blocks copied to the device raise it
        ratios = [s.counts["h2d_bytes"] / s.new_page_bytes for s in decode if s.new_page_bytes]
        out["per_decode_step_median"]["new_page_bytes"] = (
            int(statistics.median(s.new_page_bytes for s in decode)) if decode else 0
        )
        out["h2d_over_new_pages_median"] = statistics.median(ratios) if ratios else None
        return out

    # ------------------------------------------------------------------ internals
    def _disk_bytes(self) -> int:
        if self._store is None:
            return 0
        try:
            tiers = self._store.tier_stats()
        except Exception:  # a closed store: nothing more is read
            return self._disk_mark
        return int(sum(st.get("bytes_read", 0) for name, st in tiers.items() if name not in _RAM_TIERS))

    def _close_step(self) -> None:
        """Attribute the disk reads since the last mark to the step that is ending."""
        now = self._disk_bytes()
        if self.steps:
            self.steps[-1].counts["disk_read_bytes"] += now - self._disk_mark
            self.steps[-1].resolve()
        self._disk_mark = now


def _read_all(values: list[Any]) -> list[int]:
    """Ints and 0-dim count tensors -> ints, the tensors of each device read in one copy."""
    out = [0 if isinstance(v, torch.Tensor) else int(v) for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for where in by_device.values():
        stacked = torch.stack([values[i].reshape(()).to(torch.int64) for i in where])
        for i, x in zip(where, stacked.tolist(), strict=True):
            out[i] = int(x)
    return out
