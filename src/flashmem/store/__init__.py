"""Cold tier: where exact (or int8/int4-coded) K/V of sealed blocks live.

store = open_store(cfg, dtype=torch.bfloat16, name="cache")   # memory | disk | layered | lmdb
store.put((layer, block), k, v)          # k, v: [batch, kv_heads, B, head_dim]
k, v = store.get((layer, block), device)
pf = open_prefetcher(cfg, store)          # background loads for the next steps
pf.request(keys); k, v = pf.get(key, device); pf.stats()
"""

from __future__ import annotations

from typing import Any

import torch

from flashmem import policies
from flashmem.config import FlashMemoryConfig
from flashmem.store.base import BlockKey, ColdStore, StoreStats
from flashmem.store.codecs import get_codec
from flashmem.store.disk import DiskStore
from flashmem.store.layered import LayeredStore
from flashmem.store.memory import MemoryStore
from flashmem.store.page_sums import SUM_TOKENS
from flashmem.store.prefetch import Prefetcher


def open_store(cfg: FlashMemoryConfig, *, dtype: torch.dtype, name: str | None = None) -> ColdStore:
    """The cold store `cfg` asks for (cold_store, cold_dir, cold_codec, cold_ram_bytes, persist).

    Disk, layered and lmdb stores create their own folder `<cold_dir>/<name>-<pid>-<uuid>`;
    ColdStoreError (one line) when cold_dir cannot be used.
    """
    get_codec(cfg.cold_codec)
    opener = policies.load(policies.lookup(policies.COLD_STORES, "cold_store", cfg.cold_store).impl)
    return opener(cfg, dtype=dtype, name=name)


# Openers named by flashmem.policies.COLD_STORES: (cfg, dtype, name) -> ColdStore.
def open_memory(cfg: FlashMemoryConfig, *, dtype: torch.dtype, name: str | None = None) -> ColdStore:
    return MemoryStore(codec=cfg.cold_codec)


def open_disk(cfg: FlashMemoryConfig, *, dtype: torch.dtype, name: str | None = None) -> DiskStore:
    # checksummed units of a page where it is whole units of at least 4 tokens (page reads check
    # one sum a page: a quarter of the RAM of 4-token units with 16-token pages), else of 4
    unit = cfg.page_tokens if cfg.page_tokens % SUM_TOKENS == 0 else SUM_TOKENS
    return DiskStore(**_on_disk(cfg, dtype, name), unit_tokens=unit)


def open_layered(cfg: FlashMemoryConfig, *, dtype: torch.dtype, name: str | None = None) -> LayeredStore:
    return LayeredStore(open_disk(cfg, dtype=dtype, name=name), ram_bytes=cfg.cold_ram_bytes)


def open_lmdb(cfg: FlashMemoryConfig, *, dtype: torch.dtype, name: str | None = None) -> ColdStore:
    from flashmem.store.lmdb_store import LmdbStore  # imported only when chosen

    return LmdbStore(**_on_disk(cfg, dtype, name))


def _on_disk(cfg: FlashMemoryConfig, dtype: torch.dtype, name: str | None) -> dict[str, Any]:
    """The keywords a disk or LMDB cold tier opens with (`OnDiskStore`)."""
    assert cfg.cold_dir is not None  # the config validator requires it
    return {
        "cold_dir": cfg.cold_dir,
        "codec": cfg.cold_codec,
        "dtype": dtype,
        "name": name,
        "persist": cfg.persist,
        "max_pending_bytes": cfg.cold_pending_mb << 20,
    }


def open_prefetcher(cfg: FlashMemoryConfig, store: ColdStore, device_type: str = "cpu") -> Prefetcher:
    """A Prefetcher with cfg's loader threads for a model on `device_type` (0: synchronous loads;
    `FlashMemoryConfig.prefetch_threads_on`)."""
    return Prefetcher(store, cfg.prefetch_threads_on(device_type))


__all__ = [
    "BlockKey",
    "ColdStore",
    "DiskStore",
    "LayeredStore",
    "MemoryStore",
    "Prefetcher",
    "StoreStats",
    "open_prefetcher",
    "open_store",
]
