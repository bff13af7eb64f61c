"""Prefix records on a Valkey/Redis server, shared by every replica that points at it.

`flashmem serve --prefix-store redis://HOST:PORT[/DB]` keeps the records of
`flashmem.serve.prefix` on a server instead of a local folder, so N replicas
(one machine or several) reuse each other's documents. What stays the same:

- keys: the hash chain of `prefix.chain` (model, config, tenant salt and every
  token of the prefix are in the key), stored as `fmprefix:<h_j>`;
- bytes: the record of `prefix.encode_record` (magic, xxh3-128 digest, then
  safetensors whose metadata names the key and codec; K/V pairs coded as
  cold-tier blocks, `int8` by default). A value that fails
  `prefix.decode_record` (garbage, truncation, another key's record, another
  codec's, a format 1 record of full fp32 copies) is never used: it ends the
  reuse there, is counted (`damaged`) and deleted.

What differs, and why:

- Quota and LRU are the server's: at open the store sets `maxmemory` to the
  quota and `maxmemory-policy allkeys-lru` unless the operator already chose a
  limit and an evicting policy (then those stay). A server that refuses
  `CONFIG SET` (managed services) keeps its own settings; a warning says so.
  The quota is the server's, for everything in it: give the prefix tier its own
  server. Every key also has a TTL (`ttl_s`, refreshed on each hit), so records
  of a model nobody serves any more leave even without memory pressure.
- No pins: the server's LRU does not know which records live sequences build
  on. Evicting a parent makes its descendants unreachable: it costs reuse, never
  an answer (a record is only used behind an unbroken run of its parents).
- The server may be down. Every call has a short timeout (`timeout_s`); a
  failed call makes the store skip the server for `retry_s` seconds. Meanwhile
  lookups are misses and saves are dropped: the request is served without
  reuse, and `unreachable` counts the calls that could not reach the server
  (/metrics: `flashmem_prefix_store_unreachable_total`). Nothing raises.
- The records encode users' prompts: on a shared network give the server a
  password (`redis://:PASSWORD@HOST:PORT`, or `$FLASHMEM_PREFIX_STORE_PASSWORD`
  to keep it off the command line) and TLS (`rediss://`); messages never show it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import torch

from flashmem.errors import FlashMemError
from flashmem.serve.prefix import DEFAULT_CODEC, DamagedRecordError, check_codec, decode_record, encode_record

log = logging.getLogger(__name__)

NAMESPACE = "fmprefix:"
DEFAULT_TTL_S = 7 * 24 * 3600
T = TypeVar("T")


@dataclass(frozen=True)
class StoreURL:
    """A parsed `--prefix-store` URL (the password never printed: `shown`)."""

    host: str
    port: int
    db: int
    password: str | None
    tls: bool

    @property
    def shown(self) -> str:
        auth = ":***@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}{self.host}:{self.port}/{self.db}"


def parse_url(url: str) -> StoreURL:
    """`redis://[:PASSWORD@]HOST:PORT[/DB]` (`rediss://` for TLS) -> StoreURL; FlashMemError naming
    what is allowed otherwise. Without one in the URL, `$FLASHMEM_PREFIX_STORE_PASSWORD` is the password."""
    allowed = "allowed: redis://[:PASSWORD@]HOST:PORT[/DB] or rediss://..., e.g. redis://127.0.0.1:6379/0"
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        parts, port = None, None
    shown = re.sub(r"//[^@/]*@", "//***@", url)  # no password in messages
    if (
        parts is None
        or parts.scheme not in ("redis", "rediss")
        or not parts.hostname
        or port is None
        or parts.query
        or parts.fragment
    ):
        raise FlashMemError(f"--prefix-store {shown!r} is not a store URL; {allowed}")
    path = parts.path.strip("/")
    if path and not (path.isdigit() and int(path) < 16):
        raise FlashMemError(f"--prefix-store {shown!r}: database {path!r} is not a number 0-15; {allowed}")
    password = unquote(parts.password) if parts.password else os.environ.get("FLASHMEM_PREFIX_STORE_PASSWORD")
    return StoreURL(parts.hostname, port, int(path or 0), password or None, parts.scheme == "rediss")


class RedisPrefixStore:
    """The `prefix.PrefixStore` interface on a Valkey/Redis server (see the module docstring)."""

    def __init__(
        self,
        url: str,
        quota_bytes: int | None = None,
        *,
        ttl_s: int = DEFAULT_TTL_S,
        timeout_s: float = 1.0,
        retry_s: float = 5.0,
        stats_every_s: float = 2.0,
        codec: str = DEFAULT_CODEC,
    ) -> None:
        """codec: the cold-tier codec of the records' K/V pairs (`prefix.PrefixStore`'s)."""
        self.codec = check_codec(codec)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise FlashMemError(
                f"--prefix-store needs the serve extra ({exc.name} is missing): pip install torch==2.13.0 -e '.[serve]'"
            ) from None
        where = parse_url(url)
        self.root = where.shown  # the store's place in messages (no password)
        self.quota_bytes = quota_bytes
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.stats_every_s = stats_every_s
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._client = redis.Redis(
            host=where.host,
            port=where.port,
            db=where.db,
            password=where.password,
            ssl=where.tls,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # one try: a down store is skipped for retry_s, not retried inline
            health_check_interval=0,
        )
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._stats = (0, 0)  # (bytes, records) as last read
        self._stats_at = -1e9
        self.evictions = 0  # the server evicts; it does not tell this replica which
        self.damaged = 0  # records that failed their check (deleted)
        self.unreachable = 0  # calls that could not reach the server (failed, or skipped while it was down)
        self.dropped = 0  # records not saved because the server was unreachable
        self._configured = False
        self._configure()

    # ---------------------------------------------------------------- server
    def _call(self, what: str, fn: Callable[[], T], default: T) -> T:
        """fn() against the server, or `default` (counted) when it is down or fails."""
        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                self.unreachable += 1
                return default
        try:
            return fn()
        except self._errors as exc:
            with self._lock:
                self.unreachable += 1
                first = self._down_until == 0.0 or now >= self._down_until + self.retry_s
                self._down_until = time.monotonic() + self.retry_s
            if first:
                log.warning("prefix store %s unreachable (%s: %s); serving without reuse", self.root, what, exc)
            return default

    def _configure(self) -> None:
        """Quota and LRU on the server (module docstring). A server that cannot be reached is
        configured by the first save that reaches it; one that refuses is left as it is."""
        if self._configured or self.quota_bytes is None:
            self._configured = True
            return
        import redis

        try:
            cur = self._client.config_get("maxmemory*")
            limit = int(cur.get("maxmemory", 0) or 0)
            if not limit or cur.get("maxmemory-policy") == "noeviction":
                self._client.config_set("maxmemory-policy", "allkeys-lru")
                self._client.config_set("maxmemory", str(self.quota_bytes))
            # else the operator's settings (every key has a TTL: volatile-* policies evict them too)
            self._configured = True
        except redis.ResponseError as exc:  # CONFIG refused (managed services): the server's settings apply
            self._configured = True
            log.warning("prefix store %s: maxmemory and allkeys-lru not set (%s)", self.root, exc)
        except self._errors as exc:
            log.warning("prefix store %s unreachable (%s); quota set when it answers", self.root, exc)

    # ---------------------------------------------------------------- queries
    def __contains__(self, key: str) -> bool:
        """Whether a record of `key` is on the server (False when it is unreachable)."""
        return bool(self._call("exists", lambda: self._client.exists(NAMESPACE + key), 0))

    def longest(self, keys: list[str]) -> int:
        """How many leading keys of a chain are on the server (`load` checks their bytes)."""
        if not keys:
            return 0

        def run() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(NAMESPACE + k)
            return list(pipe.execute())

        found: list[int] = self._call("exists", run, [])
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def nbytes(self) -> int:
        return self._read_stats()[0]

    def __len__(self) -> int:
        return self._read_stats()[1]

    def _read_stats(self) -> tuple[int, int]:
        """(used_memory, keys in the DB), read at most every `stats_every_s` (the worker asks every round)."""
        now = time.monotonic()
        if now - self._stats_at >= self.stats_every_s:
            self._stats_at = now

            def run() -> tuple[int, int]:
                mem = self._client.info("memory")
                return int(mem.get("used_memory", 0)), int(self._client.dbsize())

            self._stats = self._call("info", run, self._stats)
        return self._stats

    # ---------------------------------------------------------------- records
    def load(self, keys: list[str]) -> list[dict[str, torch.Tensor]]:
        """The records of the longest leading run of `keys` that are on the server and check
        out. A missing one ends the run; a damaged one ends it too, is counted and deleted.
        The used records' TTLs are refreshed (a GET already refreshes the server's LRU clock)."""
        if not keys:
            return []
        values: list[Any] | None = self._call("mget", lambda: self._client.mget([NAMESPACE + k for k in keys]), None)
        if not values:
            return []
        out = []
        for k, data in zip(keys, values, strict=True):
            if data is None:
                break
            try:
                out.append(decode_record(k, bytes(data), self.codec))
            except DamagedRecordError as exc:
                with self._lock:
                    self.damaged += 1
                log.warning("prefix store %s: record %s not used (%s); deleted", self.root, k[:12], exc)
                self._delete(k)
                break
        if out:

            def refresh() -> None:
                pipe = self._client.pipeline(transaction=False)
                for k in keys[: len(out)]:
                    pipe.expire(NAMESPACE + k, self.ttl_s)
                pipe.execute()

            self._call("expire", refresh, None)
        return out

    def save(self, key: str, parent: str, record: dict[str, torch.Tensor], *, pin: bool = False) -> None:
        """Write a record (one SET with its TTL; `pin` has no meaning here). Dropped, counted, when
        the server is unreachable or refuses it: that costs reuse, never the request."""
        with self._lock:
            down = time.monotonic() < self._down_until
            if down:
                self.unreachable += 1
                self.dropped += 1
        if down:
            return  # not even encoded
        if not self._configured:
            self._configure()
        data = encode_record(key, parent, record, self.codec)
        ok: Any = self._call("set", lambda: self._client.set(NAMESPACE + key, data, ex=self.ttl_s), None)
        if not ok:
            with self._lock:
                self.dropped += 1

    def _delete(self, key: str) -> None:
        self._call("delete", lambda: int(self._client.delete(NAMESPACE + key)), 0)

    def pin(self, keys: list[str]) -> None:
        """No pins on a shared server (module docstring)."""

    def unpin(self, keys: list[str]) -> None:
        """No pins on a shared server (module docstring)."""

    def evict(self) -> int:
        """The server evicts (allkeys-lru under maxmemory); nothing to do here."""
        return 0

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass
