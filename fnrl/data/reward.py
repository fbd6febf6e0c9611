"""Verifiable reward: does the response's final answer equal the gold answer?

math-verify parses both sides and compares them symbolically. Its timeouts use
SIGALRM, which only works in the main thread, so they are switched off elsewhere.
"""

from __future__ import annotations

import math
import threading

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


def checked_reward(value: float) -> float | None:
    """The reward if finite, else None: a non-finite reward marks a trajectory invalid."""
    return float(value) if math.isfinite(value) else None
