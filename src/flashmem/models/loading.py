"""Load a model and its tokenizer, offline.

``load_model(name_or_path)`` accepts a built-in name (``smollm2``, ``gemma3-270m``),
a local Hugging Face folder (config.json + weights) or a ``.gguf`` file.

A GGUF is dequantized by transformers once and saved as fp32 safetensors, with the
tokenizer, in ``<cache root>/<name>-<key>/`` (cache root: ``$FLASHMEM_CACHE_DIR`` or
``~/.cache/flashmem/models``); later loads read that folder and never open the GGUF.
The folder is written under a temp name and renamed when complete; it only counts
as complete if its marker file lists every file with its size, so a half-written or
damaged folder is rebuilt instead of loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flashmem import progress  # noqa: E402
from flashmem.errors import FlashMemError  # noqa: E402
from flashmem.models import geometry  # noqa: E402
from flashmem.models.registry import (  # noqa: E402
    BUILTINS,
    DEFAULT_MODEL,
    BuiltinModel,
    cache_root,
)
from flashmem.models.weight_layout import LAYOUTS, auto_layout, set_linear_layout  # noqa: E402

__all__ = ["load_model", "model_info", "ModelInfo", "resolve", "MARKER"]

log = logging.getLogger(__name__)

MARKER = "flashmem-cache.json"
_FORMAT = 1


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class _Source:
    kind: str  # "builtin" | "gguf" | "folder"
    name: str  # short name used for the cache folder
    builtin: BuiltinModel | None = None
    path: Path | None = None  # gguf file or HF folder

    def cache_dir(self) -> Path:
        if self.kind == "builtin":
            assert self.builtin is not None
            return cache_root() / self.builtin.cache_dir_name
        assert self.kind == "gguf" and self.path is not None
        st = self.path.stat()
        key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        return cache_root() / f"{self.name}-{key}"

    def gguf_file(self) -> Path:
        if self.kind == "builtin":
            assert self.builtin is not None
            return self.builtin.gguf_path()
        assert self.path is not None
        return self.path


def _allowed() -> str:
    return ", ".join(BUILTINS)


def resolve(name_or_path: str | os.PathLike[str]) -> _Source:
    """Turn a name or path into a source; user mistakes raise FlashMemError (one line)."""
    raw = os.fspath(name_or_path)
    if not isinstance(raw, str) or not raw.strip():
        raise FlashMemError(f"model name is empty; use one of: {_allowed()}, or a local folder/.gguf path")
    key = raw.strip()
    if key.lower() in BUILTINS:
        b = BUILTINS[key.lower()]
        return _Source("builtin", b.name, builtin=b)
    p = Path(key).expanduser()
    if p.exists():
        if p.is_file():
            if p.suffix.lower() != ".gguf":
                raise FlashMemError(f"{p} is a file but not a .gguf; give a .gguf file or a Hugging Face model folder")
            return _Source("gguf", _slug(p.stem), path=p.resolve())
        if (p / "config.json").is_file():
            return _Source("folder", _slug(p.name), path=p.resolve())
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _Source("gguf", _slug(ggufs[0].stem), path=ggufs[0].resolve())
        raise FlashMemError(f"{p} has no config.json (nor a single .gguf file); it is not a model folder")
    looks_like_path = os.sep in key or "/" in key or key.startswith((".", "~")) or key.lower().endswith(".gguf")
    if looks_like_path:
        raise FlashMemError(f"model path {key} does not exist")
    raise FlashMemError(
        f"unknown model {key!r}; built-in models are: {_allowed()} (or give a local folder or .gguf path)"
    )


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-.")[:64] or "model"


# ----------------------------------------------------------------------------- cache


def _folder_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MARKER}


def cache_is_complete(folder: Path) -> bool:
    """True when ``folder`` is a finished conversion: marker present and every file it lists intact."""
    try:
        meta = json.loads((folder / MARKER).read_text())
        files: dict[str, int] = meta["files"]
        if meta.get("format") != _FORMAT or "config.json" not in files:
            return False
        if not any(n.endswith(".safetensors") for n in files):
            return False
        for name, size in files.items():
            if (folder / name).stat().st_size != size:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _discard(folder: Path) -> None:
    """Move a folder out of the way (rename first, so it is never half-deleted under its name)."""
    if not folder.exists():
        return
    trash = folder.parent / f".trash-{folder.name}-{os.getpid()}-{time.time_ns()}"
    try:
        os.rename(folder, trash)
    except OSError:
        trash = folder
    shutil.rmtree(trash, ignore_errors=True)


def _clear_gguf_quantization(model: Any) -> None:
    """Make the dequantized model save as a plain fp32 model (no GGUF quantization flag)."""
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        try:
            delattr(cfg, "quantization_config")
        except AttributeError:
            cfg.quantization_config = None
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            try:
                setattr(model, attr, None)
            except AttributeError:
                pass
    if getattr(model, "is_quantized", False) is True:
        try:
            model.is_quantized = False
        except AttributeError:
            pass


def _convert_gguf(gguf: Path) -> tuple[Any, Any]:
    """Dequantize a GGUF with transformers (fp32). A seam: tests replace it with a tiny fake."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(gguf.parent), gguf.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=fname, dtype=torch.float32, local_files_only=True
        )
    except (ValueError, KeyError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FlashMemError(f"cannot convert {gguf} with transformers: {first}") from e
    return model, tok


def _build_cache(src: _Source, target: Path) -> None:
    gguf = src.gguf_file()
    log.info("converting %s to safetensors in %s (one time)", gguf, target)
    t0 = time.perf_counter()
    # about a minute on a busy 2-core CPU for SmolLM2: shown (flashmem.progress) when progress is on
    with progress.step(f"converting {gguf.name} to safetensors (once per model)"):
        model, tok = _convert_gguf(gguf)
    _clear_gguf_quantization(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the final folder follows the umask
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        del model
        import transformers

        meta = {
            "format": _FORMAT,
            "source": src.name,
            "gguf": str(gguf),
            "gguf_sha256": src.builtin.sha256 if src.builtin else None,
            "transformers": transformers.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "convert_seconds": round(time.perf_counter() - t0, 2),
            "files": _folder_files(tmp),
        }
        (tmp / MARKER).write_text(json.dumps(meta, indent=1))
        if target.exists():
            if cache_is_complete(target):  # another process finished first
                shutil.rmtree(tmp, ignore_errors=True)
                return
            _discard(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not cache_is_complete(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------ load


def _load_folder(folder: Path, dtype: Any, device: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    return model, tok


def _finish(model: Any, device: Any, tok: Any, weight_layout: str) -> Any:
    from flashmem.calibration.layer_profile import remember_tokenizer

    model = model.to(device)
    model.eval()
    try:
        set_linear_layout(model, auto_layout(model) if weight_layout == "auto" else weight_layout)
    except ValueError as e:  # onednn on a GPU, or a torch without oneDNN: the user's choice, named
        raise FlashMemError(str(e)) from None
    if getattr(model.config, "_attn_implementation", None) not in ("eager", "sdpa"):
        model.set_attn_implementation("sdpa")
    remember_tokenizer(model, tok)  # attach measures a missing layer profile with it
    return model


def _check_dtype_device(dtype: Any, device: Any) -> Any:
    import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise FlashMemError(f"dtype must be a floating torch dtype (e.g. torch.float32), got {dtype!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise FlashMemError(f"invalid device {device!r}: {str(e).splitlines()[0] if str(e) else e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FlashMemError(f"device {device!r} requested but CUDA is not available here; use device='cpu'")
    return dev


def _warn_if_threads_spin(device: Any) -> None:
    """A CPU model on a busy machine: torch's threads spin while other jobs hold the cores
    (a SmolLM2 chunk ~9x slower at load 8 on 2 cores with 2 threads, flashmem.doctor).
    Warn with the number to set, as `flashmem doctor` advises; OMP_NUM_THREADS set means
    the user chose."""
    import torch

    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    from flashmem.doctor import cpu_load, suggest_threads

    cores, load1 = cpu_load()
    n, t = suggest_threads(cores, load1), torch.get_num_threads()
    if n < t:
        warnings.warn(
            f"torch uses {t} threads on {cores} cores with a load average of {load1:.1f}: waiting threads "
            f"spin and slow every forward; call torch.set_num_threads({n}) (one per idle core) or set OMP_NUM_THREADS",
            RuntimeWarning,
            stacklevel=3,
        )


def load_model(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    dtype: Any = None,
    device: Any = "cpu",
    weight_layout: str = "auto",
) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)`` for a built-in name, an HF folder or a .gguf file.

    dtype defaults to torch.float32. GGUF sources are converted once and cached
    (see module docstring); the model is in eval mode with "sdpa" or "eager" attention.
    weight_layout: how the linear weights lie in memory (``flashmem.models.weight_layout``):
    ``auto`` (stored [in, out] for fp32 on an x86 CPU with MKL, where a batched decode
    round's few rows run as one GEMM), ``out_major`` (PyTorch's), ``in_major``, or ``onednn``
    (auto's order plus a copy of each weight in oneDNN's layout for products of 2+ rows, where
    that measures faster: a batched server's rounds and prompt chunks; the linear weights'
    bytes twice, ``flashmem.models.onednn_linears``).
    """
    import torch

    if dtype is None:
        dtype = torch.float32
    device = _check_dtype_device(dtype, device)
    if weight_layout != "auto" and weight_layout not in LAYOUTS:
        raise FlashMemError(f"weight_layout must be auto, {', '.join(LAYOUTS)}; got {weight_layout!r}")
    src = resolve(name_or_path)
    _warn_if_threads_spin(device)
    if src.kind == "folder":
        assert src.path is not None
        has_weights = any(src.path.glob("*.safetensors")) or any(src.path.glob("*.bin"))
        if not has_weights:
            raise FlashMemError(f"{src.path} has a config.json but no weights (*.safetensors or *.bin)")
        model, tok = _load_folder(src.path, dtype, device)
        return _finish(model, device, tok, weight_layout), tok

    target = src.cache_dir()
    if cache_is_complete(target):
        try:
            model, tok = _load_folder(target, dtype, device)
        except FlashMemError:
            raise
        except Exception as e:  # damaged in a way the marker cannot see: rebuild once
            log.warning("cached model %s failed to load (%s); rebuilding", target, e)
            _discard(target)
        else:
            return _finish(model, device, tok, weight_layout), tok
    elif target.exists():
        log.warning("cached model %s is incomplete; rebuilding", target)
    _build_cache(src, target)
    if not cache_is_complete(target):  # pragma: no cover - defensive
        raise FlashMemError(f"could not write a complete model cache in {target}")
    model, tok = _load_folder(target, dtype, device)
    return _finish(model, device, tok, weight_layout), tok


# ------------------------------------------------------------------------------ info


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    max_position_embeddings: int | None
    source_file: str | None  # the GGUF / folder the weights come from (None if not located)
    info_from: str  # "cache" | "folder" | "registry" | "gguf"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d


def _info_from_config(name: str, cfg: dict[str, Any], source_file: str | None, info_from: str) -> ModelInfo:
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    n = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    kv = int(geometry.kv_heads(cfg) or heads)
    head_dim = int(geometry.head_dim(cfg) or hidden // heads)
    sw = cfg.get("sliding_window")
    lt = geometry.layer_types(cfg, n)
    return ModelInfo(
        name=name,
        model_type=str(cfg.get("model_type", "unknown")),
        num_layers=n,
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        hidden_size=hidden,
        layer_types=tuple(lt),
        sliding_window=int(sw) if sw else None,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        source_file=source_file,
        info_from=info_from,
    )


def _info_from_gguf(name: str, gguf: Path) -> ModelInfo:
    """Shape facts from GGUF metadata (gguf.GGUFReader); no weights are dequantized."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))

    def field(key: str, default: Any = None) -> Any:
        f = r.fields.get(key)
        return f.contents() if f is not None else default

    arch = field("general.architecture")
    if arch is None:
        raise FlashMemError(f"{gguf} has no general.architecture metadata; not a model GGUF")
    n = int(field(f"{arch}.block_count"))
    heads = field(f"{arch}.attention.head_count")
    heads = int(heads[0] if isinstance(heads, list) else heads)
    kv = field(f"{arch}.attention.head_count_kv", heads)
    kv = int(kv[0] if isinstance(kv, list) else kv)
    hidden = int(field(f"{arch}.embedding_length"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    sw = field(f"{arch}.attention.sliding_window")
    if arch == "gemma3":  # the GGUF has no layer pattern: transformers' Gemma3 default
        lt = list(geometry.gemma3_layer_types(n))
    else:
        lt = ["sliding_attention" if sw else "full_attention"] * n
    return ModelInfo(
        name=name,
        model_type={"gemma3": "gemma3_text"}.get(arch, arch),
        num_layers=n,
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        hidden_size=hidden,
        layer_types=tuple(lt),
        sliding_window=int(sw) if sw else None,
        max_position_embeddings=field(f"{arch}.context_length"),
        source_file=str(gguf),
        info_from="gguf",
    )


def model_info(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL) -> ModelInfo:
    """Layers, KV heads, head_dim and layer types, without loading weights.

    Order: the converted cache folder's config.json if present; for a built-in the
    facts in the registry (checked against the real config by the tests); an HF
    folder's config.json; else the GGUF metadata.
    """
    src = resolve(name_or_path)
    if src.kind == "folder":
        assert src.path is not None
        cfg = json.loads((src.path / "config.json").read_text())
        return _info_from_config(src.name, cfg, str(src.path), "folder")
    target = src.cache_dir()
    if cache_is_complete(target):
        cfg = json.loads((target / "config.json").read_text())
        meta = json.loads((target / MARKER).read_text())
        return _info_from_config(src.name, cfg, meta.get("gguf"), "cache")
    if src.builtin is not None:
        b = src.builtin
        f = dict(b.facts)
        source = None
        if not b.missing_packages() and b.name == "smollm2":
            source = str(b.gguf_path(verify=False))
        return ModelInfo(
            name=b.name,
            model_type=f["model_type"],
            num_layers=f["num_layers"],
            num_attention_heads=f["num_attention_heads"],
            num_kv_heads=f["num_kv_heads"],
            head_dim=f["head_dim"],
            hidden_size=f["hidden_size"],
            layer_types=tuple(f["layer_types"]),
            sliding_window=f["sliding_window"],
            max_position_embeddings=f["max_position_embeddings"],
            source_file=source,
            info_from="registry",
        )
    assert src.path is not None
    return _info_from_gguf(src.name, src.path)
