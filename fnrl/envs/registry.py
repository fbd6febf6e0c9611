"""`make_env`: an environment by its registered name (task.env), built-ins included."""

from __future__ import annotations

from typing import Any

import fnrl.envs.builtin  # noqa: F401  (registers "math" and "tool_arith")
from fnrl.envs.base import ENVS, Env


def make_env(name: str, **kwargs: Any) -> Env:
    """A fresh environment of the registered kind `name`, one per trajectory attempt;
    `kwargs` go to its factory (a ToolRunner, max_turns, ...)."""
    if name not in ENVS:
        raise ValueError(f"invalid task.env={name!r}: registered environments are {sorted(ENVS)}")
    return ENVS[name](**kwargs)
