"""Data-path filters: which rewarded groups are worth training on (pure, numpy).

DAPO dynamic sampling (`--algo.dynamic-sampling`): a group whose valid rewards are all
equal has zero advantage everywhere, so it teaches nothing. It is dropped like an
aborted group, the staleness buffer frees its entry and the cycle admits another
prompt: the batch stays full of informative groups.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def informative(rewards_N: Sequence[float | None]) -> bool:
    """DAPO dynamic sampling: a group teaches something only if its valid rewards differ."""
    r = np.asarray([np.nan if x is None else x for x in rewards_N], np.float64)
    r = r[np.isfinite(r)]
    return r.size >= 2 and bool(np.ptp(r) > 0)


def select_groups(group_rewards: Sequence[Sequence[float | None]], num_groups: int
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """DAPO dynamic sampling over candidate groups, oldest first.

    Returns (take, drop): indices of the first `num_groups` informative groups, and of
    the zero-variance groups before them, which are discarded. `take` is empty while
    fewer than `num_groups` informative groups exist, so the caller waits for more
    rollouts and the batch is always full.
    """
    take, drop = [], []
    for i, rewards in enumerate(group_rewards):
        if len(take) == num_groups:
            break
        (take if informative(rewards) else drop).append(i)
    if len(take) < num_groups:
        return (), tuple(drop)
    return tuple(take), tuple(drop)


def keep_group(rewards_N: Sequence[float | None], *, dynamic_sampling: bool) -> bool:
    """Whether a rewarded group waits to be trained (else it is dropped)."""
    return not dynamic_sampling or informative(rewards_N)
