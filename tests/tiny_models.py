"""Tiny random-weight models of the architectures flashmem supports (build in ms)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from flashmem_eval.tiny import build_llama


def tiny_llama(layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    return build_llama(
        seed,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=1 << 17,
    )


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=8192,
    )
    return Qwen2ForCausalLM(cfg).eval()


def tiny_gemma3(seed: int = 0) -> Gemma3ForCausalLM:
    """Sliding layers (window 16) and global layers, like Gemma3's 5:1 pattern, shrunk."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=128,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=8192,
    )
    return Gemma3ForCausalLM(cfg).eval()


MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "gemma3": tiny_gemma3}
