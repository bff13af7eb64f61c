"""Remove store folders left behind by killed processes (opt-in: call it yourself).

A folder is stale when its meta.json says persist=false, names this host, and
its pid is no longer running. Persisted folders are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import socket


def sweep_stale(cold_dir: str) -> list[str]:
    """Delete stale store folders under `cold_dir`; returns the removed paths."""
    removed: list[str] = []
    try:
        names = os.listdir(cold_dir)
    except OSError:
        return removed
    host = socket.gethostname()
    for name in names:
        folder = os.path.join(cold_dir, name)
        try:
            with open(os.path.join(folder, "meta.json"), encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if meta.get("persist", True) or meta.get("host") != host or not isinstance(meta.get("pid"), int):
            continue
        if meta["pid"] == os.getpid() or _alive(meta["pid"]):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
