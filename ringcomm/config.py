"""Reading RINGCOMM_* environment variables: they override arguments (README lists them all).

RINGCOMM_TRANSPORT, a name rather than a value, is read and checked by ringcomm.transports.override.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def flag(raw: str) -> bool:
    """ "1/true/yes/on" or "0/false/no/off" (any case) as a bool; ValueError otherwise."""
    word = raw.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 0 or 1")


def env(name: str, convert: Callable[[str], Any], default: Any) -> Any:
    """``convert(os.environ[name])`` when the variable is set and not empty, else ``default``.

    A value that does not convert raises ValueError naming the variable.
    """
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return convert(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} is not valid: {e}") from None
