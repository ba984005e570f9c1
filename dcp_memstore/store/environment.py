"""Integer settings from the environment (torchrun's ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK``, ours), read
one way everywhere: an empty value counts as unset, and one that is no int is a ValueError naming it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TypeVar

LOCAL_RANK_MEANING = "torchrun's rank of this process on its node"
LOCAL_WORLD_SIZE_MEANING = "torchrun's number of ranks on this node"
RANK_MEANING = "torchrun's global rank of this process"
WORLD_SIZE_MEANING = "torchrun's number of ranks in the job"
GROUP_RANK_MEANING = "torchrun's rank of this node"

D = TypeVar("D", int, None)


def env_int(var: str, default: D, meaning: str, env: Mapping[str, str] | None = None) -> int | D:
    """``$var`` as an int, ``default`` if it is unset or empty; ValueError naming the variable if it is no
    int (``meaning`` says what it should hold). ``env``: where to look instead of ``os.environ``."""
    raw = (os.environ if env is None else env).get(var, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"${var}={raw!r} is not an int ({meaning})") from None
