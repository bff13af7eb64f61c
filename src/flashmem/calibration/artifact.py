"""A calibration on disk: `calibration.safetensors` + `manifest.json` in one folder.

Tensors, per calibrated layer i: `layer.{i}.key_basis`, `layer.{i}.query_proj`,
`layer.{i}.key_proj`, each [kv_heads, rank, head_dim] float32. The manifest
says what produced them: the model's fingerprint (so a calibration for another
model is refused in one line), text, tokens, date, fitted dims, fit KL.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashmem.errors import ConfigError

TENSORS = "calibration.safetensors"
MANIFEST = "manifest.json"
FORMAT = 1


def model_fingerprint(model: Any) -> str:
    """Architecture numbers plus a hash of the first layer's key projection weights.

    Cheap (no pass over all weights) and different for another model, another
    size or other weights of the same architecture.
    """
    cfg = model.config.get_text_config(decoder=True)
    arch = {
        k: getattr(cfg, k, None)
        for k in (
            "model_type",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_size",
            "vocab_size",
            "rope_theta",
        )
    }
    h = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        if "k_proj" in name:
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes()[: 1 << 20])
            break
    return f"{arch['model_type']}-{h.hexdigest()[:16]}"


@dataclass
class Calibration:
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(repr=False)

    @property
    def rank(self) -> int:
        return int(self.manifest["rank"])

    @property
    def layers(self) -> list[int]:
        return [int(i) for i in self.manifest["layers"]]

    def layer(self, idx: int) -> dict[str, torch.Tensor] | None:
        """This layer's projections, or None if it was not calibrated."""
        key = f"layer.{idx}.key_basis"
        if key not in self.tensors:
            return None
        return {n: self.tensors[f"layer.{idx}.{n}"] for n in ("key_basis", "query_proj", "key_proj")}

    def check_model(self, model: Any) -> None:
        fp = model_fingerprint(model)
        if fp != self.manifest.get("model_fingerprint"):
            raise ConfigError(
                f"calibration: made for model {self.manifest.get('model')!r} "
                f"({self.manifest.get('model_fingerprint')}), not this one ({fp}); "
                "allowed: a calibration made with `flashmem calibrate` for this model"
            )

    def save(self, folder: str | os.PathLike[str]) -> Path:
        from safetensors.torch import save_file

        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / (TENSORS + ".tmp")
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(tmp))
        os.replace(tmp, out / TENSORS)
        (out / MANIFEST).write_text(json.dumps(self.manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return out


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    """Read a calibration folder (or its manifest.json); one-line ConfigError if it is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    folder = p.parent if p.name == MANIFEST else p
    man_path, ten_path = folder / MANIFEST, folder / TENSORS
    if not man_path.is_file() or not ten_path.is_file():
        raise ConfigError(
            f"calibration: {folder} has no {MANIFEST} and {TENSORS}; "
            "allowed: a folder written by `flashmem calibrate`"
        )
    try:
        manifest = json.loads(man_path.read_text(encoding="utf-8"))
        tensors = load_file(str(ten_path))
    except (OSError, ValueError, SafetensorError) as exc:
        raise ConfigError(f"calibration: {folder} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"calibration: {man_path} is not a format-{FORMAT} flashmem manifest")
    for i in manifest.get("layers", []):
        for n in ("key_basis", "query_proj", "key_proj"):
            if f"layer.{i}.{n}" not in tensors:
                raise ConfigError(f"calibration: {ten_path} lacks layer.{i}.{n}; the folder is damaged")
    return Calibration(manifest, tensors)
