"""Hand the C heap's free pages back to the OS once a prompt is in (glibc's `malloc_trim`).

A prompt's forwards allocate and free hundreds of MB of host memory: the model's activations
for each chunk of tokens, attention's buffers, the blocks read back from the cold tier. glibc
keeps what was freed for later allocations (its mmap threshold rises to the largest block freed,
up to 32 MiB, so such blocks come from the heap from then on), and the process's RSS stays at
the prompt's peak. With a cold tier off RAM (disk), RAM is what the budget saves, so after the
prompt the free pages go back: SmolLM2 at 8K and 1/8, 8K-token forwards, 420 MiB held after the
prompt against 37 MiB trimmed (docs/results.md, "The process's RAM with a disk cold tier").
Nothing happens where the C library is not glibc.

That hands back what is free once the prompt is in, not what the heap held at its peak: glibc
serves a step's blocks from the heap once its threshold has risen, and the peaks stay several
times the budget (SmolLM2 at 8K: 4.3x in the prompt). `host_mmap_threshold` (config) fixes the
threshold instead, process-wide, when a cache is made (`set_mmap_threshold`): blocks at least
that large are mapped and go back to the OS as they are freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


def _libc_function(name: str, argtypes: list[type], restype: type) -> Callable[..., int] | None:
    """The C library's function `name`, typed, or None where there is none (musl, macOS,
    Windows: no malloc_trim; no glibc mallopt parameters)."""
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    try:
        fn = getattr(ctypes.CDLL(lib), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim(pad) -> 1 if memory was released, or None without glibc."""
    return _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h); it refuses more than 32 MiB on 64-bit


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt(param, value) -> 1 on success, or None without glibc."""
    return _libc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at nbytes for the whole process (its dynamic rise off):
    blocks of at least nbytes are mapped and unmapped as they are freed -> True where glibc
    took it (False elsewhere). Each such block then costs its page faults when it is made."""
    fn = _mallopt()
    return bool(fn(M_MMAP_THRESHOLD, int(nbytes))) if fn is not None else False


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS -> True where glibc did so (False elsewhere).
    Costs a walk over the heap's free lists (milliseconds); live memory is untouched."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
