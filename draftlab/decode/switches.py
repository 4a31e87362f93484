"""draftlab's on/off environment switches (DRAFTLAB_FUSED_STEP, DRAFTLAB_CPU_GQA, DRAFTLAB_COMPILE_GUARDS, ...), read
one way: 1 / true / yes is on, 0 / false / no is off (any case), anything else or unset leaves the default."""

from __future__ import annotations

import os


def env_flag(name: str) -> bool | None:
    """True or False where the environment switch `name` says so, None where it is unset (or says neither)."""
    value = os.environ.get(name, "").lower()
    return True if value in ("1", "true", "yes") else False if value in ("0", "false", "no") else None
