"""Benchmark harness core: models, caches per method, resumable result store, metrics.

Every result is one row (a dict) for one cell; rows are appended to
``<json_out>.partial.jsonl`` as soon as they are measured, so an interrupted run
keeps what it did and a rerun skips cells already there (same ``cell`` key).
At the end the rows are written to ``json_out`` as one JSON document.

Budget = device-resident KV bytes / full-cache KV bytes at the same number of
tokens, over the managed (global) layers; for models with sliding-window layers
(Gemma3) the whole-cache ratio is reported beside it (``ratio_whole``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashmem.errors import FlashMemError
from flashmem.metrics import fidelity_metrics  # noqa: F401 (re-exported)
from flashmem_eval.baselines import Method
from flashmem_eval.baselines.evicting import (
    capture_last_queries,
    full_kv_bytes,
    kv_bytes,
    new_cache,
)


# ----------------------------------------------------------------------------- models
@dataclass
class Loaded:
    name: str
    model: Any
    tokenizer: Any
    hf_folder: str | None = None  # saved HF folder (for the kvpress venv)


def load(name: str) -> Loaded:
    """`tiny` (random Llama + tiny tokenizer) or any name flashmem.load_model accepts."""
    if name == "tiny" or name.startswith("tiny:"):
        from flashmem_eval.tiny import tiny_llama, tiny_tokenizer

        layers = int(name.split(":", 1)[1]) if ":" in name else 2
        return Loaded(name, tiny_llama(layers=layers), tiny_tokenizer())
    import flashmem

    model, tok = flashmem.load_model(name)
    folder = None
    try:
        from flashmem.models.loading import resolve

        src = resolve(name)
        folder = str(src.cache_dir()) if src.kind != "folder" else str(src.path)
    except Exception:  # pragma: no cover - loader internals may move
        folder = None
    model.eval()
    return Loaded(name, model, tok, folder)


def dtype_bytes(model: Any) -> int:
    return next(model.parameters()).element_size()


# ----------------------------------------------------------------------------- runs
@dataclass
class Prefilled:
    cache: Any
    captured: dict[int, dict[str, Any]]
    last_logits: torch.Tensor  # [vocab], predicts the token after the prompt
    seconds: float
    tokens: int


def restore_attn(model: Any, impl: str) -> None:
    if model.config._attn_implementation != impl:
        model.set_attn_implementation(impl)


FULL_PREFILL_CHUNK = 4096


def prefill_spans(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) spans of at most `chunk` tokens covering `n`, aligned to the
    end so the last span is whole (SnapKV's observation window lies in it)."""
    if n <= chunk:
        return [(0, n)]
    ends = list(range(n, 0, -chunk))[::-1]  # aligned to the end: the last span is full
    return list(zip([0] + ends[:-1], ends))


@torch.no_grad()
def prefill_full(model: Any, ids: torch.Tensor, obs_window: int = 64, chunk: int = FULL_PREFILL_CHUNK) -> Prefilled:
    """Full-attention prefill into a DynamicCache, recording the last queries per layer.

    Prompts longer than `chunk` go in chunks (exact for a DynamicCache): a
    one-shot 16K prefill on CPU materialises L x L masks and scores for every
    layer, sliding ones included, and is several times slower.
    """
    cache = new_cache(model)
    t0 = time.perf_counter()
    with capture_last_queries(model, obs_window) as captured:
        for a, b in prefill_spans(int(ids.shape[1]), chunk):
            out = model(input_ids=ids[:, a:b], cache=cache, use_cache=True, logits_to_keep=1)
    dt = time.perf_counter() - t0
    return Prefilled(cache, dict(captured), out.logits[0, -1].float(), dt, int(ids.shape[1]))


def eviction_cache(method: Method, pre: Prefilled, budget: float) -> Any:
    from flashmem_eval.baselines.snapkv import snapkv_compress, snapkv_keep
    from flashmem_eval.baselines.streaming import streaming_compress, streaming_sizes

    if method.kind == "full":
        from flashmem_eval.baselines.evicting import to_evicting

        return to_evicting(pre.cache)  # shares tensors; the source stays reusable
    if method.variant == "streaming":
        sinks, window = streaming_sizes(budget, pre.tokens)
        return streaming_compress(pre.cache, sinks, window)
    if method.variant == "snapkv":
        return snapkv_compress(pre.cache, pre.captured, snapkv_keep(budget, pre.tokens))
    from flashmem_eval.baselines.quantized import QUANT_METHODS, quantized_from_prefill

    if method.variant in QUANT_METHODS:  # every token kept, quantized: the budget does not apply
        return quantized_from_prefill(method.variant, pre.cache)
    raise FlashMemError(f"method {method.name!r} is not an eviction method")


@torch.no_grad()
def prefill_flashmem(model: Any, ids: torch.Tensor, cfg: Any) -> tuple[Any, torch.Tensor, float]:
    from flashmem_eval.baselines.flashmem_adapter import attach

    cache = attach(model, cfg)
    chunk = max(1, int(getattr(cfg, "prefill_chunk", 2048)))
    t0 = time.perf_counter()
    logits = None
    for s in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, s : s + chunk], cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
    return cache, logits, time.perf_counter() - t0


@torch.no_grad()
def teacher_forced(
    model: Any, cache: Any, first_logits: torch.Tensor, cont: torch.Tensor, chunk: int = 64
) -> torch.Tensor:
    """Log-probs [N, vocab] predicting each continuation token (teacher forcing).

    Row 0 comes from the prompt's last logits; the continuation is fed in chunks
    of `chunk` tokens (the last token is not fed: nothing is predicted from it).
    """
    rows = [first_logits.float().log_softmax(-1).unsqueeze(0)]
    feed = cont[:, :-1]
    for s in range(0, feed.shape[1], chunk):
        out = model(input_ids=feed[:, s : s + chunk], cache=cache, use_cache=True)
        rows.append(out.logits[0].float().log_softmax(-1))
    return torch.cat(rows, dim=0)[: cont.shape[1]]


def prompt_ids(tok: Any, probe: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A probe's context (with the tokenizer's special tokens) and question (without) as ids
    [1, n] and [1, m], as the suites feed them."""
    ctx = torch.tensor([tok(probe.context, add_special_tokens=True)["input_ids"]])
    q = torch.tensor([tok(probe.question, add_special_tokens=False)["input_ids"]])
    return ctx, q


def _next_logits(model: Any, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    """ids [1, n] through the cache -> the logits [vocab] after the last."""
    return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]


def _margin(logits: torch.Tensor, want: int) -> tuple[int, float]:
    """(the top-1 token, token `want`'s logit minus the best other token's): for the top-1
    itself, its gap over the runner-up (= the log-prob gap, nats)."""
    top = logits.float().topk(2)
    best = int(top.indices[0])
    other = top.values[1] if best == want else top.values[0]
    return best, float(logits[want].float() - other)


@torch.no_grad()
def forced(model: Any, cache: Any, first_ids: torch.Tensor, gen: list[int]) -> tuple[list[int], list[float]]:
    """Teacher forcing one token at a time, as `greedy` feeds its own: feed `first_ids` (the
    question), then gen[:-1] -> per token j of `gen`, the cache's top-1 token and gen[j]'s
    logit minus the best other token's (nats; negative where the cache would choose another)."""
    tops: list[int] = []
    margins: list[float] = []
    logits = _next_logits(model, cache, first_ids)
    for j, want in enumerate(gen):
        if j:
            logits = _next_logits(model, cache, torch.tensor([[gen[j - 1]]]))
        best, m = _margin(logits, want)
        tops.append(best)
        margins.append(m)
    return tops, margins


@torch.no_grad()
def greedy(
    model: Any,
    cache: Any,
    first_ids: torch.Tensor,
    max_new: int,
    stop_ids: Iterable[int] = (),
    gaps: list[float] | None = None,
) -> list[int]:
    """Feed `first_ids` (e.g. the question), then decode greedily `max_new` tokens. With a
    `gaps` list, each generated token's decision margin is appended to it: its logit minus the
    runner-up's (= the log-prob gap, in nats; `flashmem_eval.tasks.item_gaps`)."""
    stop = set(stop_ids)

    def pick(logits: torch.Tensor) -> int:
        nxt = int(logits.argmax())
        if gaps is not None:
            gaps.append(_margin(logits, nxt)[1])
        return nxt

    nxt = pick(_next_logits(model, cache, first_ids))
    gen = [nxt]
    for _ in range(max_new - 1):
        if nxt in stop:
            break
        nxt = pick(_next_logits(model, cache, torch.tensor([[nxt]])))
        gen.append(nxt)
    return gen


@torch.no_grad()
def timed_decode(model: Any, cache: Any, first_id: int, steps: int) -> list[float]:
    """Seconds of each of `steps` single-token greedy decode forwards."""
    times = []
    nxt = first_id
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True, logits_to_keep=1)
        nxt = int(out.logits[0, -1].argmax())
        times.append(time.perf_counter() - t0)
    return times


def cache_ratios(model: Any, cache: Any, tokens: int) -> dict[str, Any]:
    """Measured resident bytes of `cache` and their ratio to a full cache at `tokens`.

    An exact prompt's K/V (flashmem's `prefill_kv` tier, held until the first generated
    token) is reported apart, as `prompt_kv_bytes`: the ratio is what decoding holds."""
    full = full_kv_bytes(model, tokens, dtype_bytes(model))
    if hasattr(cache, "memory_report"):
        rep = cache.memory_report()
        prompt_kv = int(rep.get("tiers", {}).get("prefill_kv", 0))
        managed = int(rep.get("managed_resident_bytes", 0)) + int(rep.get("full_layer_bytes", 0)) - prompt_kv
        sliding = int(rep.get("sliding_layer_bytes", 0))
        total = int(rep.get("device_resident_bytes", managed + sliding)) - prompt_kv
        peak = int(rep.get("peak_managed_resident_bytes", 0)) + int(rep.get("full_layer_bytes", 0))
        extra = {
            "cold_bytes": rep.get("cold_bytes"),
            "tokens_seen": rep.get("tokens_seen"),
            "prompt_kv_bytes": prompt_kv,
            # the most the managed layers held at any step so far (a held exact prompt included)
            "ratio_peak": peak / full["managed_bytes"] if full["managed_bytes"] else float("nan"),
            # decode steps the layers ran as `decode_step: static` (0: eager)
            "static_decode_steps": rep.get("static_decode_steps", 0),
        }
    else:
        b = kv_bytes(cache)
        managed, sliding, total = b["managed_bytes"], b["sliding_bytes"], b["total_bytes"]
        extra = {}
    return {
        "resident_managed_bytes": managed,
        "resident_sliding_bytes": sliding,
        "resident_bytes": total,
        "full_managed_bytes": full["managed_bytes"],
        "full_bytes": full["total_bytes"],
        "ratio": managed / full["managed_bytes"] if full["managed_bytes"] else float("nan"),
        "ratio_whole": total / full["total_bytes"] if full["total_bytes"] else float("nan"),
        "bytes_per_token": total / max(1, tokens),
        **extra,
    }


# ----------------------------------------------------------------------------- store
class ResultStore:
    """Rows keyed by `cell`, appended to a .partial.jsonl as they come; resumable."""

    def __init__(self, json_out: str | Path, meta: dict[str, Any] | None = None) -> None:
        self.json_out = Path(json_out)
        self.partial = self.json_out.with_name(self.json_out.name + ".partial.jsonl")
        self.meta = meta or {}
        self.rows: dict[str, dict[str, Any]] = {}
        if self.json_out.is_file():
            try:
                doc = json.loads(self.json_out.read_text())
                old = doc.get("meta", {})
                self.meta.setdefault("runs", list(old.get("runs", [])))
                for key, value in old.items():  # notes a file carries (where rows were copied from) stay
                    self.meta.setdefault(key, value)
                for r in doc.get("rows", []):
                    if "cell" in r and not r.get("error"):
                        self.rows[r["cell"]] = r
            except (json.JSONDecodeError, AttributeError):
                pass
        if self.partial.is_file():
            for line in self.partial.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by an interrupted write
                if "cell" in r and not r.get("error"):
                    self.rows[r["cell"]] = r

    def done(self, cell: str) -> bool:
        return cell in self.rows

    def add(self, row: dict[str, Any]) -> None:
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        with self.partial.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, default=_jsonable) + "\n")
        if not row.get("error"):
            self.rows[row["cell"]] = row

    def write(self) -> dict[str, Any]:
        doc = {"meta": {**self.meta, **environment()}, "rows": list(self.rows.values())}
        self.json_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.json_out.with_name(self.json_out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=_jsonable))
        tmp.replace(self.json_out)
        return doc


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def environment() -> dict[str, Any]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def cell_id(**parts: Any) -> str:
    return "|".join(f"{k}={_fmt(v)}" for k, v in parts.items())


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


@dataclass
class Progress:
    """tqdm progress bar over cells (disabled when not a terminal unless forced)."""

    total: int
    desc: str
    bar: Any = field(default=None)

    def __post_init__(self) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, desc=self.desc, unit="cell", dynamic_ncols=True)

    def step(self, note: str = "") -> None:
        if note:
            self.bar.set_postfix_str(note[:60])
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
