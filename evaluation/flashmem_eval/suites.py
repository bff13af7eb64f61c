"""The four benchmark suites: fidelity, retrieval, memory, speed.

Each suite walks its cells (method x budget x length x ...), skips cells the
store already has, measures the rest and appends one row per cell. Eviction
baselines (full, streaming, snapkv) share one full-attention prefill per prompt
(they compress after it, as kvpress does); flashmem runs its own chunked
prefill; kvpress cells are batched into one subprocess in kvpress's venv.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashmem.config import FlashMemoryConfig
from flashmem.errors import FlashMemError
from flashmem.texts import haystack, insert_needles
from flashmem_eval import harness as H
from flashmem_eval.baselines import Method, parse_method

SUITES = ("fidelity", "retrieval", "memory", "speed", "tasks")
DEFAULT_MODEL = {
    "fidelity": "smollm2",
    "retrieval": "gemma3-270m",
    "memory": "smollm2",
    "speed": "tiny",
    "tasks": "smollm2",
}
DEFAULT_LENGTHS = {
    "fidelity": (4096, 8192),
    "retrieval": (2048, 4096, 8192, 16384),
    "memory": (2048, 4096, 8192),
    "speed": (4096, 16384, 65536),
    "tasks": (4096, 8192, 16384),
}


@dataclass
class BenchArgs:
    suite: str
    model: str
    methods: list[str]
    budgets: list[float]
    lengths: list[int]
    json_out: Path
    seeds: list[int] = field(default_factory=lambda: [0])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    tasks: list[str] = field(default_factory=lambda: ["passkey", "multikey"])
    haystacks: list[str] = field(default_factory=lambda: ["kjv"])
    # tasks suite (flashmem_eval.tasks): the families and the wording set (dev / heldout / all)
    families: list[str] = field(default_factory=lambda: ["keyed"])
    wordings: str = "dev"
    # tasks suite: run the other methods only on prompts whose full-cache row answered an item
    # (the share of the full cache's answers counts nothing else); the full cache runs first
    answered_only: bool = False
    # tasks suite: the prompts are those the store's full-cache rows name (of these families,
    # haystacks and lengths), not seeds x wordings: new methods on an earlier run's prompts
    stored_prompts: bool = False
    n_cont: int = 256
    chunk: int = 64
    max_new: int = 12
    decode_tokens: int = 32
    threads: int = 2
    progress: bool = True


def cells_for(methods: list[Method], budgets: list[float]) -> list[tuple[Method, float]]:
    out = []
    for m in methods:
        for b in budgets if m.budgeted else [1.0]:
            out.append((m, b))
    return out


def run_suite(args: BenchArgs, loaded: H.Loaded | None = None, store: H.ResultStore | None = None) -> H.ResultStore:
    if args.suite not in SUITES:
        raise FlashMemError(f"suite: {args.suite!r} is not known; allowed: {', '.join(SUITES)}")
    methods = [parse_method(m) for m in args.methods]
    torch.set_num_threads(max(1, args.threads))
    store = store or H.ResultStore(args.json_out, meta={"suite": args.suite, "model": args.model})
    store.meta.update({"suite": args.suite, "model": args.model})
    store.meta.setdefault("runs", []).append(
        {
            "methods": args.methods,
            "budgets": args.budgets,
            "lengths": args.lengths,
            "seeds": args.seeds,
            "depths": args.depths if args.suite == "retrieval" else None,
            "tasks": args.tasks if args.suite == "retrieval" else None,
            "haystacks": args.haystacks if args.suite in ("retrieval", "tasks") else None,
            "families": args.families if args.suite == "tasks" else None,
            "wordings": args.wordings if args.suite == "tasks" else None,
            "answered_only": args.answered_only if args.suite == "tasks" else None,
            "stored_prompts": args.stored_prompts if args.suite == "tasks" else None,
            "n_cont": args.n_cont if args.suite == "fidelity" else None,
            "chunk": args.chunk,
            "threads": args.threads,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    )
    loaded = loaded or H.load(args.model)
    fn: Callable[..., None] = {
        "fidelity": _fidelity,
        "retrieval": _retrieval,
        "memory": _memory,
        "speed": _speed,
        "tasks": _tasks,
    }[args.suite]
    fn(args, loaded, methods, store)
    store.write()
    return store


# ----------------------------------------------------------------------------- helpers
def _base_row(args: BenchArgs, m: Method, b: float, **kw: Any) -> dict[str, Any]:
    return {"suite": args.suite, "model": args.model, "method": m.name, "budget": b, **kw}


def _cell(args: BenchArgs, m: Method, b: float, **kw: Any) -> str:
    return H.cell_id(suite=args.suite, model=args.model, method=m.name, budget=b, **kw)


def local_cache(
    loaded: H.Loaded, m: Method, b: float, ids: torch.Tensor, shared: dict[str, Any]
) -> tuple[Any, torch.Tensor, dict[str, Any]]:
    """(cache after the prompt, logits predicting the next token, timing/config info)."""
    model = loaded.model
    if m.kind in ("full", "eviction"):
        if "pre" not in shared:
            shared["pre"] = H.prefill_full(model, ids)
        pre: H.Prefilled = shared["pre"]
        t0 = time.perf_counter()
        cache = H.eviction_cache(m, pre, b)
        return cache, pre.last_logits, {"prefill_s": pre.seconds, "compress_s": time.perf_counter() - t0}
    if m.kind == "flashmem":
        from flashmem.sizing.budget import model_geometry, predicted_ratio

        impl = shared.setdefault("impl", model.config._attn_implementation)
        cfg = FlashMemoryConfig.for_budget(b, int(ids.shape[1]), model, variant=m.variant)
        geo = model_geometry(model)
        try:
            cache, logits, dt = H.prefill_flashmem(model, ids, cfg)
        except Exception:
            H.restore_attn(model, impl)
            raise
        info = {
            "prefill_s": dt,
            "config": cfg.model_dump(),
            "predicted_ratio": predicted_ratio(cfg, int(ids.shape[1]), **geo),
        }
        shared["restore"] = impl
        shared["cache"] = cache  # closed by done_local, not left to the garbage collector
        return cache, logits, info
    raise FlashMemError(f"method {m.name!r} does not run in this process")


def answer_job(
    cell: str, m: Method, b: float, ctx: torch.Tensor, q: torch.Tensor, max_new: int, stop: list[int], model: Any
) -> dict[str, Any]:
    """The kvpress runner's job for `cell`: press `m` at budget `b` over context ctx [1, n], then a
    greedy answer of at most max_new tokens to question q [1, n_q]."""
    from flashmem_eval.baselines.kvpress_env import press_ratio

    return {
        "cell": cell,
        "kind": "retrieval",  # the runner's job: context, question, greedy answer
        "press": m.variant,
        "compression_ratio": press_ratio(b),
        "context": ctx[0].tolist(),
        "question": q[0].tolist(),
        "max_new": max_new,
        "stop": stop,
        "global_layers": global_layers(model),
    }


def local_answer(
    loaded: H.Loaded,
    m: Method,
    b: float,
    ctx: torch.Tensor,
    q: torch.Tensor,
    max_new: int,
    stop: list[int],
    shared: dict[str, Any],
    row: dict[str, Any],
    gaps: list[float] | None = None,
) -> tuple[list[int], dict[str, Any]]:
    """Method `m` at budget `b` over context ctx [1, n], then its greedy answer to q [1, n_q]
    -> (the answer's ids, timing/config info); the cache's byte ratios go into `row`, each
    token's decision margin into `gaps` if given (`harness.greedy`)."""
    model = loaded.model
    cache, _, info = local_cache(loaded, m, b, ctx, shared)
    row.update(H.cache_ratios(model, cache, int(ctx.shape[1])))
    gen = H.greedy(model, cache, q, max_new, stop, gaps)
    if m.kind == "flashmem":
        # at the context's end nothing is selected yet (an exact prompt's K/V, if held, is
        # reported apart); decoding's is measured after the answer, the peak beside it
        end = H.cache_ratios(model, cache, int(ctx.shape[1] + q.shape[1]) + len(gen) - 1)
        row["ratio_prompt_end"], row["ratio"] = row["ratio"], end["ratio"]
        row["ratio_whole"] = end["ratio_whole"]
        row["ratio_peak"] = end.get("ratio_peak")
        doubt_counts(cache, row)
    return gen, info


def doubt_counts(cache: Any, row: dict[str, Any]) -> None:
    """exact_on_doubt's counts into `row` (decode steps checked, redone, tokens fed again,
    near ties the cap left as selected, redone steps given another token), where the cache
    checked any."""
    rep = cache.memory_report()
    if rep.get("doubt_steps"):
        keys = ("doubt_steps", "doubt_redone", "doubt_redone_tokens", "doubt_capped", "doubt_changed", "doubt_flat")
        row.update({k: rep[k] for k in keys})


def done_local(shared: dict[str, Any], loaded: H.Loaded) -> None:
    if "restore" in shared:
        H.restore_attn(loaded.model, shared.pop("restore"))
    cache = shared.pop("cache", None)
    if cache is not None and hasattr(cache, "close"):
        cache.close()


def _progress(args: BenchArgs, total: int) -> Any:
    if not args.progress:

        class _No:
            def step(self, note: str = "") -> None: ...
            def close(self) -> None: ...

        return _No()
    return H.Progress(total, f"{args.suite}:{args.model}")


def _err_row(row: dict[str, Any], exc: BaseException) -> dict[str, Any]:
    row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def global_layers(model: Any) -> list[int]:
    """Indices of the model's global-attention layers (every layer but sliding-window ones):
    the layers flashmem manages, e.g. 5, 11 and 17 of Gemma3-270m's 18."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    return [i for i, t in enumerate(types) if t != "sliding_attention"]


_global_layers = global_layers  # the old private name, for scripts written against it


def _run_kvpress(
    args: BenchArgs,
    loaded: H.Loaded,
    jobs: list[dict[str, Any]],
    rows_by_cell: dict[str, dict[str, Any]],
    store: H.ResultStore,
    finish: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]],
    prog: Any,
) -> None:
    from flashmem_eval.baselines.kvpress_env import run_jobs

    if not jobs:
        return
    work = args.json_out.with_name(args.json_out.name + ".kvpress")
    work.mkdir(parents=True, exist_ok=True)

    def on_row(r: dict[str, Any]) -> None:
        base = rows_by_cell[r["cell"]]
        row = {**base, **{k: v for k, v in r.items() if k != "traceback"}}
        if not r.get("error"):
            row = finish(row, r)
        store.add(row)
        prog.step(row["method"])

    try:
        run_jobs(loaded.hf_folder or "", jobs, work, threads=args.threads, on_row=on_row)
    except FlashMemError as exc:
        for j in jobs:
            if not store.done(j["cell"]):
                store.add(_err_row(dict(rows_by_cell[j["cell"]]), exc))


# ----------------------------------------------------------------------------- fidelity
def fidelity_ids(tok: Any, length: int, n_cont: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    text = haystack(tok, length + n_cont + 64, seed=seed)
    ids = tok(text, add_special_tokens=True)["input_ids"][: length + n_cont]
    if len(ids) < length + n_cont:
        raise FlashMemError(f"fidelity: text too short for {length}+{n_cont} tokens")
    t = torch.tensor([ids])
    return t[:, :length], t[:, length:]


def _fidelity(args: BenchArgs, loaded: H.Loaded, methods: list[Method], store: H.ResultStore) -> None:
    model, tok = loaded.model, loaded.tokenizer
    cells = cells_for(methods, args.budgets)
    total = len(cells) * len(args.lengths) * len(args.seeds)
    prog = _progress(args, total)
    jobs: list[dict[str, Any]] = []
    bases: dict[str, dict[str, Any]] = {}
    for L in args.lengths:
        for seed in args.seeds:
            todo = [
                (m, b) for m, b in cells if not store.done(_cell(args, m, b, length=L, seed=seed, n_cont=args.n_cont))
            ]
            prog.bar.update(len(cells) - len(todo)) if hasattr(prog, "bar") else None
            if not todo:
                continue
            prompt, cont = fidelity_ids(tok, L, args.n_cont, seed)
            shared: dict[str, Any] = {}
            ref = None
            for m, b in todo:
                cell = _cell(args, m, b, length=L, seed=seed, n_cont=args.n_cont)
                row = _base_row(args, m, b, length=L, seed=seed, n_cont=args.n_cont, cell=cell)
                if m.kind == "kvpress":
                    from flashmem_eval.baselines.kvpress_env import press_ratio

                    row["compression_ratio"] = press_ratio(b)
                    bases[cell] = row
                    jobs.append(
                        {
                            "cell": cell,
                            "kind": "fidelity",
                            "press": m.variant,
                            "compression_ratio": press_ratio(b),
                            "context": prompt[0].tolist(),
                            "cont": cont[0].tolist(),
                            "chunk": args.chunk,
                            "global_layers": global_layers(model),
                        }
                    )
                    continue
                t0 = time.perf_counter()
                try:
                    if ref is None:
                        full_cache, full_logits, _ = local_cache(loaded, parse_method("full"), 1.0, prompt, shared)
                        ref = H.teacher_forced(model, full_cache, full_logits, cont, args.chunk)
                    cache, logits, info = local_cache(loaded, m, b, prompt, shared)
                    row.update(H.cache_ratios(model, cache, L))
                    # flashmem selects blocks per step: feed it token by token, as real decoding
                    # does; for exact-attention caches the chunking does not change the logits.
                    step = 1 if m.kind == "flashmem" else args.chunk
                    row["decode_chunk"] = step
                    lp = H.teacher_forced(model, cache, logits, cont, step)
                    end = H.cache_ratios(model, cache, L + args.n_cont - 1)
                    row["ratio_end"] = end["ratio"]
                    if m.kind == "flashmem":
                        # at the prompt's end nothing is selected yet (an exact prompt's K/V, if held,
                        # is reported apart): what decoding holds is measured at the end; the peak
                        # through the whole request, prompt included, beside it
                        row["ratio_prompt_end"], row["ratio"] = row["ratio"], end["ratio"]
                        row["ratio_peak"] = end.get("ratio_peak")
                        row["static_decode_steps"] = end.get("static_decode_steps")
                        doubt_counts(cache, row)
                    row.update(H.fidelity_metrics(ref, lp, cont[0]))
                    row.update(info)
                except Exception as exc:  # recorded; the sweep goes on
                    _err_row(row, exc)
                finally:
                    done_local(shared, loaded) if m.kind == "flashmem" else None
                row["seconds"] = time.perf_counter() - t0
                store.add(row)
                prog.step(f"{m.name} b={b:.3g} L={L}")
    _run_kvpress(args, loaded, jobs, bases, store, lambda row, r: row, prog)
    prog.close()


# ----------------------------------------------------------------------------- retrieval
KEY_WORDS = (
    "apple",
    "river",
    "candle",
    "falcon",
    "garden",
    "harbor",
    "lantern",
    "meadow",
    "orchid",
    "pepper",
    "quartz",
    "saddle",
    "thunder",
    "violet",
    "walnut",
    "yonder",
)

PREAMBLE = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)


@dataclass
class Probe:
    context: str
    question: str
    answer: str


TASKS = ("passkey", "multikey", "locker")
HAYSTACKS = ("kjv", "stdlib-doc")


def make_probe(tok: Any, task: str, length: int, depth: float, seed: int, n_keys: int = 4, hay: str = "kjv") -> Probe:
    """A needle prompt of about `length` tokens (context + question) in the haystack text `hay`.

    passkey: a 5-digit key stated twice; multikey: four "special magic number"
    needles, one asked; locker: a 6-digit code for a name, asked in a
    question/answer form (a different wording, key length and question).
    """
    rng = random.Random(f"{task}|{length}|{depth}|{seed}" + (f"|{hay}" if hay != "kjv" else ""))
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        needles = [(f"The pass key is {key}. Remember it. {key} is the pass key.", depth)]
        question = "\n\nWhat is the pass key? The pass key is"
        answer = key
    elif task == "multikey":
        words = rng.sample(KEY_WORDS, n_keys)
        values = [str(rng.randint(1000000, 9999999)) for _ in words]
        others = [d for d in (0.1, 0.3, 0.55, 0.8, 0.95) if abs(d - depth) > 0.08]
        rng.shuffle(others)
        needles = [(f"One of the special magic numbers for {words[0]} is: {values[0]}.", depth)]
        for w, v, d in zip(words[1:], values[1:], others):
            needles.append((f"One of the special magic numbers for {w} is: {v}.", d))
        question = (
            f"\n\nWhat is the special magic number for {words[0]} mentioned in the provided text? "
            f"The special magic number for {words[0]} mentioned in the provided text is"
        )
        answer = values[0]
    elif task == "locker":
        name = rng.choice(["Maria", "Tomas", "Ingrid", "Kwame", "Yuki", "Aditi", "Oskar"])
        answer = str(rng.randint(100000, 999999))
        needles = [(f"Note from the archivist: the locker code assigned to {name} is {answer}.", depth)]
        question = (
            f"\n\nQuestion: what is the locker code assigned to {name}? Answer: the locker code assigned to {name} is"
        )
    else:
        raise FlashMemError(f"task: {task!r} is not known; allowed: {', '.join(TASKS)}")
    overhead = len(tok(PREAMBLE + question, add_special_tokens=True)["input_ids"])
    overhead += sum(len(tok(" " + n, add_special_tokens=False)["input_ids"]) for n, _ in needles)
    text = "default" if hay == "kjv" else hay
    hay_text = haystack(tok, max(16, length - overhead - 4), seed=rng.randrange(10**6), name=text)
    return Probe(PREAMBLE + insert_needles(hay_text, needles, own_paragraph=True), question, answer)


def score_answer(text: str, answer: str) -> bool:
    nums = re.findall(r"\d+", text)
    return bool(nums) and nums[0] == answer


def _retrieval(args: BenchArgs, loaded: H.Loaded, methods: list[Method], store: H.ResultStore) -> None:
    model, tok = loaded.model, loaded.tokenizer
    cells = cells_for(methods, args.budgets)
    prompts = [
        (task, hay, L, d, s)
        for hay in args.haystacks
        for task in args.tasks
        for L in args.lengths
        for d in args.depths
        for s in args.seeds
    ]
    prog = _progress(args, len(cells) * len(prompts))
    jobs: list[dict[str, Any]] = []
    bases: dict[str, dict[str, Any]] = {}
    answers: dict[str, str] = {}
    stop = [i for i in [getattr(tok, "eos_token_id", None)] if i is not None]
    for task, hay, L, d, s in prompts:
        # the KJV cells keep their ids from before haystacks were a choice
        where = {} if hay == "kjv" else {"haystack": hay}
        todo = [
            (m, b) for m, b in cells if not store.done(_cell(args, m, b, task=task, length=L, depth=d, seed=s, **where))
        ]
        if hasattr(prog, "bar"):
            prog.bar.update(len(cells) - len(todo))
        if not todo:
            continue
        probe = make_probe(tok, task, L, d, s, hay=hay)
        ctx, q = H.prompt_ids(tok, probe)
        shared: dict[str, Any] = {}
        for m, b in todo:
            cell = _cell(args, m, b, task=task, length=L, depth=d, seed=s, **where)
            row = _base_row(
                args,
                m,
                b,
                task=task,
                haystack=hay,
                length=L,
                depth=d,
                seed=s,
                cell=cell,
                context_tokens=int(ctx.shape[1]),
                answer=probe.answer,
            )
            if m.kind == "kvpress":
                from flashmem_eval.baselines.kvpress_env import press_ratio

                row["compression_ratio"] = press_ratio(b)
                bases[cell] = row
                answers[cell] = probe.answer
                jobs.append(answer_job(cell, m, b, ctx, q, args.max_new, stop, model))
                continue
            t0 = time.perf_counter()
            try:
                gen, info = local_answer(loaded, m, b, ctx, q, args.max_new, stop, shared, row)
                text = tok.decode(gen, skip_special_tokens=True)
                row.update(output=text, correct=score_answer(text, probe.answer))
                row.update({k: v for k, v in info.items() if k != "config"})
            except Exception as exc:
                _err_row(row, exc)
            finally:
                done_local(shared, loaded) if m.kind == "flashmem" else None
            row["seconds"] = time.perf_counter() - t0
            store.add(row)
            prog.step(f"{m.name} b={b:.3g} {task} L={L} d={d}")

    def finish(row: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
        text = tok.decode(r.get("generated", []), skip_special_tokens=True)
        row.pop("generated", None)
        row.update(output=text, correct=score_answer(text, answers[row["cell"]]))
        return row

    _run_kvpress(args, loaded, jobs, bases, store, finish, prog)
    prog.close()


# ----------------------------------------------------------------------------- tasks
def _tasks(args: BenchArgs, loaded: H.Loaded, methods: list[Method], store: H.ResultStore) -> None:
    from flashmem_eval.task_suite import run_tasks

    run_tasks(args, loaded, methods, store)


# ----------------------------------------------------------------------------- memory
def _memory(args: BenchArgs, loaded: H.Loaded, methods: list[Method], store: H.ResultStore) -> None:
    """Each cell runs in a fresh process (flashmem_eval.memcell) so its peak RSS is its own."""
    import json as _json
    import subprocess
    import sys

    cells = [(m, b) for m, b in cells_for(methods, args.budgets) if m.kind != "kvpress"]
    prog = _progress(args, len(cells) * len(args.lengths))
    for L in args.lengths:
        for m, b in cells:
            cell = _cell(args, m, b, length=L)
            if store.done(cell):
                prog.step()
                continue
            row = _base_row(args, m, b, length=L, cell=cell)
            spec = {"model": args.model, "method": m.name, "budget": b, "length": L, "threads": args.threads}
            res = subprocess.run(
                [sys.executable, "-m", "flashmem_eval.memcell", _json.dumps(spec)], capture_output=True, text=True
            )
            lines = [x for x in res.stdout.splitlines() if x.startswith("MEMCELL ")]
            if res.returncode == 0 and lines:
                row.update(_json.loads(lines[-1][len("MEMCELL ") :]))
            else:
                row["error"] = f"memcell exited {res.returncode}: {res.stderr.strip()[-500:]}"
            store.add(row)
            prog.step(f"{m.name} b={b:.3g} L={L}")
    prog.close()


# ----------------------------------------------------------------------------- speed
def _speed(args: BenchArgs, loaded: H.Loaded, methods: list[Method], store: H.ResultStore) -> None:
    model, tok = loaded.model, loaded.tokenizer
    cells = [(m, b) for m, b in cells_for(methods, args.budgets) if m.kind != "kvpress"]
    if not any(m.kind == "full" for m, _ in cells):
        cells.insert(0, (parse_method("full"), 1.0))  # the reference runs in the same process
    prog = _progress(args, len(cells) * len(args.lengths))
    vocab = model.config.get_text_config().vocab_size
    for L in args.lengths:
        g = torch.Generator().manual_seed(L)
        if L <= 32768 and loaded.name not in ("tiny",) and not loaded.name.startswith("tiny:"):
            prompt, _ = fidelity_ids(tok, L, 8, 0)
        else:
            prompt = torch.randint(3, vocab, (1, L), generator=g)
        ref: dict[str, Any] | None = None
        for m, b in cells:
            cell = _cell(args, m, b, length=L, decode=args.decode_tokens)
            if store.done(cell):
                if m.kind == "full":
                    ref = store.rows[cell]
                prog.step()
                continue
            row = _base_row(args, m, b, length=L, decode=args.decode_tokens, cell=cell)
            shared: dict[str, Any] = {}
            try:
                t0 = time.perf_counter()
                cache, logits, info = local_cache(loaded, m, b, prompt, shared)
                t_pre = time.perf_counter() - t0
                steps = H.timed_decode(model, cache, int(logits.argmax()), args.decode_tokens)
                ms = sorted(1000 * t for t in steps)
                # median per step: robust to the preemption spikes of a shared machine
                row.update(
                    prefill_s=t_pre,
                    prefill_tok_s=L / t_pre,
                    decode_ms_per_token=ms[len(ms) // 2],
                    decode_ms_mean=sum(ms) / len(ms),
                    decode_ms_min=ms[0],
                )
                row.update(H.cache_ratios(model, cache, L + args.decode_tokens))
                if m.kind == "full":
                    ref = row
                if ref is not None:
                    row["prefill_speed_vs_full"] = row["prefill_tok_s"] / ref["prefill_tok_s"]
                    row["decode_time_vs_full"] = row["decode_ms_per_token"] / ref["decode_ms_per_token"]
            except Exception as exc:
                _err_row(row, exc)
            finally:
                done_local(shared, loaded) if m.kind == "flashmem" else None
            store.add(row)
            prog.step(f"{m.name} b={b:.3g} L={L}")
    prog.close()
