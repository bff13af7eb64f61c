"""`flashmem run`: generate over a long input through the FlashMemory cache.

Streams the generated text, then prints the measured memory per tier and the
speed; `--compare-full` also runs a plain DynamicCache: its own answer, and
top-1 agreement and KL of the next-token distributions over flashmem's tokens.
With a packaged text (`--text`) and no `--prompt`, a fact is planted far back
in the context and asked about at the end (`--ask`, cli/fact.py), so the run
shows whether the cache still finds what attention needs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from flashmem import progress
from flashmem.errors import FlashMemError

if TYPE_CHECKING:
    from flashmem.config import FlashMemoryConfig

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "cpu-small.yaml"
MIN_ASK_TOKENS = 200  # --ask: the question, the fact and some text around it


def register(app: typer.Typer) -> None:
    app.command("run")(run)


def run(
    model: str = typer.Option("smollm2", "--model", "-m", help="built-in name, HF folder or .gguf file"),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="FlashMemory YAML (default: configs/cpu-small.yaml)"
    ),
    input: Path | None = typer.Option(None, "--input", "-i", help="text file to read as the long context"),
    text: str | None = typer.Option(None, "--text", help="packaged text instead of --input (e.g. 'kjv')"),
    context_tokens: int | None = typer.Option(
        None, "--context-tokens", min=1, help="keep the last N tokens of the input"
    ),
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="text appended after the input"),
    max_new_tokens: int | None = typer.Option(
        None, "--max-new-tokens", "-n", min=1, help="tokens to generate (default: 16 with --ask, else 64)"
    ),
    ask: bool | None = typer.Option(
        None,
        "--ask/--no-ask",
        help="plant a fact far back in the text and ask about it (default: on for --text without --prompt)",
    ),
    fact_depth: float = typer.Option(
        0.2, "--fact-depth", min=0.0, max=1.0, help="--ask: where the fact goes, 0 = start of the context, 1 = end"
    ),
    compare_full: bool = typer.Option(False, "--compare-full", help="also run the plain cache and compare"),
    json_out: Path | None = typer.Option(None, "--json-out", help="write the measurements as JSON"),
    threads: int | None = typer.Option(
        None, "--threads", min=1, help="torch CPU threads (default: one per idle core, from the load average)"
    ),
    dtype: str = typer.Option(
        "float32",
        "--dtype",
        help="the model's weights and K/V: float32, bfloat16 or float16 (without --config, a non-float32"
        " model gets the recipe sized for its bytes, as configs/cpu-small.yaml is for float32)",
    ),
) -> None:
    """Generate with the FlashMemory cache and report memory, speed and (optionally) fidelity."""
    from rich.console import Console

    from flashmem.cli.inputs import check_dtype, check_output_path
    from flashmem.config import FlashMemoryConfig

    console = Console(stderr=True, soft_wrap=True)  # a log keeps whole lines
    # every argument is checked here, in a second, before a model loads (half a minute or more)
    check_output_path(json_out, "--json-out")
    ask = _resolve_ask(ask, input, prompt, context_tokens)
    torch_dtype = check_dtype(dtype)
    cfg = FlashMemoryConfig.from_yaml(config or _default_config())
    source = _read_input(input, text)
    _check_model(model)
    n_new = max_new_tokens or (16 if ask else 64)

    import flashmem

    _set_threads(threads, console)
    with progress.step(f"loading {model}"):
        mdl, tok = flashmem.load_model(model, dtype=torch_dtype)
    shown: Path | str = config or _default_config()
    if config is None and dtype != "float32":  # the default file is the recipe for float32
        cfg = sized_default_config(mdl)
        shown = f"the recipe at 1/8 of 8K for {dtype}"
    if ask:
        planted, ids = _plant(tok, source, context_tokens, fact_depth, console)
    else:
        planted, ids = None, _encode(tok, source, prompt, context_tokens)
    console.print(f"[dim]context: {ids.shape[1]:,} tokens; config: {shown}[/dim]")
    result = _measure_attached(mdl, tok, ids, n_new, model, cfg, compare_full)
    if planted is not None:
        result["question"] = _question_result(planted, result, compare_full)
    _print_report(result)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2, default=str))


def _measure_attached(
    mdl: Any, tok: Any, ids: Any, max_new_tokens: int, model: str, cfg: Any, compare_full: bool
) -> dict[str, Any]:
    """`_measure` through a FlashMemory cache attached for this run, closed after it."""
    import flashmem

    cache = flashmem.attach(mdl, cfg)
    try:
        return _measure(mdl, tok, cache, ids, max_new_tokens, model, cfg, compare_full)
    finally:
        cache.close()  # also on SIGTERM (main turns it into SystemExit): no store folder is left


def _resolve_ask(ask: bool | None, input: Path | None, prompt: str | None, context_tokens: int | None) -> bool:
    """--ask as given, else on when neither --input nor --prompt is; FlashMemError when it cannot be."""
    if ask is None:
        ask = input is None and prompt is None
    if ask and prompt is not None:
        raise FlashMemError("--ask and --prompt both given; allowed: one of them")
    if ask and context_tokens is not None and context_tokens < MIN_ASK_TOKENS:
        raise FlashMemError(
            f"--context-tokens: {context_tokens} leaves no room for the text around the question; "
            f"allowed: >= {MIN_ASK_TOKENS} with --ask"
        )
    return ask


def _plant(tok: Any, source: str, context_tokens: int | None, fact_depth: float, console: Any) -> tuple[Any, Any]:
    """A fact planted at `fact_depth` of the context and asked at its end, and the ids [1, tokens]; both printed."""
    import torch

    from flashmem.cli.fact import plant_fact

    planted = plant_fact(tok, source, context_tokens, fact_depth, seed=context_tokens or 0)
    ids = torch.tensor([planted.ids])
    back = ids.shape[1] - planted.fact_token
    console.print(f"planted at token {planted.fact_token:,} of {ids.shape[1]:,} ({back:,} tokens back): {planted.fact}")
    console.print(f"asked at the end: {planted.question}")
    return planted, ids


def _question_result(planted: Any, result: dict[str, Any], compare_full: bool) -> dict[str, Any]:
    """The planted fact and whether flashmem's answer (and the full cache's) names it."""
    from flashmem.cli.fact import found

    question = {
        "fact": planted.fact,
        "fact_token": planted.fact_token,
        "answer": planted.answer,
        "flashmem_found": found(result["text"], planted.answer),
    }
    if compare_full:
        question["full_found"] = found(result["compare_full"]["full_text"], planted.answer)
    return question


def _measure(
    mdl: Any, tok: Any, cache: Any, ids: Any, max_new_tokens: int, model: str, cfg: Any, compare_full: bool
) -> dict[str, Any]:
    gen, logits, t_prefill, t_decode = _generate(mdl, tok, cache, ids, max_new_tokens, label="flashmem:   ")
    report = cache.memory_report()
    traffic = cache.traffic_report() if hasattr(cache, "traffic_report") else None
    result: dict[str, Any] = {
        "model": model,
        "device": str(next(mdl.parameters()).device),
        "context_tokens": int(ids.shape[1]),
        "generated_tokens": len(gen),
        "text": tok.decode(gen, skip_special_tokens=True),
        "prefill_s": t_prefill,
        "prefill_tokens_per_s": ids.shape[1] / t_prefill,
        # the first token comes with the prefill's logits: decode times the other len(gen) - 1
        "decode_s": t_decode,
        "decode_tokens_per_s": (len(gen) - 1) / t_decode if len(gen) > 1 and t_decode > 0 else None,
        "memory": report,
        "traffic": traffic,
        "config": cfg.model_dump(),
    }
    full_bytes = _full_cache_bytes(mdl, report["tokens_seen"])
    result["full_cache_bytes"] = full_bytes
    if compare_full:
        result["compare_full"] = _compare(mdl, tok, ids, gen, logits)
    return result


def _check_model(model: str) -> None:
    """The model name or path, and a built-in's packages, checked without loading anything."""
    from flashmem.models.loading import resolve

    src = resolve(model)
    if src.builtin is not None:
        src.builtin.check_installed()


def _set_threads(threads: int | None, console: Any) -> None:
    """--threads, else OMP_NUM_THREADS when set, else one thread per idle core: OpenMP
    threads spin on a busy machine (flashmem.doctor.suggest_threads)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
        import warnings

        warnings.filterwarnings("ignore", message="torch uses .* threads")  # load_model's advice: chosen
        return
    if os.environ.get("OMP_NUM_THREADS"):
        return
    from flashmem.doctor import cpu_load, suggest_threads

    cores, load1 = cpu_load()
    n = suggest_threads(cores, load1)
    if n < torch.get_num_threads():
        torch.set_num_threads(n)
        console.print(
            f"[dim]torch threads: {n}, one per idle core (load average {load1:.1f} on {cores} cores; "
            "--threads N to choose)[/dim]"
        )


def sized_default_config(model: Any) -> FlashMemoryConfig:
    """The recipe `configs/cpu-small.yaml` is for a float32 model (1/8 of the full cache at 8K
    tokens), sized for a loaded model's bytes and device: the default config of `flashmem run`
    and `flashmem serve` for a model loaded in another dtype (`--dtype`)."""
    from flashmem.config import FlashMemoryConfig

    return FlashMemoryConfig.for_budget(1 / 8, 8192, model, prefetch_threads=0)


def _default_config() -> Path:
    if not DEFAULT_CONFIG.is_file():
        raise FlashMemError(
            "no --config given and configs/cpu-small.yaml is not beside the package; pass --config FILE"
        )
    return DEFAULT_CONFIG


def _read_input(path: Path | None, text: str | None) -> str:
    if path is not None and text is not None:
        raise FlashMemError("--input and --text both given; allowed: one of them")
    if path is not None:
        from flashmem.cli.inputs import read_input_text

        return read_input_text(path)
    from flashmem.texts import load_text

    return load_text(text or "default")


def _encode(tok: Any, source: str, prompt: str | None, context_tokens: int | None) -> Any:
    import torch

    if context_tokens is not None:  # tokenize only a tail that surely holds enough tokens
        source = source[-context_tokens * 8 :]
    ctx = tok(source, add_special_tokens=True).input_ids
    if context_tokens is not None:
        ctx = ctx[-context_tokens:]
    tail = tok("\n\n" + prompt, add_special_tokens=False).input_ids if prompt else []
    if not ctx and not tail:
        raise FlashMemError("the input is empty; allowed: a non-empty text")
    return torch.tensor([ctx + tail])


def _stop_ids(model: Any, tok: Any) -> set[int]:
    """End-of-sequence ids: the tokenizer's and the generation config's (an int or a list)."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return ids


class _Stream:
    """Prints generated text as it comes, without special tokens (`<|im_end|>`): the
    tokens so far are decoded together and only the new characters printed, so a
    character split over tokens prints whole."""

    def __init__(self, tok: Any, label: str) -> None:
        self.tok, self.label, self.ids, self.shown = tok, label, list[int](), ""

    def add(self, token: int) -> None:
        if not self.ids:
            typer.echo(self.label, nl=False)
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):  # else: wait for the rest
            typer.echo(text[len(self.shown) :], nl=False)
            self.shown = text

    def end(self) -> None:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.shown):
            typer.echo(text[len(self.shown) :], nl=False)
        typer.echo("")


def _generate(
    model: Any, tok: Any, cache: Any, ids: Any, n: int, label: str
) -> tuple[list[int], list[Any], float, float]:
    """Greedy decoding, streamed; returns tokens, the logits that chose them, prefill and decode seconds."""
    import torch

    import flashmem

    logits = []
    stop = _stop_ids(model, tok)
    stream = _Stream(tok, label)
    with torch.no_grad():
        t0 = time.perf_counter()
        # model-level chunks: one forward over a long input would allocate activations for all of it
        with (
            progress.step("prefill", total=int(ids.shape[1]), unit="tokens") as shown,
            progress.forward_tokens(model, shown),
        ):
            last = flashmem.prefill(model, cache, ids)
        t_prefill = time.perf_counter() - t0
        gen: list[int] = []
        t0 = time.perf_counter()
        # on a terminal the streamed text is the progress; in a log, lines on stderr
        with progress.step("decode", total=n, unit="tokens", show=not progress.stdout_is_tty()) as shown:
            for i in range(n):
                step = last[0, -1].float()
                logits.append(step)
                nxt = int(step.argmax())
                gen.append(nxt)
                stream.add(nxt)
                shown.advance(1)
                if nxt in stop or i == n - 1:
                    break
                last = model(torch.tensor([[nxt]]), cache=cache, use_cache=True).logits
        t_decode = time.perf_counter() - t0
    stream.end()
    return gen, logits, t_prefill, t_decode


def _compare(model: Any, tok: Any, ids: Any, gen: list[int], logits: list[Any]) -> dict[str, Any]:
    """The full cache's own greedy answer, then flashmem's tokens replayed through it:
    top-1 agreement and KL of the next-token distributions. One prefill serves both."""
    import torch
    from transformers import DynamicCache

    from flashmem.metrics import fidelity_metrics

    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    stop = _stop_ids(model, tok)
    stream = _Stream(tok, "full cache: ")
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            n = int(ids.shape[1])
            with progress.step("full cache: prefill", total=n, unit="tokens") as shown:
                with progress.forward_tokens(model, shown):
                    out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            first = out.logits[0, -1].float()
            full_gen = [int(first.argmax())]
            stream.add(full_gen[-1])
            while len(full_gen) < len(gen) and full_gen[-1] not in stop:
                step = model(torch.tensor([full_gen[-1:]]), cache=cache, use_cache=True).logits[0, -1]
                full_gen.append(int(step.argmax()))
                stream.add(full_gen[-1])
            stream.end()
            if len(full_gen) > 1:  # back to the prompt: drop the fed answer tokens
                cache.crop(-(len(full_gen) - 1))
            rows = [first.unsqueeze(0)]
            if len(gen) > 1:
                feed = torch.tensor([gen[:-1]], dtype=ids.dtype)
                rows.append(model(feed, cache=cache, use_cache=True).logits[0].float())
            ref = torch.cat(rows)
    finally:
        model.set_attn_implementation(impl)
    ref_lp = ref.log_softmax(-1)
    lp = torch.stack(logits).log_softmax(-1)
    m = fidelity_metrics(ref_lp, lp, torch.tensor(gen))
    return {
        "kl_mean": m["kl_mean"],
        "kl_max": m["kl_max"],
        "top1_agree": m["top1_agree"],
        "tokens": len(gen),
        "full_text": tok.decode(full_gen, skip_special_tokens=True),
    }


def _full_cache_bytes(model: Any, tokens: int) -> int:
    from flashmem.sizing.calculator import estimate

    text_cfg = model.config.get_text_config(decoder=True)
    est = estimate(model=text_cfg, tokens=tokens, dtype=str(model.dtype).removeprefix("torch."))
    return int(est.full_cache_bytes)


def _per_token(seconds: float, tokens: int) -> str:
    """'48 ms/token' under a second a token, '10.0 s/token' above, with tokens/s."""
    each, rate = seconds / tokens, tokens / seconds
    per = f"{each * 1e3:.3g} ms/token" if each < 1 else f"{each:.1f} s/token"
    digits = 2 if rate < 10 else 1 if rate < 100 else 0
    return f"{per}, {rate:.{digits}f} tokens/s"


def speed_lines(r: dict[str, Any]) -> list[str]:
    """Prefill and decode, each with its tokens, seconds and time per token."""
    n = r["context_tokens"]
    lines = [f"prefill: {n:,} tokens in {r['prefill_s']:.1f} s ({_per_token(r['prefill_s'], n)})"]
    steps = r["generated_tokens"] - 1
    if steps > 0 and r.get("decode_s"):
        # the first token comes with the prefill's logits
        lines.append(
            f"decode:  {steps:,} tokens after the first in {r['decode_s']:.1f} s ({_per_token(r['decode_s'], steps)})"
        )
    return lines


def traffic_lines(r: dict[str, Any]) -> list[str]:
    """What a decode step and the prompt moved (`cache.traffic_report()`), beside the full cache's reads."""
    t = r.get("traffic")
    if not t or not t["steps"]["decode_steps"]:
        return []
    d, tot = t["per_decode_step_median"], t["totals"]

    def mb(n: float) -> str:
        return f"{n / 1e6:,.1f} MB"

    lines = [
        f"per decode step (median): read from device tiers {mb(d['device_read_bytes'])}, written and read back "
        f"to attend {mb(d.get('device_copy_bytes', 0))}, copied from the cold "
        f"tier {mb(d['h2d_bytes'])}, read on the host {mb(d['host_read_bytes'])}, from disk "
        f"{mb(d['disk_read_bytes'])}; a full cache reads {mb(d['full_cache_bytes'])}; pages already held "
        f"{t['page_cache']['hit_rate']:.0%}"
    ]
    redos = t["steps"].get("redo_forwards", 0)
    if redos:  # exact_on_doubt: near ties redone, apart from the decode steps above
        r = t["per_redo_forward_median"]
        lines.append(
            f"near ties redone: {redos:,} of {t['steps']['decode_steps']:,} decode steps, each copying "
            f"{mb(r['h2d_bytes'])} from the cold tier (median; every sealed token read back)"
        )
    if tot["h2d_bytes"] and t["steps"]["prefill_forwards"]:
        lines.append(
            f"whole request: copied from the cold tier {mb(tot['h2d_bytes'])} (the prompt read back"
            + (" and the redos included)" if redos else " included)")
        )
    return lines


def memory_rows(r: dict[str, Any]) -> tuple[list[tuple[str, int]], list[str]]:
    """The memory table's rows (label, bytes) without all-zero tiers, and notes that
    explain the peak and, on a CPU, that the device tiers and a memory cold tier share RAM."""
    mem = r["memory"]
    full = int(mem.get("full_cache_bytes") or r["full_cache_bytes"])
    rows = [(name, int(b)) for name, b in mem["tiers"].items() if b]
    rows += [
        (name.removesuffix("_bytes"), int(mem[name]))
        for name in ("full_layer_bytes", "sliding_layer_bytes")
        if mem[name]
    ]
    if mem.get("doubt_held_bytes"):  # exact_on_doubt's copy of the sliding windows' oldest tokens
        rows.append(("sliding tokens held to redo", int(mem["doubt_held_bytes"])))
    device = int(mem["device_resident_bytes"])
    rows.append(("device resident", device))
    notes = []
    if mem.get("doubt_steps"):  # cache/doubt.py
        notes.append(
            f"near ties (top two next tokens within {r['config'].get('exact_on_doubt')} nats): "
            f"{mem['doubt_redone']} of {mem['doubt_steps']} decode steps run again attending every token "
            f"exactly ({mem.get('doubt_changed', 0)} of them given another token), "
            f"{mem.get('doubt_capped', 0)} left as selected by the cap (exact_on_doubt_share)"
            + (
                f", {mem['doubt_flat']} in a flat distribution (exact_on_doubt_min_mass)"
                if mem.get("doubt_flat")
                else ""
            )
        )
    peak = mem["peak_managed_resident_bytes"] + mem["full_layer_bytes"] + mem["sliding_layer_bytes"]
    peak += mem.get("doubt_held_bytes", 0)
    if peak > device:
        rows.append(("peak (any step)", int(peak)))
        cfg = r["config"]
        exact = int(cfg.get("prefill_exact_tokens") or 0)
        lossy = cfg.get("cold_codec", "exact") != "exact" or cfg.get("cold_low_rank", "none") not in (None, "none")
        if r["context_tokens"] <= exact and lossy:  # the buffered exact prompt (cache/exact_prompt.py)
            notes.append(
                f"peak: the prompt is attended exactly (prefill_exact_tokens: {exact:,}) and the cold tier is "
                "lossy, so the cache held the prompt's K/V until the first generated token, then only the "
                "device-resident tiers"
            )
        else:
            notes.append("peak: the most the cache's device tiers held at any step (the prompt's included)")
    cold = int(mem["cold_bytes"])
    rows.append(("cold tier", cold))
    rows.append(("full cache (DynamicCache)", full))
    store = r["config"].get("cold_store")
    if str(r.get("device", "cpu")).startswith("cpu") and full:
        if store == "memory":
            held = device + cold
            notes.append(
                "on a CPU the device tiers and the memory cold tier are the same RAM: this process holds "
                f"device resident + cold tier = {held:,} bytes ({held / full:.0%} of the full cache); "
                "on an accelerator only the device resident bytes are in its memory, or use cold_store: disk"
            )
        elif store == "layered":
            notes.append(
                "on a CPU the device tiers and the layered cold tier's RAM front are the same RAM; "
                "the rest of the cold tier is on disk"
            )
    return rows, notes


def _print_report(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    mem = r["memory"]
    full = int(mem.get("full_cache_bytes") or r["full_cache_bytes"])
    rows, notes = memory_rows(r)
    t = Table(title=f"KV memory after {mem['tokens_seen']:,} tokens (measured from tensors)")
    t.add_column("tier")
    t.add_column("bytes", justify="right")
    t.add_column("of full cache", justify="right")
    for name, nbytes in rows:
        share = f"{nbytes / full:.2%}" if full else "-"
        if name == "device resident":
            t.add_row(f"[b]{name}[/b]", f"[b]{nbytes:,}[/b]", f"[b]{share}[/b]")
        else:
            t.add_row(name, f"{nbytes:,}", share)
    console = Console(soft_wrap=True)
    console.print(t, soft_wrap=False)
    for note in notes:
        console.print(f"[dim]{note}[/dim]")
    for line in traffic_lines(r):
        console.print(line)
    for line in speed_lines(r):
        console.print(line)
    if "question" in r:
        q = r["question"]
        verdict = f"flashmem {'found' if q['flashmem_found'] else 'did not find'} {q['answer']}"
        if "full_found" in q:
            verdict += f"; the full cache {'found' if q['full_found'] else 'did not find'} it"
        console.print(verdict)
    if "compare_full" in r:
        c = r["compare_full"]
        console.print(
            f"vs full cache over {c['tokens']} generated tokens: top-1 agreement {c['top1_agree']:.1%}, "
            f"mean KL {c['kl_mean']:.4f} nats/token (max {c['kl_max']:.3f})"
        )
