"""The scheduler: one worker thread runs every model forward, fairly across sequences.

Each sequence has its own FlashMemoryCache. A round gives every live sequence
one unit of work: a prefill chunk of `block_tokens` prompt tokens, or one decode
step, so a long prefill delays the other streams by one chunk per round, never
for its whole duration. Continuous batching: the units of a round run in one
model forward over a `BatchedCache` (cache/batched.py) of the sequences' caches,
up to `max_batch` rows (1: one forward per sequence), so the weights are read
once per round, not once per sequence; each row attends over its own cache, with
its own positions, tiers and selection, exactly as alone. The rows' tokens are
packed into one sequence (no padding), so a prompt chunk and 1-token decode
steps share a forward (`pack_prefill`, the default): on a CPU the linear layers
cost about as much for 8 tokens as for 48, so a new request's first chunk rides
along the round instead of adding its own forward. Sequences join when admitted
and leave when they finish, between forwards.

Admission (cache creation and prefix restore) runs off the worker thread when
`restore_off_thread` (the default): a restore prepares the new sequence's cache
on a helper thread, and the worker swaps it in between rounds, so the other
streams keep decoding while stored records are read, checked and imported.

Prefix reuse (flashmem.serve.prefix): before its prefill, a sequence looks up
the hash chain of its prompt's full prefix blocks, restores the longest stored
run of them and prefills only the rest; each full block it computes is stored
for later requests. With `end_records` (the default whenever there is a store)
the prompt's chunk that holds its end point (`prefix.end_point`: END_TAIL tokens
before its end, past its last full block) stops there, and the state there is
stored too, under `prefix.end_key` (its parent block's key, the tokens since, the
tenant salt): the same prompt again restores every block and that end record and
runs its last END_TAIL tokens only, instead of up to a whole block. The prompt
always runs in the same chunks (block-aligned from position 0, the chunk with
the end point split there), cold or reused, so a restored prefix continues
exactly as a fresh prefill.

Admission: at most `max_concurrent` live sequences; up to `max_queue` more wait
for a slot in arrival order; beyond that `submit` raises QueueFullError (HTTP 429).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from flashmem.cache import batched
from flashmem.config import FlashMemoryConfig
from flashmem.errors import FlashMemError
from flashmem.models.weight_layout import linear_layout
from flashmem.serve import state
from flashmem.serve.metrics import ServeMetrics
from flashmem.serve.prefix import PrefixBackend, chain, end_key, end_point

log = logging.getLogger("flashmem.serve")


GAUGE_S = 0.5  # seconds between updates of the memory and prefix-store gauges


class QueueFullError(FlashMemError):
    """Every slot and every queue place is taken."""


@dataclass
class Sampling:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0  # OpenAI's: minus this from every token generated so far
    frequency_penalty: float = 0.0  # minus this times how often each token was generated
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # vLLM's extensions: EOS and stop strings cannot end the answer before min_tokens tokens;
    # ignore_eos: EOS is a token like any other, the answer ends at a stop string or the length
    min_tokens: int = 0
    ignore_eos: bool = False


@dataclass
class Event:
    """What the worker tells a request: new text, or the end (finish_reason set), or an error."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class Sequence:
    """One request's generation. The app reads `events`; the worker fills it."""

    def __init__(
        self, prompt_ids: list[int], sampling: Sampling, salt: str, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.salt = salt
        self.loop = loop
        self.events: asyncio.Queue[Event] | None = asyncio.Queue() if loop is not None else None
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.cache: Any = None
        self.pos = 0  # prompt tokens in the cache
        self.generated: list[int] = []
        self.sent_chars = 0
        self.stop_from = 0  # stop strings are looked for from this character of the text (min_tokens)
        self.keys: list[str] = []  # hash chain of the prompt's storable prefix blocks
        self.end_at = 0  # where its end record is (prefix.end_point; 0: none)
        self.end_key: str | None = None  # that record's key (prefix.end_key)
        self.pinned: list[str] = []
        self.mark: state.Mark | None = None
        self.reused_tokens = 0
        self.finish_reason: str | None = None
        self.next_logits: torch.Tensor | None = None
        self.record_logits = 0  # tests: keep the logits of the first n generated tokens
        self.logits: list[torch.Tensor] = []
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.token_times: list[float] = []  # when each token was emitted (benchmarks: the gaps)
        self.generator: torch.Generator | None = None
        if sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling.seed)

    def cancel(self) -> None:
        """The client went away: the worker frees the sequence at its next round."""
        self.cancelled.set()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class Engine:
    """Owns the model; runs sequences on one worker thread (`start`, `stop`)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        cfg: FlashMemoryConfig,
        *,
        model_name: str = "model",
        prefix_store: PrefixBackend | None = None,
        max_concurrent: int = 4,
        max_queue: int = 16,
        max_context: int | None = None,
        block_tokens: int | None = None,
        metrics: ServeMetrics | None = None,
        max_batch: int | None = None,
        restore_off_thread: bool = True,
        end_records: bool = True,
        pack_prefill: bool = True,
    ) -> None:
        """max_batch: decode steps per model forward (default max_concurrent; 1: one forward
        per sequence). restore_off_thread: with a prefix store, admit (create the cache,
        restore a stored prefix) on a helper thread, swapped in between rounds (without one,
        admissions are inline: nothing to restore). end_records: with a prefix store, also
        store each prompt's state END_TAIL tokens before its end (module docstring; False:
        full blocks only, as before, for benchmarks that measure the difference).
        pack_prefill: with max_batch > 1, a round's prompt chunks share the decode steps'
        forwards, every row's tokens packed (False: one forward per chunk, as before)."""
        import flashmem

        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.model_name = model_name
        self.prefix_store = prefix_store
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        if max_batch is not None and max_batch < 1:
            raise FlashMemError(f"max_batch {max_batch}: allowed: 1 (one forward per sequence) or more")
        self.max_batch = max_batch or max_concurrent
        if cfg.exact_on_doubt and self.max_batch > 1:  # its redo undoes one cache's whole forward
            raise FlashMemError(
                f"exact_on_doubt {cfg.exact_on_doubt} redoes one sequence's forward, and max_batch "
                f"{self.max_batch} batches sequences into one; allowed: max_batch 1 with exact_on_doubt, or exact_on_doubt: 0"
            )
        self.restore_off_thread = restore_off_thread
        self.pack_prefill = pack_prefill and self.max_batch > 1
        self.end_records = end_records
        self.metrics = metrics or ServeMetrics()
        B = cfg.hca_chunk_size
        self.block_tokens = block_tokens or max(B, (cfg.prefill_chunk // B) * B)
        if self.block_tokens % B:
            raise FlashMemError(f"prefix block of {self.block_tokens} tokens is not a multiple of the block size {B}")
        text_cfg = model.config.get_text_config(decoder=True)
        limit = getattr(text_cfg, "max_position_embeddings", None) or 1 << 20
        self.max_context = min(max_context or limit, limit)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.fingerprint = _fingerprint(model, cfg, model_name, self.block_tokens)
        flashmem.attach(model, cfg).close()  # switch attention once, fail early on a bad config
        self._attach = flashmem.attach
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._evictions_seen = 0  # the store's eviction count already added to the metric
        self._damaged_seen = 0  # the same for records that failed their check
        self._unreachable_seen = 0  # the same for calls that could not reach a shared store
        self._counters_lock = threading.Lock()  # the admit thread and the worker both add them
        # Sequences being admitted on the helper thread, and those ready to join (under _cv).
        self._admitting = 0
        self._ready: list[Sequence] = []
        self._admitter: concurrent.futures.ThreadPoolExecutor | None = None
        # What the rounds did (tests and benchmarks): decode forwards, rows in them, and
        # the longest time the worker spent admitting in one round (restores on the worker).
        self.decode_forwards = 0
        self.decode_rows = 0
        self.packed_chunks = 0  # prompt chunks that shared a forward with other rows (pack_prefill)
        self.max_admit_s = 0.0
        self._gauges_at = 0.0  # when the memory and store gauges were last updated

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flashmem-serve-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        if self._admitter is not None:
            self._admitter.shutdown(wait=True)
            self._admitter = None
        with self._cv:
            ready, self._ready = self._ready, []
        for seq in ready:
            self._finish(seq, "cancelled", error="server shutting down")

    # ------------------------------------------------------------ requests
    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; QueueFullError when the queue is full too."""
        with self._cv:
            free = max(0, self.max_concurrent - self._live())
            if len(self._waiting) >= self.max_queue + free:
                raise QueueFullError(
                    f"server busy: {self.max_concurrent} sequences running and {self.max_queue} waiting; retry later"
                )
            self._waiting.append(seq)
            self.metrics.queued.set(len(self._waiting))
            self._cv.notify_all()

    def run_sync(self, seq: Sequence) -> Sequence:
        """Run one sequence to the end on this thread (tests and scripts, no server)."""
        self._admit(seq)
        while not seq.done.is_set():
            self._unit(seq)
        return seq

    @property
    def active(self) -> int:
        """Live sequences: generating, or being admitted."""
        with self._cv:
            return self._live()

    def _live(self) -> int:
        return len(self._active) + self._admitting + len(self._ready)

    # ------------------------------------------------------------ worker
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._stop and not self._work_now():
                    self._cv.wait()
                if self._stop:
                    break
            self.step()
        if self._admitter is not None:
            self._admitter.shutdown(wait=True)
        with self._cv:
            ready, self._ready = self._ready, []
        for seq in self._active + ready + list(self._waiting):
            self._finish(seq, "cancelled", error="server shutting down")

    def _work_now(self) -> bool:
        """(under _cv) Whether a round has something to do: a live or ready sequence, or a
        waiting one with a free slot (a slot taken by an admission in flight is not free)."""
        return bool(self._active or self._ready or (self._waiting and self._live() < self.max_concurrent))

    def step(self) -> None:
        """One round: admit from the queue, take in the sequences admitted since, then one
        unit of every live sequence (a prefill chunk each; every decode step in one forward)."""
        t_round = time.perf_counter()
        try:
            self._round()
        finally:
            self.metrics.busy_seconds.inc(time.perf_counter() - t_round)

    def _round(self) -> None:
        # Off the worker thread only where a restore may be slow: without a prefix store an
        # admission is a cache's attach (about 1 ms), and admitted here its prompt joins this
        # round instead of the next (a round of TTFT saved).
        off_thread = self.restore_off_thread and self.prefix_store is not None
        with self._cv:
            admit: list[Sequence] = []
            while self._waiting and self._live() + len(admit) < self.max_concurrent:
                admit.append(self._waiting.popleft())
            self.metrics.queued.set(len(self._waiting))
            if off_thread:
                self._admitting += len(admit)
        t0 = time.perf_counter()
        for seq in admit:
            if off_thread:
                if self._admitter is None:
                    self._admitter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flashmem-serve-admit")
                self._admitter.submit(self._admit_off_thread, seq)
            elif seq.cancelled.is_set():
                self._finish(seq, "cancelled")
            else:
                self._admit(seq)
                if not seq.done.is_set():
                    self._active.append(seq)
        self.max_admit_s = max(self.max_admit_s, time.perf_counter() - t0)
        with self._cv:  # the swap: prepared caches join between rounds
            ready, self._ready = self._ready, []
        self._active.extend(s for s in ready if not s.done.is_set())
        if self.pack_prefill:  # prompt chunks and decode steps in the same forwards
            self._decode(list(self._active))
        else:
            decoding = [s for s in self._active if s.pos >= s.prompt_tokens and s.generated]
            for seq in self._active:
                if seq not in decoding:
                    self._unit(seq)
            self._decode(decoding)
        self._active = [s for s in self._active if not s.done.is_set()]
        self._gauges()

    def _admit_off_thread(self, seq: Sequence) -> None:
        """On the helper thread: admit `seq` (its cache is nobody else's yet), then hand it
        to the worker's next round."""
        try:
            if seq.cancelled.is_set():
                self._finish(seq, "cancelled")
            else:
                torch.set_grad_enabled(False)
                self._admit(seq)
        finally:
            with self._cv:
                self._admitting -= 1
                self._ready.append(seq)
                self._cv.notify_all()

    def wait_admitted(self, timeout: float = 60.0) -> bool:
        """Wait until no admission is in flight (tests and scripts that drive `step`)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._admitting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def _admit(self, seq: Sequence) -> None:
        """Give the sequence a cache; restore the longest stored prefix of its prompt (its full
        blocks, then its end record when every block before it was restored)."""
        try:
            seq.cache = self._attach(self.model, self.cfg)
            C, n = self.block_tokens, seq.prompt_tokens
            store = self.prefix_store
            if store is not None:
                # Blocks that end before the last prompt token: that token must run to give logits.
                seq.keys = chain(seq.prompt_ids, C, self.fingerprint, seq.salt, limit=(n - 1) // C)
                full = len(seq.keys)
                want = list(seq.keys)
                seq.end_at = end_point(n, C) if self.end_records else 0
                if seq.end_at:  # the end record follows the last full block in the chain
                    parent = seq.keys[-1] if full else ""
                    seq.end_key = end_key(parent, seq.prompt_ids[full * C : seq.end_at], self.fingerprint, seq.salt)
                    want.append(seq.end_key)
                hit = store.longest(want)
                # The records that are there and pass their checks: a gone or damaged one
                # ends the reuse there (it is removed; the prefill writes it again).
                records = store.load(want[:hit]) if hit else []
                hit = len(records)
                self._store_counters()
                store.pin(want[:hit])
                seq.pinned = want[:hit]
                if hit:
                    state.import_records(seq.cache, records)
                    seq.pos = seq.reused_tokens = seq.end_at if hit > full else hit * C
                    self.metrics.prefix_hits.inc()
                    self.metrics.reused_tokens.inc(seq.reused_tokens)
                else:
                    self.metrics.prefix_misses.inc()
            seq.mark = state.mark(seq.cache)
        except Exception as exc:  # noqa: BLE001 - one request fails, the server lives
            log.exception("admitting a sequence failed")
            self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")

    def _unit(self, seq: Sequence) -> None:
        """One prefill chunk or one decode step of `seq`."""
        if seq.done.is_set():
            return
        if seq.cancelled.is_set():
            self._finish(seq, "cancelled")
            return
        try:
            if seq.pos < seq.prompt_tokens:
                self._prefill_chunk(seq)
            else:
                self._decode_step(seq)
        except Exception as exc:  # noqa: BLE001 - one request fails, the server lives
            log.exception("a step failed")
            self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")

    def _forward(self, seq: Sequence, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), cache=seq.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def _prefill_chunk(self, seq: Sequence) -> None:
        """The next prompt chunk: up to block_tokens, block-aligned, stopping at the end point;
        the state at a full block's end or at the end point is stored (when not yet)."""
        e = self._chunk_end(seq)
        self._prefilled(seq, e, self._forward(seq, seq.prompt_ids[seq.pos : e]))

    def _chunk_end(self, seq: Sequence) -> int:
        """Where the next prompt chunk of `seq` ends: block_tokens on, block-aligned, or at
        its end point (never a block's end: end_point lies past the last one)."""
        e = min(seq.pos + self.block_tokens, seq.prompt_tokens)
        return seq.end_at if seq.pos < seq.end_at < e else e

    def _prefilled(self, seq: Sequence, e: int, logits: torch.Tensor) -> None:
        """After the chunk [seq.pos, e) ran: store the prefix record it completed, emit the
        first token when the prompt is done."""
        C = self.block_tokens
        a = seq.pos
        at_end = e == seq.end_at
        seq.pos = e
        self.metrics.prefill_tokens.inc(e - a)
        j = e // C - 1  # the prefix block this chunk completed, if it is a full one
        store = self.prefix_store
        if store is not None and seq.mark is not None:
            if e % C == 0 and 0 <= j < len(seq.keys):
                self._save(seq, seq.keys[j], seq.keys[j - 1] if j else "")
            elif at_end and seq.end_key is not None:
                self._save(seq, seq.end_key, seq.keys[-1] if seq.keys else "")
        seq.mark = state.mark(seq.cache) if store is not None else None
        if seq.pos == seq.prompt_tokens:
            seq.next_logits = logits
            self._emit(seq)

    def _save(self, seq: Sequence, key: str, parent: str) -> None:
        """Store what the cache gained since seq.mark under `key` (pinned while seq lives)."""
        store = self.prefix_store
        assert store is not None and seq.mark is not None
        if key in store:
            return
        try:
            record = state.export_delta(seq.cache, seq.mark)
            store.save(key, parent, record, pin=True)
            seq.pinned.append(key)
        except FlashMemError as exc:  # a full disk costs reuse, not the request
            log.warning("prefix not stored: %s", exc)

    def _decode_step(self, seq: Sequence) -> None:
        seq.next_logits = self._forward(seq, [seq.generated[-1]])
        self._emit(seq)

    def _decode(self, seqs: list[Sequence]) -> None:
        """One unit of every sequence in `seqs` (a decode step, or a prompt chunk when
        `pack_prefill`): up to max_batch per forward, their tokens packed."""
        live = []
        for seq in seqs:
            if seq.cancelled.is_set():
                self._finish(seq, "cancelled")
            elif not seq.done.is_set():
                live.append(seq)
        for a in range(0, len(live), self.max_batch):
            group = live[a : a + self.max_batch]
            decoding = sum(1 for s in group if s.pos >= s.prompt_tokens)
            t0 = time.perf_counter()
            if len(group) == 1:
                self._unit(group[0])  # the plain path: no batch to build
            else:
                self._decode_batch(group)
            if decoding:
                self.decode_forwards += 1
                self.decode_rows += decoding
                self.metrics.decode_forwards.inc()
                self.metrics.decode_rows.inc(decoding)
                self.metrics.decode_seconds.inc(time.perf_counter() - t0)

    def _decode_batch(self, group: list[Sequence]) -> None:
        """One forward of the group's next tokens (a prompt chunk or a decode step each);
        a row that fails fails its request only."""
        ends = [self._chunk_end(s) if s.pos < s.prompt_tokens else 0 for s in group]
        tokens = [s.prompt_ids[s.pos : e] if e else [s.generated[-1]] for s, e in zip(group, ends)]
        self.packed_chunks += sum(1 for e in ends if e)
        try:
            batch = batched.BatchedCache([s.cache for s in group])
            logits = batched.forward(self.model, batch, tokens)
        except Exception as exc:  # noqa: BLE001 - the forward itself failed: every row's cache is unusable
            log.exception("a batched step failed")
            for seq in group:
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
            return
        for r, (seq, e) in enumerate(zip(group, ends)):
            out = logits[r]
            if out is None:
                why = batch.failures[r]
                log.error("a step failed: %s: %s", type(why).__name__, why)
                self._finish(seq, "error", error=f"{type(why).__name__}: {why}")
                continue
            try:
                if e:
                    self._prefilled(seq, e, out)
                else:
                    seq.next_logits = out
                    self._emit(seq)
            except Exception as exc:  # noqa: BLE001 - one request fails, the server lives
                log.exception("a step failed")
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")

    def _emit(self, seq: Sequence) -> None:
        """Sample from next_logits, send the new text, finish on EOS, stop or length."""
        logits = seq.next_logits
        assert logits is not None
        if len(seq.logits) < seq.record_logits:
            seq.logits.append(logits.clone())
        s = seq.sampling
        tok = _sample(process_logits(logits, s, seq.generated, self.eos_ids), s, seq.generator)
        now = time.perf_counter()
        if seq.t_first is None:
            seq.t_first = now
            self.metrics.ttft.observe(now - seq.t_submit)
        elif seq.t_last is not None:
            self.metrics.itl.observe(now - seq.t_last)
        seq.t_last = now
        seq.token_times.append(now)
        self.metrics.token()
        finish = None
        ends = tok in self.eos_ids and not s.ignore_eos
        if ends:
            finish = "stop"
        else:
            seq.generated.append(tok)
        text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        stops = s.stop
        if stops and len(seq.generated) < s.min_tokens:
            seq.stop_from = len(text)  # a stop string counts once it ends past the first min_tokens tokens
        else:
            found = (text.find(t, max(0, seq.stop_from - len(t) + 1)) for t in stops)
            cut = min((i for i in found if i >= 0), default=-1)
            if cut >= 0:
                text, finish = text[:cut], "stop"
        if finish is None and len(seq.generated) >= s.max_tokens:
            finish = "length"
        if finish is None and seq.pos + len(seq.generated) >= self.max_context:
            finish = "length"
        # Hold back an unfinished UTF-8 character and what could be the start of a stop string.
        hold = 0 if finish else max([len(t) - 1 for t in stops] + [0])
        ready = len(text) - hold
        if not finish:
            while ready > seq.sent_chars and text[ready - 1] == "\ufffd":
                ready -= 1
        if ready > seq.sent_chars:
            self._send(seq, Event(text=text[seq.sent_chars : ready], token_ids=[] if ends else [tok]))
            seq.sent_chars = ready
        if finish:
            self._finish(seq, finish)

    def _send(self, seq: Sequence, event: Event) -> None:
        if seq.loop is not None and seq.events is not None:
            try:
                seq.loop.call_soon_threadsafe(seq.events.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody listens any more
                seq.cancel()

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Free the sequence's cache and pins at once; tell the request."""
        if seq.done.is_set():
            return
        seq.finish_reason = reason
        cache, seq.cache = seq.cache, None
        if cache is not None:
            try:
                st = cache.stats()
                self.metrics.cold_stalls.inc(st["misses"])
                self.metrics.cold_stall_seconds.inc(st["stall_s"])
            except Exception:  # noqa: BLE001 - stats of a failed cache are best effort
                pass
            cache.close()
        if self.prefix_store is not None and seq.pinned:
            self.prefix_store.unpin(seq.pinned)
            seq.pinned = []
        self.metrics.requests.labels(outcome=reason).inc()
        seq.done.set()
        self._send(seq, Event(finish_reason=reason, error=error))

    def _gauges(self) -> None:
        m = self.metrics
        m.active.set(len(self._active))
        # Walking every live cache's layers (and asking a shared store its size) costs about
        # a millisecond per sequence: at most every GAUGE_S, not every round of a batched decode.
        now = time.monotonic()
        if self._active and now - self._gauges_at < GAUGE_S:
            return
        self._gauges_at = now
        device = cold = 0
        for seq in self._active:
            if seq.cache is not None:
                rep = seq.cache.memory_report()
                device += rep["device_resident_bytes"]
                cold += rep["cold_bytes"]
        m.device_bytes.set(device)
        m.cold_bytes.set(cold)
        if self.prefix_store is not None:
            m.prefix_bytes.set(self.prefix_store.nbytes())
            m.prefix_records.set(len(self.prefix_store))
            self._store_counters()

    def _store_counters(self) -> None:
        """Add the store's new evictions and damaged records to the metrics."""
        with self._counters_lock:
            self._add_store_counters()

    def _add_store_counters(self) -> None:
        store, m = self.prefix_store, self.metrics
        if store is None:
            return
        ev = store.evictions
        if ev > self._evictions_seen:
            m.prefix_evictions.inc(ev - self._evictions_seen)
            self._evictions_seen = ev
        bad = store.damaged
        if bad > self._damaged_seen:
            m.prefix_damaged.inc(bad - self._damaged_seen)
            self._damaged_seen = bad
        down = store.unreachable
        if down > self._unreachable_seen:
            m.prefix_unreachable.inc(down - self._unreachable_seen)
            self._unreachable_seen = down


def process_logits(
    logits: torch.Tensor, s: Sampling, generated: list[int], eos_ids: set[int] | frozenset[int] = frozenset()
) -> torch.Tensor:
    """OpenAI's logit processing: logit_bias added, then for every token generated so far
    count * frequency_penalty + presence_penalty subtracted; before `min_tokens` tokens the
    EOS ids in `eos_ids` are ruled out (vLLM's min_tokens). logits: [vocab] -> [vocab]."""
    hold_eos = len(generated) < s.min_tokens and bool(eos_ids)
    if not s.logit_bias and not ((s.presence_penalty or s.frequency_penalty) and generated) and not hold_eos:
        return logits
    out = logits.clone()
    if hold_eos:
        out[[i for i in eos_ids if 0 <= i < out.numel()]] = float("-inf")
    if s.logit_bias:
        ids = torch.tensor(list(s.logit_bias), dtype=torch.long, device=out.device)
        out[ids] += torch.tensor(list(s.logit_bias.values()), dtype=out.dtype, device=out.device)
    if (s.presence_penalty or s.frequency_penalty) and generated:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=out.numel())[: out.numel()]
        counts = counts.to(device=out.device, dtype=out.dtype)
        out -= counts * s.frequency_penalty + (counts > 0).to(out.dtype) * s.presence_penalty
    return out


def _sample(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> int:
    if s.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / s.temperature, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < s.top_p  # the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(src, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(int(x) for x in v)
    return ids


def _fingerprint(model: Any, cfg: FlashMemoryConfig, name: str, block_tokens: int) -> str:
    """Model + config identity: a stored prefix is reused only by the same numbers."""
    h = hashlib.blake2b(digest_size=16)
    h.update(name.encode())
    h.update(model.config.to_json_string(use_diff=False).encode())
    h.update(str(model.dtype).encode())
    h.update(linear_layout(model).encode())  # another layout rounds the prefix's K/V otherwise
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):  # a sample of the weights, not all of them
            if i % 7 == 0:
                h.update(p.detach().flatten()[:256].float().numpy().tobytes())
    # Keys that do not change the numbers (where the cold tier lives, threads) are left out.
    skip = {"cold_dir", "persist", "prefetch_threads", "prefetch_window", "cold_ram_bytes", "cold_store"}
    h.update(json.dumps({k: v for k, v in cfg.model_dump().items() if k not in skip}, sort_keys=True).encode())
    h.update(str(block_tokens).encode())
    return h.hexdigest()
