"""Bytes of a stored prefix, and where a reused request's time goes (SmolLM2, the recipe).

For each document length: one engine with a fresh prefix folder runs the prompt
(a King James document and a question, greedy) cold, which stores its prefix
records; then the same prompt again, reused. Reported per length:

- bytes: the folder's bytes and record count after the cold request (the stored
  document), and bytes per 1K stored tokens;
- ttft: time to first token, cold and reused, and their ratio;
- where the reused request's time goes: loading the records (read + checks +
  decode), rebuilding the cache from them, the re-prefilled tail (the prompt
  after the last stored block) and the rest (sampling, bookkeeping);
- same answer: the greedy tokens of the two requests, and whether they are equal.

Runs on the engine directly (`Engine.run_sync`, no HTTP), so the numbers are the
worker's own. One model load; heavy: run it under the shared lock.

    OMP_NUM_THREADS=1 flock /work/notes/bench.lock python benchmarks/prefix_bytes.py \
        --tokens 3072 8192 --out results/prefix_bytes_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "\n\nQuestion: Who is named first in the passage above, and what does he do?\nAnswer:"


def timed(obj: Any, name: str, into: dict[str, float]) -> None:
    """Wrap obj.name so its seconds add up in into[name]."""
    fn = getattr(obj, name)

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            into[name] = into.get(name, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


def end_record_engine() -> type:
    """The engine with end records, as proposed for serve/engine.py (prefix.end_point /
    end_key): the prompt's chunk that holds its end point stops there, the state there is
    stored under the end key, and a request whose whole chain and end record are stored
    restores them and runs the last END_TAIL tokens only. Here so the change can be
    measured before the engine takes it; nothing else differs from `Engine`."""
    from flashmem.errors import FlashMemError
    from flashmem.serve import state
    from flashmem.serve.engine import Engine
    from flashmem.serve.prefix import chain, end_key, end_point

    class EndRecordEngine(Engine):
        def _admit(self, seq: Any) -> None:
            C, n, store = self.block_tokens, seq.prompt_tokens, self.prefix_store
            seq.end_at, seq.end_key = end_point(n, C), None
            if store is None or not seq.end_at:
                return super()._admit(seq)
            try:
                seq.cache = self._attach(self.model, self.cfg)
                seq.keys = chain(seq.prompt_ids, C, self.fingerprint, seq.salt, limit=(n - 1) // C)
                full = len(seq.keys)  # == end_at // C
                parent = seq.keys[full - 1] if full else ""
                seq.end_key = end_key(parent, seq.prompt_ids[full * C : seq.end_at], self.fingerprint, seq.salt)
                hit = store.longest(seq.keys)
                want = seq.keys[:hit] + ([seq.end_key] if hit == full and seq.end_key in store else [])
                records = store.load(want) if want else []
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
            except Exception as exc:  # noqa: BLE001 - as Engine._admit
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")

        def _prefill_chunk(self, seq: Any) -> None:
            a, m, store = seq.pos, getattr(seq, "end_at", 0), self.prefix_store
            if not (m and a < m < min(a + self.block_tokens, seq.prompt_tokens)):
                return super()._prefill_chunk(seq)
            self._forward(seq, seq.prompt_ids[a:m])  # the chunk stops at the end point
            seq.pos = m
            self.metrics.prefill_tokens.inc(m - a)
            if store is not None and seq.mark is not None and seq.end_key is not None and seq.end_key not in store:
                try:
                    parent = seq.keys[-1] if seq.keys else ""
                    store.save(seq.end_key, parent, state.export_delta(seq.cache, seq.mark), pin=True)
                    seq.pinned.append(seq.end_key)
                except FlashMemError as exc:
                    print(f"end record not stored: {exc}", file=sys.stderr)
            seq.mark = state.mark(seq.cache) if store is not None else None

    return EndRecordEngine


def run_length(
    model: Any, tok: Any, cfg: Any, n_tokens: int, max_tokens: int, store_kw: dict[str, Any], end_record: bool
) -> dict:
    from flashmem.serve import state
    from flashmem.serve.engine import Engine, Sampling, Sequence
    from flashmem.serve.prefix import PrefixStore
    from flashmem.texts import haystack

    doc = haystack(tok, n_tokens - 40, seed=3, name="kjv")
    ids = tok(doc + QUESTION, add_special_tokens=False)["input_ids"]
    out: dict[str, Any] = {"prompt_tokens": len(ids)}
    with tempfile.TemporaryDirectory() as d:
        store = PrefixStore(d, **store_kw)
        kind = end_record_engine() if end_record else Engine
        engine = kind(model, tok, cfg, model_name="smollm2", prefix_store=store)
        spent: dict[str, float] = {}
        timed(store, "load", spent)
        timed(store, "save", spent)
        timed(state, "import_records", spent)
        timed(state, "export_delta", spent)
        forwards: list[tuple[int, float]] = []
        fwd = engine._forward

        def forward(seq: Any, chunk: list[int]) -> torch.Tensor:
            t0 = time.perf_counter()
            r = fwd(seq, chunk)
            forwards.append((len(chunk), time.perf_counter() - t0))
            return r

        engine._forward = forward  # type: ignore[method-assign]
        runs = {}
        for name in ("cold", "reused"):
            spent.clear()
            forwards.clear()
            seq = Sequence(ids, Sampling(max_tokens=max_tokens, temperature=0), "bench", None)
            t0 = time.perf_counter()
            engine.run_sync(seq)
            assert seq.t_first is not None, seq.finish_reason
            ttft = seq.t_first - t0
            prompt_fwd = [t for n, t in forwards if n > 1]
            runs[name] = {
                "ttft_s": round(ttft, 3),
                "reused_tokens": seq.reused_tokens,
                "load_s": round(spent.get("load", 0.0), 3),
                "import_s": round(spent.get("import_records", 0.0), 3),
                "export_s": round(spent.get("export_delta", 0.0), 3),
                "save_s": round(spent.get("save", 0.0), 3),
                "prefill_chunks": len(prompt_fwd),
                "prefill_s": round(sum(prompt_fwd), 3),
                "chunk_s": [round(t, 3) for t in prompt_fwd],
                "tail_tokens": len(ids) - seq.reused_tokens,
                "generated": seq.generated,
            }
            if name == "cold":
                out["stored_bytes"] = store.nbytes()
                out["stored_records"] = len(store)
                out["stored_tokens"] = len(engine_keys(engine, ids)) * engine.block_tokens
        r, c = runs["reused"], runs["cold"]
        r["other_s"] = round(r["ttft_s"] - r["load_s"] - r["import_s"] - r["prefill_s"], 3)
        out["cold"], out["reused"] = c, r
        out["ttft_ratio"] = round(r["ttft_s"] / c["ttft_s"], 4)
        out["same_greedy_tokens"] = c["generated"] == r["generated"]
        out["bytes_per_1k_tokens"] = round(out["stored_bytes"] / (out["stored_tokens"] / 1024))
    return out


def engine_keys(engine: Any, ids: list[int]) -> list[str]:
    from flashmem.serve.prefix import chain

    return chain(ids, engine.block_tokens, engine.fingerprint, "bench", limit=(len(ids) - 1) // engine.block_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192])
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--codec", default=None, help="prefix record codec (a PrefixStore keyword where it has one)")
    p.add_argument("--config", default=str(ROOT / "configs" / "cpu-small.yaml"))
    p.add_argument("--end-record", action="store_true", help="the engine with end records (end_record_engine)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    import flashmem
    from flashmem.config import FlashMemoryConfig

    cfg = FlashMemoryConfig.from_yaml(args.config)
    model, tok = flashmem.load_model("smollm2")
    store_kw = {"codec": args.codec} if args.codec else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit.strip(),
        "model": "smollm2 (fp32)",
        "config": Path(args.config).name,
        "codec": args.codec or "default",
        "end_record": args.end_record,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "lengths": [],
    }
    for n in args.tokens:
        r = run_length(model, tok, cfg, n, args.max_tokens, store_kw, args.end_record)
        report["lengths"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("cold", "reused")}), flush=True)
        print("  cold  ", json.dumps(r["cold"]), flush=True)
        print("  reused", json.dumps(r["reused"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
