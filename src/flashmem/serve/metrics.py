"""Prometheus metrics of the server (one registry per server, so tests can run several)."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServeMetrics:
    """What `GET /metrics` shows. The engine's worker thread updates it; scrapes read it."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.device_bytes = Gauge(
            "flashmem_device_resident_bytes", "KV bytes the live sequences keep on the device", registry=r
        )
        self.cold_bytes = Gauge("flashmem_cold_bytes", "bytes in the live sequences' cold tiers", registry=r)
        self.prefix_bytes = Gauge("flashmem_prefix_store_bytes", "bytes of stored prefixes on disk", registry=r)
        self.prefix_records = Gauge("flashmem_prefix_store_records", "stored prefix blocks", registry=r)
        self.prefix_hits = Counter("flashmem_prefix_hits", "requests that reused a stored prefix", registry=r)
        self.prefix_misses = Counter("flashmem_prefix_misses", "requests that reused nothing", registry=r)
        self.reused_tokens = Counter(
            "flashmem_prefix_reused_tokens", "prompt tokens restored, not computed", registry=r
        )
        self.prefill_tokens = Counter("flashmem_prefill_tokens", "prompt tokens computed", registry=r)
        self.prefix_evictions = Counter("flashmem_prefix_evictions", "prefix records evicted (quota)", registry=r)
        self.prefix_damaged = Counter(
            "flashmem_prefix_damaged_records",
            "stored prefix records that failed their checksum (never used, removed)",
            registry=r,
        )
        self.prefix_unreachable = Counter(
            "flashmem_prefix_store_unreachable",
            "prefix store calls that could not reach a shared store (served without reuse)",
            registry=r,
        )
        self.cold_stalls = Counter("flashmem_cold_stalls", "cold-tier block reads attention waited for", registry=r)
        self.cold_stall_seconds = Counter(
            "flashmem_cold_stall_seconds", "seconds attention waited for cold-tier blocks", registry=r
        )
        self.ttft = Histogram(
            "flashmem_time_to_first_token_seconds",
            "request arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "flashmem_inter_token_latency_seconds", "time between streamed tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.generated = Counter("flashmem_generated_tokens", "tokens generated", registry=r)
        # how full the batched rounds run: rows per forward = decode_rows / decode_forwards
        self.decode_forwards = Counter(
            "flashmem_decode_forwards", "model forwards that carried decode steps", registry=r
        )
        self.decode_rows = Counter("flashmem_decode_rows", "decode steps in those forwards", registry=r)
        self.decode_seconds = Counter(
            "flashmem_decode_forward_seconds",
            "worker seconds in those forwards (packed prompt chunks, sampling and streaming included)",
            registry=r,
        )
        self.busy_seconds = Counter(
            "flashmem_worker_busy_seconds", "worker seconds in rounds (admission, prompts, decode steps)", registry=r
        )
        self.tokens_per_s = Gauge("flashmem_tokens_per_second", "generated tokens/s over the last 10 s", registry=r)
        self.active = Gauge("flashmem_active_sequences", "sequences being prefilled or decoded", registry=r)
        self.queued = Gauge("flashmem_queued_requests", "requests waiting for a slot", registry=r)
        self.requests = Counter("flashmem_requests", "finished requests by outcome", ["outcome"], registry=r)
        self._recent: deque[float] = deque()
        self._lock = threading.Lock()

    def token(self) -> None:
        """One generated token (for the counter and the 10 s rate)."""
        now = time.monotonic()
        self.generated.inc()
        with self._lock:
            self._recent.append(now)

    def render(self) -> bytes:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0] < now - 10.0:
                self._recent.popleft()
            self.tokens_per_s.set(len(self._recent) / 10.0)
        return generate_latest(self.registry)
