"""User-facing errors: one line that names what was wrong and what is allowed.

The CLI prints `str(err)` and exits with status 2 for any `FlashMemError`;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class FlashMemError(Exception):
    """A mistake in what the user gave (a config, a file, a flag, a request)."""


class ConfigError(FlashMemError, ValueError):
    """A config key, value or combination that is not allowed."""


class ModelNotAvailableError(FlashMemError):
    """A model that is not installed here; the message holds the install command."""


class ChecksumError(FlashMemError):
    """Bytes read back from the cold tier do not match the checksum written with them."""


class BudgetWarning(UserWarning):
    """A budget the solver cannot reach at this length: the config it returns holds more."""


class ColdStoreError(FlashMemError):
    """The cold tier cannot be used as configured (missing dir, not writable, disk full)."""
