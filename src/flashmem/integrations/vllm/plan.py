"""The connector's logic without vLLM: options, keys, the scheduler's plan, the worker's copies.

`connector.py` is a thin `KVConnectorBase_V1` around these classes, so everything
that decides what is stored, found, loaded and reported runs (and is tested) where
vLLM is not installed.

Records. A prompt is cut into chunks of `chunk_tokens` tokens (a multiple of vLLM's
block size). Chunk j's key is `flashmem.serve.prefix.chain`'s hash of every token up
to the end of chunk j, the model and its KV layout (`fingerprint`), and the tenant
salt (the connector's `salt` plus the request's own `cache_salt`, its LoRA adapter
and its multimodal hashes), so a key names one prefix for one model, layout and
tenant. The record under it holds, for every attention layer, the chunk's vLLM
blocks exactly as they sit in vLLM's paged buffer (`kv[block_ids]`, blocks on dim
0: vLLM's standardized per-layer view), so a load is a copy back into whatever
blocks the new request was given.

Scheduler. `Planner.lookup` counts the leading chunks that are stored and, by
default, reads and checks them (`verify`): a damaged or vanished record then costs
the reuse of its chunk and the ones after it before vLLM is told of any hit, so a
damaged record never reaches the worker. vLLM must always compute at least the
prompt's last token, so at most `(len(prompt) - 1) // chunk_tokens` chunks match.
`Planner.build` turns one scheduler step into a `StepPlan`: the loads of newly
scheduled requests, and the saves of prompt chunks whose tokens are all computed
once this step's forward has run (chunked prefill saves chunk by chunk).

Worker. `Worker.load` copies records into the paged buffers; a record that is
missing or fails its check at this point (a race with an eviction, or damage after
the lookup) makes its blocks and all later ones of that request "invalid", which
vLLM recomputes with `kv_load_failure_policy: "recompute"`. `Worker.stage` copies a
layer's blocks out as the forward passes it, and `Worker.flush` writes every chunk
whose layers are all staged, one record each.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flashmem.errors import ConfigError, FlashMemError
from flashmem.serve.prefix import PrefixBackend, chain

log = logging.getLogger(__name__)

FORMAT = "flashmem-vllm-1"  # in every key: records of another layout never match
DEFAULT_CHUNK_TOKENS = 256
SALT_ENV = "FLASHMEM_VLLM_SALT"  # the connector's salt, kept off command lines and configs
OPTION_KEYS = ("store", "path", "quota_bytes", "chunk_tokens", "salt", "verify", "ttl_s")


@dataclass(frozen=True)
class Options:
    """`kv_connector_extra_config` of the connector (see `Options.parse`)."""

    store: str = "disk"
    path: str | None = None
    quota_bytes: int | None = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    salt: str = ""
    verify: bool = True
    ttl_s: int | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any], block_size: int) -> Options:
        """Options from vLLM's `kv_connector_extra_config`; ConfigError (one line) on a bad one.

        store: "disk" (default), "lmdb", or "redis://HOST:PORT[/DB]" / "rediss://...";
        path: the store's folder (disk, lmdb); quota_bytes: evict least recently used
        records above it; chunk_tokens: tokens per record, a multiple of vLLM's block size
        (default 256, or one block if blocks are larger); salt: the deployment's secret
        salt (else $FLASHMEM_VLLM_SALT); verify: read and check records when looking them
        up (default true); ttl_s: a record's lifetime on a Valkey/Redis server."""
        unknown = sorted(set(extra) - set(OPTION_KEYS))
        if unknown:
            raise ConfigError(
                f"flashmem vLLM connector: unknown option(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(OPTION_KEYS)}"
            )
        if block_size <= 0:
            raise ConfigError(f"flashmem vLLM connector: vLLM block size {block_size}; allowed: a positive integer")
        default_chunk = max(block_size, DEFAULT_CHUNK_TOKENS // block_size * block_size)
        chunk = _int(extra, "chunk_tokens", default_chunk, minimum=1)
        assert chunk is not None
        if chunk % block_size:
            raise ConfigError(
                f"flashmem vLLM connector: chunk_tokens {chunk} is not a multiple of vLLM's block size "
                f"{block_size}; allowed: {block_size}, {2 * block_size}, {4 * block_size}, ..."
            )
        verify = extra.get("verify", True)
        if not isinstance(verify, bool):
            raise ConfigError(f"flashmem vLLM connector: verify {verify!r}; allowed: true or false")
        store = extra.get("store", "disk")
        if not isinstance(store, str) or not store:
            raise ConfigError(f"flashmem vLLM connector: store {store!r}; allowed: disk, lmdb, redis://HOST:PORT[/DB]")
        path = extra.get("path")
        if path is not None and (not isinstance(path, str) or not path):
            raise ConfigError(f"flashmem vLLM connector: path {path!r}; allowed: a folder path")
        salt = extra.get("salt", os.environ.get(SALT_ENV, ""))
        if not isinstance(salt, str):
            raise ConfigError("flashmem vLLM connector: salt must be a string")
        return cls(
            store=store,
            path=os.path.expanduser(path) if path else None,
            quota_bytes=_int(extra, "quota_bytes", None, minimum=1),
            chunk_tokens=chunk,
            salt=salt,
            verify=verify,
            ttl_s=_int(extra, "ttl_s", None, minimum=1),
        )


def _int(extra: Mapping[str, Any], name: str, default: int | None, *, minimum: int) -> int | None:
    v = extra.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"flashmem vLLM connector: {name} {v!r}; allowed: an integer >= {minimum}")
    return v


def fingerprint(model: str, layout: Mapping[str, Any]) -> str:
    """What a record's bytes depend on besides the tokens: the model, its dtype and KV layout
    (block size, heads, head size, cache dtype, the attention layers), the chunk size, and
    this format. Records of a different model or layout then never share a key."""
    parts = [FORMAT, model] + [f"{k}={layout[k]}" for k in sorted(layout)]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()


def request_salt(salt: str, cache_salt: str | None, lora: str | None, mm_hashes: Sequence[str]) -> str:
    """The tenant salt of one request: the deployment's salt, vLLM's per-request `cache_salt`
    (one per tenant), the LoRA adapter, and the multimodal inputs' hashes (an image is not
    in the token ids)."""
    return "|".join([salt, cache_salt or "", lora or "", ",".join(mm_hashes)])


# ------------------------------------------------------------------------ scheduler side
@dataclass
class LoadSpec:
    """Copy chunks `first_chunk..` (keys) into the request's blocks from `skip_blocks` to `end_blocks`."""

    keys: list[str]
    first_chunk: int
    block_ids: list[int]
    skip_blocks: int  # blocks vLLM already has (its own prefix cache): never written
    end_blocks: int  # blocks the scheduler counts as loaded


@dataclass
class SaveSpec:
    """Write chunks (index, key, parent) of a request from its blocks."""

    req_id: str
    chunks: list[tuple[int, str, str]]
    block_ids: list[int]


@dataclass
class StepPlan:
    loads: dict[str, LoadSpec] = field(default_factory=dict)
    saves: list[SaveSpec] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass
class _Tracked:
    keys: list[str]  # keys of the prompt's full chunks
    prompt_len: int
    stored: int  # leading chunks known to be stored, or planned to be saved
    block_ids: list[int] = field(default_factory=list)


@dataclass
class _Lookup:
    keys: list[str]
    matched: int  # leading chunks stored (checked when verify)
    local: int  # tokens vLLM had computed when it asked


class Planner:
    """The scheduler side: lookups, and a `StepPlan` per scheduler step."""

    def __init__(self, store: PrefixBackend, opts: Options, block_size: int, fp: str) -> None:
        self.store, self.opts, self.block_size, self.fp = store, opts, block_size, fp
        self.blocks_per_chunk = opts.chunk_tokens // block_size
        self._lookups: dict[str, _Lookup] = {}
        self._pending_loads: dict[str, tuple[_Lookup, int]] = {}
        self._tracked: dict[str, _Tracked] = {}
        self.counters = {"lookups": 0, "hit_tokens": 0, "planned_saves": 0, "lookup_errors": 0}

    def keys(self, tokens: Sequence[int], salt: str) -> list[str]:
        return chain(list(tokens), self.opts.chunk_tokens, self.fp, salt)

    def lookup(self, req_id: str, tokens: Sequence[int] | None, salt: str, num_computed: int) -> int:
        """Tokens beyond `num_computed` that stored chunks hold (0 when none, or on any store error)."""
        if not tokens:
            return 0
        cached = self._lookups.get(req_id)
        if cached is None:
            keys = self.keys(tokens, salt)
            usable = (len(tokens) - 1) // self.opts.chunk_tokens  # vLLM computes the last token itself
            try:
                n = self.store.longest(keys[:usable])
                if self.opts.verify and n:
                    n = len(self.store.load(keys[:n]))  # reads and checks; a damaged record ends the run
            except (FlashMemError, OSError) as exc:
                self.counters["lookup_errors"] += 1
                log.warning("flashmem vLLM connector: lookup failed (%s); served without reuse", exc)
                n = 0
            cached = _Lookup(keys, n, num_computed)
            self._lookups[req_id] = cached
            self.counters["lookups"] += 1
        cached.local = num_computed
        return max(0, cached.matched * self.opts.chunk_tokens - num_computed)

    def allocated(self, req_id: str, tokens: Sequence[int] | None, salt: str, num_external: int) -> None:
        """vLLM allocated blocks for the request (`update_state_after_alloc`)."""
        look = self._lookups.pop(req_id, None)
        if look is None:
            if not tokens:
                return
            look = _Lookup(self.keys(tokens, salt), 0, 0)
        if num_external > 0:
            self._pending_loads[req_id] = (look, num_external)
            self.counters["hit_tokens"] += num_external
        if tokens and req_id not in self._tracked:
            self._tracked[req_id] = _Tracked(look.keys, len(tokens), look.matched)

    def build(
        self,
        new_reqs: Iterable[tuple[str, Sequence[int], int]],
        cached_reqs: Iterable[tuple[str, Sequence[int] | None, bool, int]],
        num_scheduled: Mapping[str, int],
        finished: Iterable[str] = (),
    ) -> StepPlan:
        """One step's plan. new_reqs: (req_id, block_ids, num_computed_tokens);
        cached_reqs: (req_id, new block_ids or None, resumed from preemption, num_computed_tokens)."""
        plan = StepPlan()
        for req_id, block_ids, computed in new_reqs:
            t = self._tracked.get(req_id)
            if t is not None:
                t.block_ids = list(block_ids)
            self._plan_load(plan, req_id, list(block_ids))
            self._plan_save(plan, req_id, computed + num_scheduled.get(req_id, 0))
        for req_id, new_ids, resumed, computed in cached_reqs:
            t = self._tracked.get(req_id)
            if t is not None and new_ids is not None:
                t.block_ids = list(new_ids) if resumed else t.block_ids + list(new_ids)
            if resumed and req_id in self._pending_loads and t is not None:
                self._plan_load(plan, req_id, t.block_ids)
            self._plan_save(plan, req_id, computed + num_scheduled.get(req_id, 0))
        for req_id in plan.loads:  # a load allocated but not yet scheduled waits for its step
            self._pending_loads.pop(req_id, None)
        for req_id in finished:
            self.finished(req_id)
        return plan

    def finished(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._pending_loads.pop(req_id, None)

    def _plan_load(self, plan: StepPlan, req_id: str, block_ids: list[int]) -> None:
        pending = self._pending_loads.get(req_id)
        if pending is None:
            return
        look, num_external = pending
        chunk = self.opts.chunk_tokens
        first = look.local // chunk
        last = (look.local + num_external) // chunk  # exclusive; the matched run is whole chunks
        plan.loads[req_id] = LoadSpec(
            keys=look.keys[first:last],
            first_chunk=first,
            block_ids=block_ids,
            skip_blocks=look.local // self.block_size,
            end_blocks=(look.local + num_external) // self.block_size,
        )

    def _plan_save(self, plan: StepPlan, req_id: str, computed_after: int) -> None:
        t = self._tracked.get(req_id)
        if t is None:
            return
        done = min(computed_after, t.prompt_len) // self.opts.chunk_tokens
        done = min(done, len(t.keys), len(t.block_ids) // self.blocks_per_chunk)
        if done <= t.stored:
            return
        chunks = [(j, t.keys[j], t.keys[j - 1] if j else "") for j in range(t.stored, done)]
        plan.saves.append(SaveSpec(req_id, chunks, list(t.block_ids)))
        self.counters["planned_saves"] += len(chunks)
        t.stored = done


# ------------------------------------------------------------------------ worker side
class Worker:
    """The worker side: copies between vLLM's paged buffers and records.

    kv_caches: layer name -> that layer's paged buffer, blocks on dim 0 (vLLM's
    standardized view). A buffer with k times `num_blocks` rows holds k kernel blocks
    per scheduler block (vLLM's virtual block splitting): block b is rows b*k..b*k+k-1."""

    def __init__(self, store: PrefixBackend, opts: Options, block_size: int, num_blocks: int) -> None:
        self.store, self.opts, self.block_size, self.num_blocks = store, opts, block_size, num_blocks
        self.blocks_per_chunk = opts.chunk_tokens // block_size
        self.kv: dict[str, torch.Tensor] = {}
        self._staged: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._errors: set[int] = set()
        self.counters = {
            "loaded_chunks": 0,
            "load_failures": 0,
            "saved_chunks": 0,
            "save_errors": 0,
            "loaded_bytes": 0,
            "saved_bytes": 0,
        }

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        for name, t in kv_caches.items():
            if not isinstance(t, torch.Tensor):
                raise FlashMemError(
                    f"flashmem vLLM connector: layer {name}'s KV cache is a {type(t).__name__}; "
                    "allowed: one tensor per layer (blocks on dim 0)"
                )
            if self.num_blocks and t.shape[0] % self.num_blocks:
                raise FlashMemError(
                    f"flashmem vLLM connector: layer {name} has {t.shape[0]} blocks on dim 0, not a multiple of "
                    f"vLLM's {self.num_blocks}; allowed: a standardized KV layout (blocks on dim 0)"
                )
        self.kv = dict(kv_caches)

    def _split(self, t: torch.Tensor) -> int:
        """Kernel blocks (rows on dim 0) per scheduler block in buffer `t`."""
        return t.shape[0] // self.num_blocks if self.num_blocks else 1

    @staticmethod
    def _expand(ids: Sequence[int] | torch.Tensor, k: int) -> torch.Tensor:
        """Rows of blocks `ids` when each block is `k` rows."""
        t = torch.as_tensor(ids, dtype=torch.long)
        return t if k == 1 else (t[:, None] * k + torch.arange(k)[None, :]).reshape(-1)

    def _rows(self, t: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
        return self._expand(list(block_ids), self._split(t))

    # ---------------------------------------------------------------- loads
    def load(self, loads: Mapping[str, LoadSpec]) -> None:
        """Copy each request's records into its blocks; failures become invalid blocks."""
        for spec in loads.values():
            try:
                records = self.store.load(spec.keys)
            except (FlashMemError, OSError) as exc:
                log.warning("flashmem vLLM connector: load failed (%s); those blocks are recomputed", exc)
                records = []
            good = 0
            for i, rec in enumerate(records):
                if not self._copy_in(rec, spec, spec.first_chunk + i):
                    break
                good += 1
                self.counters["loaded_chunks"] += 1
            if good < len(spec.keys):
                self.counters["load_failures"] += 1
                start = max(spec.skip_blocks, (spec.first_chunk + good) * self.blocks_per_chunk)
                self._errors.update(spec.block_ids[start : spec.end_blocks])

    def _copy_in(self, rec: Mapping[str, torch.Tensor], spec: LoadSpec, chunk: int) -> bool:
        lo = chunk * self.blocks_per_chunk
        hi = lo + self.blocks_per_chunk
        keep = [i for i in range(lo, hi) if spec.skip_blocks <= i < spec.end_blocks]
        if not keep:
            return True
        ids = [spec.block_ids[i] for i in keep]
        sel = torch.as_tensor([i - lo for i in keep], dtype=torch.long)
        staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for name, t in self.kv.items():  # check every layer before writing any
            src = rec.get(name)
            k = self._split(t)
            want = (self.blocks_per_chunk * k, *t.shape[1:])
            if src is None or tuple(src.shape) != want or src.dtype != t.dtype:
                log.warning("flashmem vLLM connector: a record does not fit layer %s; not used", name)
                return False
            staged.append((t, self._expand(ids, k), src[self._expand(sel, k)]))
        for t, rows, src in staged:
            t[rows.to(t.device)] = src.to(t.device)
            self.counters["loaded_bytes"] += src.numel() * src.element_size()
        return True

    def take_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    # ---------------------------------------------------------------- saves
    def stage(self, layer: str, kv: torch.Tensor, saves: Sequence[SaveSpec]) -> None:
        """Copy this layer's blocks of every chunk to save (the buffer is reused once the step ends)."""
        for s in saves:
            for j, _, _ in s.chunks:
                ids = s.block_ids[j * self.blocks_per_chunk : (j + 1) * self.blocks_per_chunk]
                blocks = kv[self._rows(kv, ids).to(kv.device)]  # a copy (advanced indexing)
                self._staged.setdefault((s.req_id, j), {})[layer] = blocks.cpu()

    def flush(self, saves: Sequence[SaveSpec]) -> None:
        """Write every planned chunk whose layers are all staged; a failed write costs reuse only."""
        expected = set(self.kv)
        for s in saves:
            for j, key, parent in s.chunks:
                rec = self._staged.pop((s.req_id, j), None)
                if rec is None or (expected and set(rec) != expected):
                    self.counters["save_errors"] += 1
                    log.warning("flashmem vLLM connector: chunk %d of %s not staged for every layer", j, s.req_id)
                    continue
                try:
                    self.store.save(key, parent, rec)
                except (FlashMemError, OSError) as exc:
                    self.counters["save_errors"] += 1
                    log.warning("flashmem vLLM connector: record not saved (%s); costs reuse only", exc)
                    continue
                self.counters["saved_chunks"] += 1
                self.counters["saved_bytes"] += sum(t.numel() * t.element_size() for t in rec.values())
        self._staged.clear()
