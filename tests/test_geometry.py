"""One reading of model geometry for the calculator, the loader and the cache."""

from __future__ import annotations

from flashmem.models import geometry
from flashmem.models.registry import BUILTINS
from flashmem.sizing.specs import resolve_model


def test_gemma3_every_sixth_layer_is_global():
    types = geometry.gemma3_layer_types(18)
    assert [i for i, t in enumerate(types) if t == geometry.FULL] == [5, 11, 17]
    assert BUILTINS["gemma3-270m"].facts["layer_types"] == types
    spec = resolve_model("gemma3-270m")
    assert [layer.kind for layer in spec.layers] == ["full" if t == geometry.FULL else "sliding" for t in types]


def test_heads_and_layer_types_from_a_config_dict():
    cfg = {"num_attention_heads": 8, "hidden_size": 512, "sliding_window": 64, "use_sliding_window": False}
    assert geometry.kv_heads(cfg) == 8 and geometry.head_dim(cfg) == 64
    assert geometry.layer_types(cfg, 2) == (geometry.FULL,) * 2  # window off
    cfg.update(use_sliding_window=True, num_key_value_heads=2, head_dim=32)
    assert geometry.kv_heads(cfg) == 2 and geometry.head_dim(cfg) == 32
    assert geometry.layer_types(cfg, 2) == (geometry.SLIDING,) * 2
    assert geometry.layer_types(cfg, 2, infer_sliding=False) == (geometry.FULL,) * 2
    assert geometry.keeps_window(geometry.SLIDING, cfg) and not geometry.keeps_window(geometry.FULL, cfg)
