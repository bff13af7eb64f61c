"""A calibration on disk: `calibration.safetensors` + `manifest.json` in one folder.

Tensors, per calibrated layer i: `layer.{i}.key_basis`, `layer.{i}.query_proj`,
`layer.{i}.key_proj`, each [kv_heads, rank, head_dim] float32. Format 2 adds the
cold tier's bases (`cold_low_rank`): `layer.{i}.value_basis` [kv_heads, d, d] and
`layer.{i}.value_energy` [kv_heads, d], and, for layers with RoPE,
`layer.{i}.key_basis_pre` / `layer.{i}.key_energy_pre` (pre-RoPE keys, PCA) and
`layer.{i}.key_enc_pre` / `layer.{i}.key_dec_pre` (the attention-weighted key code,
encoder and decoder rows). Format 1
folders still load (the scorers need nothing more); asking them for the cold
bases is a one-line error. The manifest says what produced them: the model's
fingerprint (so a calibration for another model is refused in one line), text,
tokens, date, fitted dims, fit KL.
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
FORMAT = 2
FORMATS = (1, 2)  # readable; 1 lacks the cold tier's bases
COLD_TENSORS = ("key_basis_pre", "key_energy_pre", "value_basis", "value_energy")


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
    source: str | None = None  # the folder it was read from (error messages)

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

    def cold_bases(self, idx: int, *, keys: bool, values: bool, key_fit: str = "pca") -> dict[str, torch.Tensor]:
        """Layer idx's cold-tier bases ([kv_heads, d, d] rows descending, energies
        [kv_heads, d]) for the parts asked: `key_basis` / `value_basis` (encoders),
        `key_decoder` (the keys' decoder: the basis itself for PCA, another matrix for
        key_fit "attention"). One-line ConfigError when this calibration lacks them
        (format 1, or a layer without RoPE asked for keys)."""
        where = self.source or "in memory"
        if int(self.manifest.get("format", 1)) < 2:
            raise ConfigError(
                f"cold_low_rank: calibration {where} (format 1) has no cold-tier bases; "
                "allowed: recalibrate with `flashmem calibrate --model M` (format 2), or cold_low_rank: none"
            )
        if f"layer.{idx}.value_basis" not in self.tensors:
            raise ConfigError(
                f"cold_low_rank: calibration {where} did not calibrate layer {idx}; "
                "allowed: a calibration of every managed layer (`flashmem calibrate`), or cold_low_rank: none"
            )
        names = [n for n, want in (("key", keys), ("value", values)) if want]
        out = {}
        for n in names:
            suffix = "_pre" if n == "key" else ""
            b = self.tensors.get(f"layer.{idx}.{n}_basis{suffix}")
            if b is None:
                raise ConfigError(
                    f"cold_low_rank: layer {idx} has no pre-RoPE key basis in {where} (no RoPE found "
                    "when it was calibrated); allowed: cold_low_rank: values or none"
                )
            out[f"{n}_basis"] = b
            out[f"{n}_energy"] = self.tensors[f"layer.{idx}.{n}_energy{suffix}"]
        if keys:
            out["key_decoder"] = out["key_basis"]
            if key_fit == "attention":
                enc = self.tensors.get(f"layer.{idx}.key_enc_pre")
                dec = self.tensors.get(f"layer.{idx}.key_dec_pre")
                if enc is None or dec is None:
                    raise ConfigError(
                        f"cold_key_basis: calibration {where} has no attention-weighted key basis for layer "
                        f"{idx}; allowed: recalibrate with `flashmem calibrate --model M`, or cold_key_basis: pca"
                    )
                out["key_basis"], out["key_decoder"] = enc, dec
        return out

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
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS:
        raise ConfigError(
            f"calibration: {man_path} is not a flashmem manifest of format {' or '.join(map(str, FORMATS))}"
        )
    for i in manifest.get("layers", []):
        names = ["key_basis", "query_proj", "key_proj"] + (
            ["value_basis", "value_energy"] if manifest["format"] >= 2 else []
        )
        for n in names:
            if f"layer.{i}.{n}" not in tensors:
                raise ConfigError(f"calibration: {ten_path} lacks layer.{i}.{n}; the folder is damaged")
    return Calibration(manifest, tensors, source=str(folder))
