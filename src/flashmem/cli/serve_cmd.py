"""`flashmem serve`: the OpenAI-compatible server (needs the `serve` extra)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from flashmem.errors import FlashMemError

if TYPE_CHECKING:
    from flashmem.serve.engine import Engine
    from flashmem.serve.prefix import PrefixBackend


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def default_prefix_dir() -> Path:
    """`$FLASHMEM_CACHE_DIR/prefix` or `~/.cache/flashmem/prefix`."""
    root = os.environ.get("FLASHMEM_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "flashmem") / "prefix"


# Sizes above this are typos (1e400, 10^30): one line, not an OverflowError.
MAX_SIZE = 2**60


def parse_bytes(text: str, flag: str = "--cold-quota") -> int:
    """`500M`, `4G`, `4GiB`, `1e9` -> bytes (K/M/G/T binary, as in the calculator), 1 byte to 1 EiB."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(t[-1:], 1)
    num = t[:-1] if mult > 1 else t
    allowed = "allowed: a size from 1 byte to 1 EiB, like 500M, 4G, 4GiB"
    try:
        raw = float(num) * mult
    except ValueError:
        raise FlashMemError(f"{flag}: {text!r} is not a size; {allowed}") from None
    if raw != raw or not 1 <= raw <= MAX_SIZE:  # NaN, inf, 1e400, 0, negative
        raise FlashMemError(f"{flag}: {text!r}; {allowed}")
    return int(raw)


def serve(
    model: str = typer.Option("smollm2", "--model", "-m", help="built-in name, HF folder or .gguf file"),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="FlashMemory YAML (default: configs/cpu-small.yaml)"
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=0, max=65535),
    max_concurrent: int = typer.Option(4, "--max-concurrent", min=1, help="sequences generating at once"),
    max_queue: int = typer.Option(16, "--max-queue", min=0, help="requests waiting beyond those; more get 429"),
    api_keys: Path | None = typer.Option(
        None, "--api-keys", help="file of 'KEY [TENANT]' lines; then keys are required"
    ),
    prefix_dir: Path | None = typer.Option(
        None, "--prefix-dir", help="stored prefixes (default ~/.cache/flashmem/prefix)"
    ),
    prefix_store: str | None = typer.Option(
        None,
        "--prefix-store",
        help="redis://HOST:PORT/DB, with :PASSWORD@ before HOST if needed (rediss:// for TLS; or $FLASHMEM_PREFIX_STORE_PASSWORD):"
        " prefixes on a Valkey/Redis server shared by replicas, instead of --prefix-dir",
    ),
    cold_quota: str = typer.Option("4G", "--cold-quota", help="quota of stored prefixes (LRU beyond it)"),
    prefix_codec: str = typer.Option(
        "int8",
        "--prefix-codec",
        help="how stored prefix records code their K/V: int8 (KIVI groups of 32, about 1/4 of fp32),"
        " int4, or exact (the model dtype's bytes: a reused prefix continues bit for bit)",
    ),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="no cross-request prefix reuse"),
    max_context: int | None = typer.Option(
        None, "--max-context", min=1, help="tokens per sequence (default: the model's)"
    ),
    max_tokens: int = typer.Option(16, "--default-max-tokens", min=1, help="max_tokens when a request gives none"),
    model_name: str | None = typer.Option(None, "--served-name", help="the model id clients send (default: --model)"),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch CPU threads"),
    dtype: str = typer.Option(
        "float32",
        "--dtype",
        help="the model's weights and K/V: float32, bfloat16 or float16 (without --config, a non-float32"
        " model gets the recipe sized for its bytes, as configs/cpu-small.yaml is for float32; docs/serving.md)",
    ),
    weight_layout: str = typer.Option(
        "auto",
        "--weight-layout",
        help="the linear weights' memory order: auto (stored [in, out] for float32 on an x86 CPU with MKL, where"
        " a batched round's few rows run as one GEMM), out_major (PyTorch's), in_major, or onednn (auto's order"
        " plus a oneDNN copy of each weight for products of 2+ rows where faster: the weights' bytes twice);"
        " docs/serving.md",
    ),
    max_request_bytes: str = typer.Option(
        "4M", "--max-request-bytes", help="largest request body (413 beyond it), e.g. 4M"
    ),
    max_batch: int | None = typer.Option(
        None, "--max-batch", min=1, help="decode steps per model forward (default --max-concurrent; 1: unbatched)"
    ),
    pack_prefill: bool = typer.Option(
        True,
        "--pack-prefill/--no-pack-prefill",
        help="with --max-batch > 1, new prompts' chunks share the decode steps' forward (docs/serving.md)",
    ),
    restore_on_worker: bool = typer.Option(
        False, "--restore-on-worker", hidden=True, help="restore prefixes on the worker thread (benchmarks: the stall)"
    ),
) -> None:
    """Serve the model through the FlashMemory cache with the OpenAI API (completions, chat, streaming)."""
    uvicorn, create_app = _server_modules()
    from flashmem.cli.inputs import check_dtype, check_weight_layout
    from flashmem.cli.run_cmd import _default_config
    from flashmem.config import FlashMemoryConfig
    from flashmem.serve.auth import load_api_keys

    # every argument is checked before a minute of model loading, not after
    torch_dtype = check_dtype(dtype)
    check_weight_layout(weight_layout)
    cfg = FlashMemoryConfig.from_yaml(config or _default_config())
    size_recipe = config is None and dtype != "float32"  # the default file is sized for float32
    keys = load_api_keys(api_keys) if api_keys is not None else None
    quota = parse_bytes(cold_quota)
    _check_prefix_flags(prefix_store, prefix_dir)
    codec = check_prefix_codec(prefix_codec)
    body_limit = parse_bytes(max_request_bytes, "--max-request-bytes")
    _check_port(host, port)
    store, where = _prefix_backend(no_prefix_cache, prefix_store, prefix_dir, quota, codec)
    engine = _load_engine(
        model, cfg, threads, store, model_name=model_name or model, max_concurrent=max_concurrent,
        max_queue=max_queue, max_context=max_context, max_batch=max_batch, restore_off_thread=not restore_on_worker,
        pack_prefill=pack_prefill, dtype=torch_dtype, size_recipe=size_recipe, weight_layout=weight_layout,
    )  # fmt: skip
    typer.echo(f"serving {engine.model_name!r} on http://{host}:{port}/v1; {where}", err=True)
    uvicorn.run(
        create_app(engine, api_keys=keys, default_max_tokens=max_tokens, max_body_bytes=body_limit),
        host=host,
        port=port,
        log_level="warning",
    )


def _server_modules() -> tuple[Any, Any]:
    """uvicorn and `create_app`; a one-line FlashMemError without the serve extra."""
    try:
        import uvicorn

        from flashmem.serve.app import create_app
    except ImportError as exc:
        raise FlashMemError(
            f"flashmem serve needs the serve extra ({exc.name} is missing): pip install torch==2.13.0 -e '.[serve]'"
        ) from None
    return uvicorn, create_app


def _check_prefix_flags(prefix_store: str | None, prefix_dir: Path | None) -> None:
    """A bad --prefix-store URL, or it with --prefix-dir, is one line, before the model loads."""
    from flashmem.serve.prefix_remote import parse_url

    if prefix_store is not None:
        parse_url(prefix_store)
        if prefix_dir is not None:
            raise FlashMemError("--prefix-store and --prefix-dir: give one of them (a server, or a folder)")


def check_prefix_codec(name: str) -> str:
    """The `--prefix-codec` value; a one-line FlashMemError naming the allowed ones otherwise."""
    from flashmem.store.codecs import CODECS

    if name not in CODECS:
        raise FlashMemError(f"--prefix-codec {name!r}: allowed: {', '.join(sorted(CODECS))}")
    return name


def _prefix_backend(
    no_prefix_cache: bool, prefix_store: str | None, prefix_dir: Path | None, quota: int, codec: str = "int8"
) -> tuple[PrefixBackend | None, str]:
    """Where prefixes are kept (a Valkey/Redis server, a folder, or nowhere) and a line saying so."""
    from flashmem.serve.prefix import PrefixStore
    from flashmem.serve.prefix_remote import RedisPrefixStore

    if no_prefix_cache:
        return None, "no prefix reuse"
    if prefix_store is not None:
        shared = RedisPrefixStore(prefix_store, quota_bytes=quota, codec=codec)
        return shared, f"prefixes on {shared.root} (shared; {codec} records; quota {quota} bytes, the server's LRU)"
    folder = PrefixStore(prefix_dir or default_prefix_dir(), quota_bytes=quota, codec=codec)
    return folder, f"prefixes in {folder.root} ({codec} records; quota {quota} bytes)"


def _load_engine(
    model: str,
    cfg: Any,
    threads: int | None,
    store: PrefixBackend | None,
    dtype: Any = None,
    size_recipe: bool = False,
    weight_layout: str = "auto",
    **engine_options: Any,
) -> Engine:
    """Load `model` in `dtype` (None: float32; with `threads` torch threads; its linear weights laid
    out as `weight_layout`, flashmem.models.weight_layout) and its Engine;
    size_recipe: `cfg` replaced by the recipe that configs/cpu-small.yaml is for float32 (1/8
    of 8K), sized for the loaded model's bytes and device; its `exact_on_doubt` is turned off
    for a batch (unbatched_doubt). engine_options: Engine's keywords."""
    import torch

    import flashmem
    from flashmem.cli.run_cmd import sized_default_config
    from flashmem.serve.engine import Engine

    if threads:
        torch.set_num_threads(threads)
    typer.echo(f"loading {model}...", err=True)
    mdl, tok = flashmem.load_model(model, dtype=dtype, weight_layout=weight_layout)
    if weight_layout == "onednn":
        from flashmem.models.onednn_linears import packed_bytes

        typer.echo(f"linear weights: a oneDNN copy of each, {packed_bytes(mdl) / 1e6:.0f} MB more", err=True)
    if size_recipe:
        cfg = sized_default_config(mdl)
    cfg = unbatched_doubt(cfg, engine_options.get("max_batch"), engine_options.get("max_concurrent", 4))
    return Engine(mdl, tok, cfg, prefix_store=store, **engine_options)


def unbatched_doubt(cfg: Any, max_batch: int | None, max_concurrent: int) -> Any:
    """`cfg` for a server that batches (--max-batch, default --max-concurrent, above 1):
    `exact_on_doubt` off, said on stderr. Its redo undoes one sequence's forward, which a batched
    forward shares (Engine refuses the pair); the CPU recipe and configs/cpu-small.yaml carry it,
    and they are served batched by default."""
    batch = max_batch or max_concurrent
    if not cfg.exact_on_doubt or batch <= 1:
        return cfg
    typer.echo(
        f"exact_on_doubt: off (the recipe's near ties decided exactly need --max-batch 1; batch {batch})",
        err=True,
    )
    return cfg.model_copy(update={"exact_on_doubt": 0.0})


def _check_port(host: str, port: int) -> None:
    """A port in use is a one-line error, found before the model loads."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise FlashMemError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
