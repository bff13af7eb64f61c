"""A tiny model served on loopback by uvicorn in a thread (tests of flashmem.serve)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flashmem.config import FlashMemoryConfig
from flashmem_eval.tiny import TINY_VOCAB, build_llama, tiny_tokenizer

MODEL = "tiny"


def tiny_model(seed: int = 0) -> Any:
    """A 2-layer random Llama whose vocabulary matches the tiny tokenizer."""
    return build_llama(
        seed,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=4096,
    )


def tiny_cfg(**kw: Any) -> FlashMemoryConfig:
    base = dict(
        sink_tokens=4,
        gpu_cache_limit=16,
        hca_chunk_size=16,
        csa_band_tokens=32,
        lsa_top_k=2,
        prefill_chunk=32,
        prefetch_threads=0,
    )
    return FlashMemoryConfig(**{**base, **kw})


def make_engine(prefix_dir: Path | None = None, *, quota: int | None = None, **kw: Any) -> Any:
    from flashmem.serve.engine import Engine
    from flashmem.serve.prefix import PrefixStore

    # lossless records by default here: the serve tests compare reused logits with fresh ones to 1e-4
    codec = kw.pop("codec", "exact")
    store = PrefixStore(prefix_dir, quota_bytes=quota, codec=codec) if prefix_dir is not None else None
    cfg = kw.pop("cfg", None) or tiny_cfg()
    return Engine(tiny_model(), tiny_tokenizer(), cfg, model_name=MODEL, prefix_store=store, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(engine: Any, **app_kw: Any) -> Iterator[str]:
    """Run the app on a free loopback port; yields the base URL (http://127.0.0.1:PORT)."""
    import uvicorn

    from flashmem.serve.app import create_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, **app_kw), host="127.0.0.1", port=port, log_level="error", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_for(cond: Any, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())
