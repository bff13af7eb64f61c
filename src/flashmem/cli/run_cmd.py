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
import time
from pathlib import Path
from typing import Any

import typer

from flashmem.errors import FlashMemError

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "cpu-small.yaml"


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
    fact_depth: float = typer.Option(0.2, "--fact-depth", help="--ask: where the fact goes, 0 = start of the context"),
    compare_full: bool = typer.Option(False, "--compare-full", help="also run the plain cache and compare"),
    json_out: Path | None = typer.Option(None, "--json-out", help="write the measurements as JSON"),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch CPU threads"),
) -> None:
    """Generate with the FlashMemory cache and report memory, speed and (optionally) fidelity."""
    import torch
    from rich.console import Console

    import flashmem
    from flashmem.cli.inputs import check_output_path
    from flashmem.config import FlashMemoryConfig

    console = Console(stderr=True)
    check_output_path(json_out, "--json-out")  # before minutes of work, not after
    if threads:
        torch.set_num_threads(threads)
    cfg = FlashMemoryConfig.from_yaml(config or _default_config())
    source = _read_input(input, text)
    if ask is None:
        ask = input is None and prompt is None
    if ask and prompt is not None:
        raise FlashMemError("--ask and --prompt both given; allowed: one of them")
    n_new = max_new_tokens or (16 if ask else 64)
    console.print(f"[dim]loading {model}...[/dim]")
    mdl, tok = flashmem.load_model(model)
    planted = None
    if ask:
        from flashmem.cli.fact import plant_fact

        planted = plant_fact(tok, source, context_tokens, fact_depth, seed=context_tokens or 0)
        ids = torch.tensor([planted.ids])
        back = ids.shape[1] - planted.fact_token
        console.print(
            f"planted at token {planted.fact_token:,} of {ids.shape[1]:,} ({back:,} tokens back): {planted.fact}"
        )
        console.print(f"asked at the end: {planted.question}")
    else:
        ids = _encode(tok, source, prompt, context_tokens)
    console.print(f"[dim]context: {ids.shape[1]} tokens; config: {config or _default_config()}[/dim]")

    cache = flashmem.attach(mdl, cfg)
    try:
        result = _measure(mdl, tok, cache, ids, n_new, model, cfg, compare_full)
    finally:
        cache.close()  # also on SIGTERM (main turns it into SystemExit): no store folder is left
    if planted is not None:
        from flashmem.cli.fact import found

        result["question"] = {
            "fact": planted.fact,
            "fact_token": planted.fact_token,
            "answer": planted.answer,
            "flashmem_found": found(result["text"], planted.answer),
        }
        if compare_full:
            result["question"]["full_found"] = found(result["compare_full"]["full_text"], planted.answer)
    _print_report(result)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2, default=str))


def _measure(
    mdl: Any, tok: Any, cache: Any, ids: Any, max_new_tokens: int, model: str, cfg: Any, compare_full: bool
) -> dict[str, Any]:
    typer.echo("flashmem:   ", nl=False)
    gen, logits, t_prefill, t_decode = _generate(mdl, tok, cache, ids, max_new_tokens, stream=True)
    report = cache.memory_report()
    result: dict[str, Any] = {
        "model": model,
        "context_tokens": int(ids.shape[1]),
        "generated_tokens": len(gen),
        "text": tok.decode(gen, skip_special_tokens=True),
        "prefill_s": t_prefill,
        "prefill_tokens_per_s": ids.shape[1] / t_prefill,
        "decode_tokens_per_s": (len(gen) - 1) / t_decode if len(gen) > 1 and t_decode > 0 else None,
        "memory": report,
        "config": cfg.model_dump(),
    }
    full_bytes = _full_cache_bytes(mdl, report["tokens_seen"])
    result["full_cache_bytes"] = full_bytes
    if compare_full:
        result["compare_full"] = _compare(mdl, tok, ids, gen, logits)
    return result


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


def _generate(
    model: Any, tok: Any, cache: Any, ids: Any, n: int, stream: bool
) -> tuple[list[int], list[Any], float, float]:
    """Greedy decoding; returns tokens, the logits that chose them, prefill and decode seconds."""
    import torch

    import flashmem

    logits = []
    with torch.no_grad():
        t0 = time.perf_counter()
        # model-level chunks: one forward over a long input would allocate activations for all of it
        last = flashmem.prefill(model, cache, ids)
        t_prefill = time.perf_counter() - t0
        gen: list[int] = []
        t0 = time.perf_counter()
        for i in range(n):
            step = last[0, -1].float()
            logits.append(step)
            nxt = int(step.argmax())
            gen.append(nxt)
            if stream:
                typer.echo(tok.decode([nxt]), nl=False)
            if nxt == tok.eos_token_id or i == n - 1:
                break
            last = model(torch.tensor([[nxt]]), cache=cache, use_cache=True).logits
        t_decode = time.perf_counter() - t0
    if stream:
        typer.echo("")
    return gen, logits, t_prefill, t_decode


def _compare(model: Any, tok: Any, ids: Any, gen: list[int], logits: list[Any]) -> dict[str, Any]:
    """The full cache's own greedy answer, then flashmem's tokens replayed through it:
    top-1 agreement and KL of the next-token distributions. One prefill serves both."""
    import torch
    from transformers import DynamicCache

    from flashmem.metrics import fidelity_metrics

    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            first = out.logits[0, -1].float()
            typer.echo("full cache: ", nl=False)
            full_gen = [int(first.argmax())]
            typer.echo(tok.decode(full_gen[-1:]), nl=False)
            while len(full_gen) < len(gen) and full_gen[-1] != tok.eos_token_id:
                step = model(torch.tensor([full_gen[-1:]]), cache=cache, use_cache=True).logits[0, -1]
                full_gen.append(int(step.argmax()))
                typer.echo(tok.decode(full_gen[-1:]), nl=False)
            typer.echo("")
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
    from flashmem.memory.calculator import estimate

    text_cfg = model.config.get_text_config(decoder=True)
    est = estimate(model=text_cfg, tokens=tokens, dtype=str(model.dtype).removeprefix("torch."))
    return int(est.full_cache_bytes)


def _print_report(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    mem = r["memory"]
    full = r["full_cache_bytes"]
    t = Table(title=f"KV memory after {mem['tokens_seen']} tokens (measured from tensors)")
    t.add_column("tier")
    t.add_column("bytes", justify="right")
    t.add_column("of full cache", justify="right")
    for name, nbytes in mem["tiers"].items():
        t.add_row(name, f"{nbytes:,}", f"{nbytes / full:.2%}")
    for name in ("full_layer_bytes", "sliding_layer_bytes"):
        if mem[name]:
            t.add_row(name.removesuffix("_bytes"), f"{mem[name]:,}", f"{mem[name] / full:.2%}")
    t.add_row(
        "[b]device resident[/b]",
        f"[b]{mem['device_resident_bytes']:,}[/b]",
        f"[b]{mem['device_resident_bytes'] / full:.2%}[/b]",
    )
    peak = mem["peak_managed_resident_bytes"] + mem["full_layer_bytes"] + mem["sliding_layer_bytes"]
    if peak > mem["device_resident_bytes"]:  # an exact prompt held its K/V until the first token
        t.add_row("peak (any step)", f"{peak:,}", f"{peak / full:.2%}")
    t.add_row("cold tier", f"{mem['cold_bytes']:,}", f"{mem['cold_bytes'] / full:.2%}")
    t.add_row("full cache (DynamicCache)", f"{full:,}", "100.00%")
    console = Console()
    console.print(t)
    speed = f"prefill {r['prefill_tokens_per_s']:.1f} tok/s ({r['prefill_s']:.1f} s)"
    if r["decode_tokens_per_s"]:
        speed += f", decode {r['decode_tokens_per_s']:.2f} tok/s"
    console.print(speed)
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
