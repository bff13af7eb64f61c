"""Offline model loading: built-in packaged models, local HF folders and GGUF files.

Importing this package does not import torch or transformers.
"""

from __future__ import annotations

from flashmem.models.loading import ModelInfo, load_model, model_info
from flashmem.models.registry import BUILTINS, DEFAULT_MODEL, cache_root

__all__ = ["BUILTINS", "DEFAULT_MODEL", "ModelInfo", "cache_root", "load_model", "model_info"]
