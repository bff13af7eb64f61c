"""benchmarks/gpu_check.py's flashmem config on CUDA is the recipe as `flashmem.attach(model)` builds
it there: the prompt streamed in ACCELERATOR_PREFILL_CHUNK-token chunks, not the CPU's 512 (which
reads every earlier block back 8x as often). Checked without a GPU: the config depends only on
the device's type, and a meta-device model stands for one on the accelerator."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from flashmem.cache.attach import ACCELERATOR_PREFILL_CHUNK

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402


def _model():
    return gpu_check.build_llama(gpu_check.SMOKE, 2, torch.bfloat16, torch.device("meta"))


def test_on_cuda_the_prompt_streams_in_the_accelerator_chunks():
    model = _model()
    cuda = gpu_check.recipe_config(1 / 4, 4096, model, torch.device("cuda"))
    cpu = gpu_check.recipe_config(1 / 4, 4096, model, torch.device("cpu"))
    assert ACCELERATOR_PREFILL_CHUNK == 4096
    assert cuda.prefill_chunk == ACCELERATOR_PREFILL_CHUNK
    assert cpu.prefill_chunk == 512  # the recipe's own, as on the CPU smoke run
    # everything else is the recipe at that budget, cold tier in host memory, prefetch on
    for cfg in (cuda, cpu):
        assert cfg.cold_store == "memory" and cfg.prefetch_threads == 2 and cfg.lsa_layer_shares is None
    assert cuda.model_dump() | {"prefill_chunk": 512} == cpu.model_dump()


def test_the_device_rerank_variant_keeps_its_overrides_and_the_chunk():
    cfg = gpu_check.recipe_config(0.75, 4096, _model(), torch.device("cuda"), **gpu_check.DEVICE_RERANK)
    assert cfg.prefill_chunk == ACCELERATOR_PREFILL_CHUNK
    assert cfg.lsa_rerank_codec == "int4" and cfg.lsa_rerank_on_device is True
