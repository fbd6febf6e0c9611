"""The long-tailed response-length workload (RolloutConfig.response_len).

Real reasoning rollouts have heavy-tailed lengths: most responses are short, a few are
many times longer, and those few decide when a synchronous batch is done (StaleFlow
Fig. 4, Laminar §2). The arithmetic task's answers are all a few tokens long, so to get
that shape on any machine we force each trajectory's length: it is drawn per trajectory
id (the same in every preset, so presets see the same workload), the request sets
`ignore_eos` with exactly that many tokens, and the reward grades the text before the
first EOS. The tokens after it are trained on like any other response tokens.
"""

from __future__ import annotations

import math

import numpy as np

from fnrl.config import RolloutConfig


def forced_length(cfg: RolloutConfig, seed: int, tid: int) -> int | None:
    """Response length for trajectory `tid`, or None when responses end at EOS."""
    if cfg.response_len == "natural":
        return None
    rng = np.random.default_rng([seed, tid])
    if cfg.response_len == "lognormal":
        length = cfg.len_median * math.exp(cfg.len_sigma * rng.standard_normal())
    else:
        # Pareto(α) with scale x_m has median x_m·2^(1/α); inverse-CDF sampling.
        alpha = cfg.len_sigma
        scale = cfg.len_median / 2.0 ** (1.0 / alpha)
        length = scale * (1.0 - rng.random()) ** (-1.0 / alpha)
    return int(min(max(round(length), 1), cfg.len_max))
