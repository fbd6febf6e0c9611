"""Verifiable reward: does the response's final answer equal the gold answer?

math-verify parses both sides and compares them symbolically. Its timeouts use
SIGALRM, which only works in the main thread, so they are switched off elsewhere.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
from math_verify import parse, verify


def _timeout(seconds: int) -> int | None:
    return seconds if threading.current_thread() is threading.main_thread() else None


def math_reward(response: str, gold: str) -> float:
    """1.0 when the response's answer matches `gold` (math-verify), else 0.0."""
    text = response.strip()
    if not text:
        return 0.0
    parsed = parse(text, parsing_timeout=_timeout(2))
    if not parsed:
        return 0.0
    ok = verify(parse(gold, parsing_timeout=_timeout(2)), parsed, timeout_seconds=_timeout(2))
    return 1.0 if ok else 0.0


def checked_reward(value: Any) -> float | None:
    """The reward as a float if it is a finite real number, else None.

    None marks the trajectory invalid: it trains nothing and the rest of its group
    still does. A reward function that returns NaN, ±inf, None or a non-scalar says
    it could not score the response; that must not reach the advantages.
    """
    if isinstance(value, (str, bytes)):
        return None   # numpy would parse "1.0"; a string is not a score
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if array.shape != ():
        return None
    reward = float(array)
    return reward if math.isfinite(reward) else None
