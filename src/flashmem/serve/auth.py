"""API keys (`--api-keys FILE`) and the tenant salt each key's prefixes are keyed with.

File format: one key per line, optionally followed by a tenant name
(`sk-abc team-a`); blank lines and `#` comments are ignored. Keys naming the
same tenant share its stored prefixes; different tenants never do, even for the
same text (the salt is part of every prefix block's hash).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from flashmem.errors import FlashMemError
from flashmem.user_files import MiB, read_user_text

# Without --api-keys every request is one tenant.
OPEN_SALT = "open"


# A keys file larger than this is a mistake (a device, a log file), not a list of keys.
MAX_KEYS_BYTES = MiB


def load_api_keys(path: str | Path) -> dict[str, str]:
    """key -> tenant salt. FlashMemError (one line) for a missing, unreadable, empty or
    oversized file, and for anything but a regular file (/dev/zero, a FIFO: refused
    without reading or blocking)."""
    p = Path(path)
    text = read_user_text(p, "--api-keys", MAX_KEYS_BYTES)
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) > 2:
            raise FlashMemError(f"--api-keys {p}:{n}: expected 'KEY [TENANT]', got {len(parts)} fields")
        key = parts[0]
        tenant = parts[1] if len(parts) == 2 else key
        keys[key] = salt_for(tenant)
    if not keys:
        raise FlashMemError(f"--api-keys {p}: no keys in it; allowed: one 'KEY [TENANT]' per line")
    return keys


def salt_for(tenant: str) -> str:
    return hashlib.sha256(b"flashmem-tenant|" + tenant.encode()).hexdigest()[:32]


def bearer(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None
