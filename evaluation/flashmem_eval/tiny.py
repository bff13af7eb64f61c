"""Tiny offline tokenizer and random-weight models for fast tests of the harness.

Nothing here is downloaded: the tokenizer is a byte-level BPE trained in well
under a second on the start of the benchmark text; the models are random-weight
transformers configs that build in milliseconds.
"""

from __future__ import annotations

import functools
from typing import Any

TINY_VOCAB = 512


@functools.lru_cache(maxsize=2)
def tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> Any:
    """A byte-level BPE tokenizer (digits are single tokens), with a <bos> token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from flashmem.texts import load_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<bos>", "<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([load_text()[:200_000]], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    return fast


def build_llama(seed: int = 0, attn: str | None = None, **config: Any) -> Any:
    """A random-weight Llama in eval mode: LlamaConfig(**config), weights drawn after
    torch.manual_seed(seed); attn sets the attention implementation (None: default).
    The one tiny-model builder of the tests, the harness and the benchmarks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**config)
    if attn is not None:
        cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def tiny_llama(
    vocab_size: int = TINY_VOCAB,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 131072,
    seed: int = 0,
    attn: str = "sdpa",
) -> Any:
    """A random-weight Llama (GQA) in eval mode, float32, SDPA attention by default."""
    return build_llama(
        seed,
        attn,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
