"""Environment knobs, read in one place."""

from __future__ import annotations

import os


def env_flag(name: str, default: bool = False) -> bool:
    """The one place environment knobs are read."""
    value = os.environ.get(name)
    return default if value is None else value.lower() in ("1", "true", "yes")
