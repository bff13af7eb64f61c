"""FlashMemoryCache: a transformers `Cache` whose managed layers are FlashLayers.

Layer kinds, decided once from the model config:
- sliding-window layers (Gemma3's local layers) keep transformers' own bounded
  `DynamicSlidingWindowLayer`, untouched;
- `keep_full_layers` keep a plain `DynamicLayer`;
- every other attention layer is a `FlashLayer`.

Cold tier (docs/design.md, "Tiers"): the cache opens its store with
`open_store(cfg, dtype=model dtype)` (memory, disk or layered; any codec) and,
when it has loader threads (`prefetch_threads`, `auto` settled for the model's
device), a Prefetcher that the layers read through and that look-ahead fills.
`close()` (or `with attach(...) as cache`, or garbage collection) closes the
prefetcher, then the store (its folder is removed unless `persist`).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, cast

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from flashmem import tier_names
from flashmem.cache import generation
from flashmem.cache.doubt import DoubtState
from flashmem.cache.flash_layer import FlashLayer, SelectionHook, tensor_bytes
from flashmem.cache.guard import StepGuard
from flashmem.cache.host_heap import release_free_memory, set_mmap_threshold
from flashmem.cache.latent import make_latent
from flashmem.cache.scratch import thread_scratch
from flashmem.cache.traffic import Traffic
from flashmem.compress.fusion import make_rule
from flashmem.config import FlashMemoryConfig
from flashmem.errors import ConfigError
from flashmem.index import ScorerContext, make_scorer
from flashmem.models import geometry
from flashmem.rope import RopeRotator
from flashmem.store.base import ColdStore
from flashmem.store.prefetch import Prefetcher


class FlashMemoryCache(Cache):
    """The FlashMemory tiered KV cache. Build it with `flashmem.attach(model, cfg)`."""

    def __init__(
        self,
        model_config: PretrainedConfig,
        cfg: FlashMemoryConfig,
        rotators: dict[str | None, RopeRotator | None] | None = None,
        store: ColdStore | None = None,
        dtype: torch.dtype = torch.float32,
        calibration: Any | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """calibration: a `flashmem.calibration.Calibration` (scorers that need one, `cold_low_rank`);
        device: where the model runs (settles `prefetch_threads: auto`; `attach` passes the model's)."""
        text_cfg = model_config.get_text_config(decoder=True)
        n_layers = text_cfg.num_hidden_layers
        full = cfg.resolve_full_layers(n_layers)
        layer_types = geometry.layer_types(text_cfg, n_layers, infer_sliding=False)
        self.cfg = cfg
        if cfg.host_mmap_threshold is not None and not set_mmap_threshold(cfg.host_mmap_threshold):
            warnings.warn("host_mmap_threshold needs glibc's malloc; this C library's heap is left as is", stacklevel=2)
        self._selection_hook: SelectionHook | None = None
        self._open_cold_tier(store, dtype, torch.device(device).type)
        # Synchronous reads when prefetch is off: each is a miss and its time a stall.
        self._fetch_counts: dict[str, float] = {"misses": 0, "stall_s": 0.0}
        # Bytes each forward reads and copies, by path (cache/traffic.py).
        self._traffic = Traffic()
        self._traffic.watch(self.store)
        self._guard = StepGuard(n_layers)
        # exact_on_doubt: the steps checked and redone, and what a redo goes back to (cache/doubt.py)
        self.doubt = DoubtState()
        # the tokens of the last model forward, and whether a prompt's end was seen (`prompt_done`)
        self._last_forward_tokens = 0
        self._prompt_end_seen = False
        self._finalizer = weakref.finalize(self, _close_cold_tier, self.prefetcher, self.store)
        sliding = [geometry.keeps_window(kind, text_cfg) for kind in layer_types]
        managed = [i for i in range(n_layers) if not sliding[i] and i not in full]
        kv_heads, head_dim = geometry.kv_heads(text_cfg) or 0, geometry.head_dim(text_cfg) or 0
        # what a full cache (DynamicCache) holds per token and layer, and each layer's cap
        self._full_per_layer_token = 2 * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        window = getattr(text_cfg, "sliding_window", None) or 0
        self._full_layer_caps = [max(1, window - 1) if sliding[i] and window else None for i in range(n_layers)]
        _check_layer_shares(cfg, n_layers)
        layers: list[Any] = []
        top_k = cfg.layer_top_k(managed)  # lsa_layer_shares: pages per layer ("profile": attach resolves it)
        share = None
        if self.prefetcher is not None:  # 10% slack for in-flight loads
            share = int(0.9 * self.prefetcher.ready_bytes) // max(1, len(managed))
        for i, kind in enumerate(layer_types):
            if sliding[i]:
                layers.append(DynamicSlidingWindowLayer(sliding_window=text_cfg.sliding_window))
            elif i in full:
                layers.append(DynamicLayer())
            else:
                layer_cfg = cfg if i not in top_k else cfg.model_copy(update={"lsa_top_k": top_k[i]})
                layers.append(self._flash_layer(i, layer_cfg, rotators, kind, calibration, (kv_heads, head_dim), share))
        # transformers builds one mask for all full-attention layers from the first one's
        # sizes: a plain full layer needs it over every position, so FlashLayers then ask for that too.
        compact = not any(type(layer) is DynamicLayer for layer in layers)
        for layer in layers:
            if isinstance(layer, FlashLayer):
                layer.compact_mask = compact
        super().__init__(layers=layers)

    def _open_cold_tier(self, store: ColdStore | None, dtype: torch.dtype, device_type: str) -> None:
        """self.store (the given one, or `cfg`'s) and self.prefetcher (None without loader threads:
        the config's number, or `auto`'s for the model's device)."""
        self.store = store if store is not None else _default_store(self.cfg, dtype)
        self.prefetcher: Prefetcher | None = None
        try:
            if self.cfg.prefetch_threads_on(device_type) > 0:
                from flashmem.store import open_prefetcher

                self.prefetcher = open_prefetcher(self.cfg, self.store, device_type)
        except BaseException:
            self.store.close()
            raise

    def _flash_layer(
        self,
        i: int,
        layer_cfg: FlashMemoryConfig,
        rotators: dict[str | None, RopeRotator | None] | None,
        kind: str | None,
        calibration: Any | None,
        heads: tuple[int, int],
        lookahead_bytes: int | None,
    ) -> FlashLayer:
        """Managed layer `i` (`kind` picks its rotator); heads: (kv_heads, head_dim)."""
        kv_heads, head_dim = heads
        rotator = (rotators or {}).get(kind)
        layer_cal = calibration.layer(i) if calibration is not None else None
        ctx = ScorerContext(layer_idx=i, kv_heads=kv_heads, head_dim=head_dim, cfg=layer_cfg, calibration=layer_cal)
        layer = FlashLayer(
            i,
            layer_cfg,
            self.store,
            make_scorer(self.cfg.lsa_scorer, ctx),
            make_rule(self.cfg.fusion_rule),
            rotator,
            prefetcher=self.prefetcher,
            fetch_counts=self._fetch_counts,
            lookahead_bytes=lookahead_bytes,
            traffic=self._traffic,
        )
        layer.guard = self._guard
        # cold_low_rank: sealed blocks go to the store as calibrated low-rank coefficients
        layer.latent = make_latent(self.cfg, calibration, i, rotator, head_dim)
        return layer

    # ------------------------------------------------------------ hooks
    @property
    def selection_hook(self) -> SelectionHook | None:
        """A diagnostic override of block selection, None by default.

        `fn(layer_idx, idx, scores) -> idx`: called after every selection of every
        managed layer with the chosen block ids idx [b, h, k] (sorted) and the
        index scores [b, h, nq, n_sealed]; what it returns (same shape, sorted)
        is attended instead. Used to ask "what if the index had picked X"
        (benchmarks/needle_oracle.py); set it to None to turn it off.
        """
        return self._selection_hook

    @selection_hook.setter
    def selection_hook(self, fn: SelectionHook | None) -> None:
        self._selection_hook = fn
        for layer in self.flash_layers:
            layer.selection_hook = fn

    @property
    def prefetch_threads(self) -> int:
        """The prefetcher's loader threads (0: none)."""
        return 0 if self.prefetcher is None else self.prefetcher.threads

    def use_prefetcher(self, on: bool) -> None:
        """Route the layers' block reads through the cache's Prefetcher (on, the
        default when it has loader threads) or straight to the store (off: each read
        is a synchronous miss, counted in `sync_reads()`). For A/B measurements."""
        for layer in self.flash_layers:
            layer.prefetcher = self.prefetcher if on else None
            generation.route_reads(layer)  # rows changed by beam search read through their map

    def sync_reads(self) -> dict[str, float]:
        """Counters of block reads that went straight to the store: misses, stall_s."""
        return dict(self._fetch_counts)

    # ------------------------------------------------------------ reporting
    @property
    def flash_layers(self) -> list[FlashLayer]:
        return [layer for layer in self.layers if isinstance(layer, FlashLayer)]

    def memory_report(self) -> dict[str, Any]:
        """Measured bytes of real tensors per tier, summed over layers, plus tokens seen.

        `device_resident_bytes` counts every tensor the cache keeps on the device:
        the FlashMemory tiers, the working set of selected blocks, plain full
        layers and sliding-window layers, and the copy of each sliding window's oldest tokens
        exact_on_doubt holds at its exact point (`doubt_held_bytes`). `cold_bytes` is what the
        cold tier holds.
        """
        tiers = tier_names.zeros(tier_names.LAYER_TIERS)
        for layer in self.flash_layers:
            if layer.is_initialized:
                for name, nbytes in layer.resident_bytes().items():
                    tiers[name] += nbytes
        full = sliding = 0
        for other in self.layers:
            # plain layers only: DynamicLayer / DynamicSlidingWindowLayer
            if not isinstance(other, DynamicLayer) or not other.is_initialized:
                continue
            nbytes = tensor_bytes(other.keys) + tensor_bytes(other.values)
            if isinstance(other, DynamicSlidingWindowLayer):
                sliding += nbytes
            else:
                full += nbytes
        managed = sum(tiers.values())
        tokens = self.get_seq_length()
        full_cache = self.full_cache_bytes(tokens)
        held = self.doubt.held_bytes(self)
        device = managed + full + sliding + held
        return {
            "tokens_seen": tokens,
            "tiers": tiers,
            "managed_resident_bytes": managed,
            "full_layer_bytes": full,
            "sliding_layer_bytes": sliding,
            "device_resident_bytes": device,
            # what a plain DynamicCache holds for the same tokens, and this cache's share of it
            "full_cache_bytes": full_cache,
            "fraction_of_full": device / full_cache if full_cache else 0.0,
            "tier_fractions": {name: n / full_cache if full_cache else 0.0 for name, n in tiers.items()},
            "peak_managed_resident_bytes": sum(layer.peak_resident_bytes for layer in self.flash_layers),
            "cold_bytes": self.store.nbytes(),
            # host memory beside the cold tier the re-rank reads (lsa_rerank_codec's block codes,
            # lsa_rerank_mirror's key copy): on a CPU the same RAM as the device tiers
            "rerank_host_bytes": sum(layer.ranker.host_nbytes() for layer in self.flash_layers if layer.is_initialized),
            # decode_step: static with an int8 working set: every sealed page coded, in host memory
            # (cache/page_codes.py), what its fixed-size gathers read
            "page_code_host_bytes": sum(
                layer.page_codes.nbytes()
                for layer in self.flash_layers
                if layer.is_initialized and layer.page_codes is not None
            ),
            # attention's keys, values and mask are assembled in buffers this thread's caches
            # share and reuse (a transient like the activations, kept: cache/scratch.py)
            "scratch_bytes": thread_scratch().nbytes(),
            # the streamed exact prompt's largest run in flight and its scores (one layer at a time)
            "prompt_stream_bytes": max(
                (layer.exact.peak_transient_bytes for layer in self.flash_layers if layer.is_initialized), default=0
            ),
            "sealed_blocks": sum(layer.num_sealed for layer in self.flash_layers if layer.is_initialized),
            # exact_on_doubt: one-token forwards whose top-two logit gap was checked, and those run
            # again with every earlier token attended exactly (cache/doubt.py)
            "doubt_steps": self.doubt.counts["steps"],
            "doubt_redone": self.doubt.counts["redone"],
            "doubt_redone_tokens": self.doubt.counts["redone_tokens"],
            # ... near ties left as selected by exact_on_doubt_share's cap, and what the sliding
            # layers keep for a redo beside the live window (their oldest tokens at the point)
            "doubt_capped": self.doubt.counts["capped"],
            "doubt_changed": self.doubt.counts["changed"],  # redone steps whose next token changed
            "doubt_flat": self.doubt.counts["flat"],  # near ties below exact_on_doubt_min_mass: kept
            "doubt_held_bytes": held,
            # decode_step: static: layer steps that ran static (the others eager: a seal, the
            # prompt, a row change, or a store whose arena it cannot read)
            "static_decode_steps": sum(layer.static_steps for layer in self.flash_layers if layer.is_initialized),
            # decode_step: graph: per layer and segment, one capture, then replays (a failed capture
            # leaves its segment static and eager: cache/step_graph.py)
            **{
                f"static_graph_{name}": sum(
                    layer.graph_counts[name] for layer in self.flash_layers if layer.is_initialized
                )
                for name in ("captures", "replays", "failures")
            },
        }

    def full_cache_bytes(self, tokens: int) -> int:
        """K/V bytes a plain DynamicCache holds after `tokens` tokens for this batch (sliding
        layers keep their window)."""
        rows = next((layer.sink_k.shape[0] for layer in self.flash_layers if layer.is_initialized), None)
        rows = rows if rows is not None else (self._guard.batch or 1)
        per = self._full_per_layer_token * rows
        return sum(per * (tokens if cap is None else min(tokens, cap)) for cap in self._full_layer_caps)

    @property
    def traffic(self) -> Traffic:
        """The cache's byte counters (`traffic_report()` reads them)."""
        return self._traffic

    def traffic_report(self) -> dict[str, Any]:
        """Bytes moved per model forward, by path (cache/traffic.py): totals, per decode step,
        per prefill forward and per redo forward (`exact_on_doubt`) medians, beside what a full
        cache reads for the same steps.

        `device_read_bytes`: read from device-resident tiers; `h2d_bytes`: copied from the cold
        tier to the device; `host_read_bytes`: read by compute where the cold tier holds it;
        `disk_read_bytes`: read from disk (prefetch included)."""
        report = self._traffic.report()
        report["layers"] = len(self.layers)
        return report

    def stats(self) -> dict[str, Any]:
        """Cold-tier counters: what attention waited for, and what each tier moved.

        Top level: `hits` / `misses` of block fetches (a hit was prefetched in time;
        with prefetch off every fetch is a synchronous miss), `stall_s` (seconds
        attention waited for blocks), `bytes_read` / `bytes_written` / `puts` /
        `gets` of the store as a whole, `prefetch` (on or off).
        `tiers`: per tier, each with hits, misses, stall_s, bytes_read, bytes_written
        (0 where a tier has no such notion) plus its own counters:
        "prefetch" (the ready buffer: requested, loaded, late, evicted, errors, load_s, ...),
        and the store's tiers ("memory"; "disk"; or "ram" and "disk" for a layered store;
        a disk tier's `read_s` is time spent in pread, `pending_hits` reads served from
        the write queue).
        """
        tiers: dict[str, dict[str, float]] = {}
        # Layers on the CPU with a memory store read it directly (FlashLayer.lazy_initialization).
        pf = self.prefetcher if any(layer.prefetcher is not None for layer in self.flash_layers) else None
        if pf is not None:
            p = pf.stats()
            store_keys = {f"{t}_" for t in self.store.tier_stats()}
            fetch = {k: v for k, v in p.items() if not any(k.startswith(pre) for pre in store_keys)}
        else:
            fetch = {"hits": 0, "misses": self._fetch_counts["misses"], "stall_s": self._fetch_counts["stall_s"]}
        tiers["prefetch"] = {**_ZERO, **fetch}
        for name, st in self.store.tier_stats().items():
            tiers[name] = {**_ZERO, **st}
        s = self.store.stats
        return {
            "prefetch": pf is not None,
            "hits": fetch["hits"],
            "misses": fetch["misses"],
            "stall_s": fetch["stall_s"],
            "puts": s.puts,
            "gets": s.gets,
            "bytes_read": s.bytes_read,
            "bytes_written": s.bytes_written,
            "tiers": tiers,
        }

    # ------------------------------------------------------------ lifecycle
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' per-layer update, refused with one line when the cache is closed,
        was left half-updated by a failed step (whatever raised), is in a step on another
        thread, or is given another batch size."""
        self._guard.enter(int(key_states.shape[0]), layer_idx, self._layer_lengths)
        try:
            if layer_idx == 0:  # a new model forward
                tokens, q = self.get_seq_length(), int(key_states.shape[-2])
                if q == 1 and self._last_forward_tokens > 1 and not self._prompt_end_seen:
                    self.prompt_done()  # generate(): the prompt is in (not again after a verify forward)
                self._last_forward_tokens = q
                self._traffic.begin_step(q, tokens, self.full_cache_bytes(tokens + q))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException as exc:
            self._guard.fail(exc)
            raise
        finally:
            self._guard.leave(layer_idx)

    def prompt_done(self) -> None:
        """The prompt is in (`flashmem.prefill` says so at its end; under generate() the cache's
        first one-token forward after a longer one does): attention's reused buffers,
        sized for a prompt chunk's rows (a tail chunk's mask over its selection: 36.5 MB at 64K on
        the tiny model), are dropped for the decode steps to regrow what one row needs; and with a
        cold tier off RAM, where RAM is what the budget saves, the C heap's free pages go back to
        the OS (cache/host_heap.py): the prompt's freed activations would otherwise stay in the
        RSS (docs/results.md, "The process's RAM with a disk cold tier")."""
        self._prompt_end_seen = True
        thread_scratch().clear()
        if self.cfg.cold_store != "memory":
            release_free_memory()

    # ------------------------------------------------------------ generate() (cache/generation.py)
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest -tokens_to_remove tokens from every layer (assisted and prompt-lookup
        decoding), all or nothing: a crop no managed layer can make is refused with one line, and
        the sealed blocks a crop unseals are read from the cold tier (a read error raises), before
        a layer changes."""
        n = generation.crop_count(tokens_to_remove)
        self.doubt.ids = None  # exact_on_doubt's tokens since its point are not these any more
        unsealed: dict[int, generation.Unsealed | None] = {}
        for layer in self.flash_layers:
            if layer.is_initialized and n:
                generation.check_crop(layer, n)
        for layer in self.flash_layers:
            if layer.is_initialized and n:
                unsealed[id(layer)] = generation.read_unsealed(layer, n)
        for other in self.layers:
            if isinstance(other, FlashLayer):
                generation.crop(other, tokens_to_remove, unsealed.get(id(other)))
            else:  # a plain full or sliding layer (DynamicLayer's crop)
                cast(Any, other).crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._rows_changed()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._rows_changed()

    def _rows_changed(self) -> None:
        """The next step's batch size is the layers' new row count (the guard checks it)."""
        rows = next((layer.sink_k.shape[0] for layer in self.flash_layers if layer.is_initialized), None)
        self._guard.batch = rows
        self.doubt.ids = None  # the tokens since the exact point name the old rows: no point until the next step

    def _layer_lengths(self) -> list[int]:
        """Tokens each layer holds (the guard compares them before every step)."""
        return [int(getattr(layer, "get_seq_length", lambda: 0)()) for layer in self.layers]

    def reset(self) -> None:
        """Start a new sequence: every layer empties, and nothing keyed by (layer, block)
        from the previous sequence (prefetched blocks included) is served to the next."""
        super().reset()
        self._guard.reset()
        self._traffic.reset()
        self.doubt.ids = None

    def close(self) -> None:
        """Stop prefetching, then release the cold tier (its files too, unless the config
        asked to persist). Idempotent; garbage collection does the same. Any later step
        is a one-line ColdStoreError."""
        self._guard.closed = True
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> FlashMemoryCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_layer_shares(cfg: FlashMemoryConfig, n_layers: int) -> None:
    """ConfigError when lsa_layer_shares names a layer the model does not have."""
    shares = cfg.lsa_layer_shares if isinstance(cfg.lsa_layer_shares, dict) else {}
    outside = sorted(i for i in shares if i >= n_layers)
    if outside:
        raise ConfigError(
            f"lsa_layer_shares: layer {outside[0]} is outside the model's {n_layers} layers; "
            f"allowed: 0..{n_layers - 1}"
        )


def _default_store(cfg: FlashMemoryConfig, dtype: torch.dtype) -> ColdStore:
    from flashmem.store import open_store

    return open_store(cfg, dtype=dtype, name="cache")


_ZERO: dict[str, float] = {"hits": 0, "misses": 0, "stall_s": 0.0, "bytes_read": 0, "bytes_written": 0}


def _close_cold_tier(prefetcher: Prefetcher | None, store: ColdStore) -> None:
    """Prefetcher first (its loaders read the store), then the store.

    Garbage collection may run this on a prefetch loader thread, which cannot
    wait for its own pool: then the close runs on a helper thread.
    """
    if threading.current_thread().name.startswith("flashmem-prefetch"):
        threading.Thread(target=_close_cold_tier, args=(prefetcher, store), name="flashmem-close").start()
        return
    try:
        if prefetcher is not None:
            prefetcher.close()
    finally:
        store.close()
