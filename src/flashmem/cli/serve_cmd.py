"""`flashmem serve`: the OpenAI-compatible server (needs the `serve` extra)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import typer

from flashmem.errors import FlashMemError


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
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="no cross-request prefix reuse"),
    max_context: int | None = typer.Option(
        None, "--max-context", min=1, help="tokens per sequence (default: the model's)"
    ),
    max_tokens: int = typer.Option(16, "--default-max-tokens", min=1, help="max_tokens when a request gives none"),
    model_name: str | None = typer.Option(None, "--served-name", help="the model id clients send (default: --model)"),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch CPU threads"),
    max_request_bytes: str = typer.Option(
        "4M", "--max-request-bytes", help="largest request body (413 beyond it), e.g. 4M"
    ),
) -> None:
    """Serve the model through the FlashMemory cache with the OpenAI API (completions, chat, streaming)."""
    try:
        import uvicorn

        from flashmem.serve.app import create_app
    except ImportError as exc:
        raise FlashMemError(
            f"flashmem serve needs the serve extra ({exc.name} is missing): pip install torch==2.13.0 -e '.[serve]'"
        ) from None
    import torch

    import flashmem
    from flashmem.cli.run_cmd import _default_config
    from flashmem.config import FlashMemoryConfig
    from flashmem.serve.auth import load_api_keys
    from flashmem.serve.engine import Engine
    from flashmem.serve.prefix import PrefixBackend, PrefixStore
    from flashmem.serve.prefix_remote import RedisPrefixStore, parse_url

    cfg = FlashMemoryConfig.from_yaml(config or _default_config())
    keys = load_api_keys(api_keys) if api_keys is not None else None
    quota = parse_bytes(cold_quota)
    if prefix_store is not None:
        parse_url(prefix_store)  # a bad URL is one line, before the model loads
        if prefix_dir is not None:
            raise FlashMemError("--prefix-store and --prefix-dir: give one of them (a server, or a folder)")
    body_limit = parse_bytes(max_request_bytes, "--max-request-bytes")
    _check_port(host, port)  # before a minute of model loading, not after
    store: PrefixBackend | None = None
    where = "no prefix reuse"
    if no_prefix_cache:
        pass
    elif prefix_store is not None:
        shared = RedisPrefixStore(prefix_store, quota_bytes=quota)
        store = shared
        where = f"prefixes on {shared.root} (shared; quota {quota} bytes, the server's LRU)"
    else:
        folder = PrefixStore(prefix_dir or default_prefix_dir(), quota_bytes=quota)
        store = folder
        where = f"prefixes in {folder.root} (quota {quota} bytes)"
    if threads:
        torch.set_num_threads(threads)
    typer.echo(f"loading {model}...", err=True)
    mdl, tok = flashmem.load_model(model)
    engine = Engine(
        mdl,
        tok,
        cfg,
        model_name=model_name or model,
        prefix_store=store,
        max_concurrent=max_concurrent,
        max_queue=max_queue,
        max_context=max_context,
    )
    typer.echo(f"serving {engine.model_name!r} on http://{host}:{port}/v1; {where}", err=True)
    uvicorn.run(
        create_app(engine, api_keys=keys, default_max_tokens=max_tokens, max_body_bytes=body_limit),
        host=host,
        port=port,
        log_level="warning",
    )


def _check_port(host: str, port: int) -> None:
    """A port in use is a one-line error, found before the model loads."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise FlashMemError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
