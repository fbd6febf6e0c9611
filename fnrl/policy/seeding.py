"""Seeds and orders that make a run repeatable (`--deterministic`): pure functions.

A sampled token is a function of the logits and the sampler's random state. vLLM
seeds each request's generator from `SamplingParams.seed` (None: one shared generator,
whose draws depend on which requests happen to be batched together). The seed of a
request is derived here from what names the work, never from when it arrived: the run
seed, the trajectory's durable uid (`"<problem uid>/<k>"`) and how many of its tokens
were already streamed (a continuation after an interrupt starts a new request, which
must not replay the first request's draws).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

SEED_BITS = 63
"""vLLM hands the seed to a torch.Generator, which takes any 64-bit value; 63 bits stay
positive in every integer type on the way (JSON, pydantic, int64)."""


def request_seed(run_seed: int, uid: str, streamed: int) -> int:
    """The sampling seed of the request that continues trajectory `uid` after
    `streamed` response tokens, in a run seeded `run_seed`. Stable across processes and
    Python versions (a hash of the names, not Python's salted `hash`)."""
    if streamed < 0:
        raise ValueError(f"streamed={streamed}: a token count must be >= 0")
    digest = hashlib.blake2b(f"{run_seed}/{uid}/{streamed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << SEED_BITS) - 1)


def canonical_order(gids: Sequence[int]) -> tuple[int, ...]:
    """The order a Consume's groups are batched in when the run is deterministic: by
    group id (the order the prompts were drawn), not by when each group's last member
    happened to finish, so packing and micro-batch placement repeat run to run."""
    return tuple(sorted(gids))
