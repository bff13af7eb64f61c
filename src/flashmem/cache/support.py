"""Which models `flashmem.attach` accepts, checked before anything changes.

The cache replaces the attention of a decoder-only causal LM whose attention
layers call transformers' attention interface (`AttentionInterface`) and its
`Cache.update`. Anything else would be wrong in silence or fail deep inside
transformers, so `check_model` refuses it with one line naming the model type
and what is supported:

- not a transformers model at all (None, a name such as "smollm2", an nn.Linear);
- encoder-decoder models (T5, BART): the cache holds one causal sequence;
- models without attention layers, or whose attention does not go through the
  attention interface (Mamba, T5's own attention);
- models that cannot generate (BERT's masked LM, a bare LlamaModel);
- layer kinds other than full and sliding attention (linear attention, Mamba
  layers of hybrids);
- a sliding window that the config applies to every layer without declaring
  those layers in `layer_types` (Mistral with `sliding_window`, Phi-3): the
  managed layers would attend past the window the model was trained with.
  Sliding layers declared in `layer_types` (Gemma3, Qwen2 with
  `use_sliding_window`) are kept as transformers' own sliding-window layers,
  and a window at least as long as the context never takes effect, so both pass.
"""

from __future__ import annotations

from typing import Any

from flashmem.errors import FlashMemError
from flashmem.models import geometry

SUPPORTED = (
    "allowed: a decoder-only causal LM from transformers (e.g. LlamaForCausalLM, Qwen2ForCausalLM, "
    "Gemma3ForCausalLM; flashmem.load_model('smollm2') returns one) with full-attention layers, "
    "sliding layers only where config.layer_types declares them"
)


def check_model(model: Any) -> None:
    """FlashMemError (one line) unless `attach` can serve `model` exactly."""
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

    if isinstance(model, str):
        raise FlashMemError(
            f"attach: got the string {model!r}, not a model; load it first "
            f"(model, tokenizer = flashmem.load_model({model!r})); {SUPPORTED}"
        )
    if not isinstance(model, PreTrainedModel) or not isinstance(getattr(model, "config", None), PretrainedConfig):
        what = "None" if model is None else f"a {type(model).__module__}.{type(model).__qualname__}"
        kind = " (a torch module, not a transformers model)" if isinstance(model, nn.Module) else ""
        raise FlashMemError(f"attach: got {what}{kind}; {SUPPORTED}")
    cfg = model.config
    name = f"{type(model).__name__} (model_type {getattr(cfg, 'model_type', '?')!r})"
    if getattr(cfg, "is_encoder_decoder", False):
        raise FlashMemError(f"attach: {name} is an encoder-decoder model; {SUPPORTED}")
    text = cfg.get_text_config(decoder=True)
    n_layers = geometry.get(text, "num_hidden_layers")
    heads = geometry.get(text, "num_attention_heads") or geometry.get(text, "n_head")
    if not n_layers or not heads:
        raise FlashMemError(f"attach: {name} has no attention layers; {SUPPORTED}")
    if not getattr(model, "_supports_attention_backend", False):
        raise FlashMemError(
            f"attach: {name} does not route its attention through transformers' attention interface; {SUPPORTED}"
        )
    if not model.can_generate():
        raise FlashMemError(f"attach: {name} is not a causal LM that generates (no LM head); {SUPPORTED}")
    kinds = geometry.layer_types(text, int(n_layers), infer_sliding=False)
    odd = sorted({k for k in kinds if k not in (geometry.FULL, *geometry.WINDOWED_KINDS)})
    if odd:
        raise FlashMemError(f"attach: {name} has layers of kind {', '.join(odd)}; {SUPPORTED}")
    window = geometry.get(text, "sliding_window")
    declared = geometry.get(text, "layer_types") is not None
    in_use = window is not None and geometry.get(text, "use_sliding_window", True)
    context = geometry.get(text, "max_position_embeddings")
    if in_use and not declared and not (context and int(window) >= int(context)):
        raise FlashMemError(
            f"attach: {name} applies sliding_window={window} to every layer, which flashmem's full-attention "
            f"tiers would not honour (different output past {window} tokens); set config.sliding_window = None "
            f"only if the model was trained without it; {SUPPORTED}"
        )
