"""Exact token-in/token-out across turns: the trainer's ids are the ids vLLM saw.

A multi-turn trajectory is its prompt ids followed by turns, each either
- a `SampledTurn`: ids the policy sampled, each with its behaviour log-prob, all under
  one policy version (an interrupt or migration mid-turn makes two sampled turns), or
- a `FedTurn`: ids fed to the model that it did not sample (a tool's result, the
  environment's reply), encoded once when they were produced.
Every turn's ids are appended verbatim: earlier turns are never decoded and encoded
again (re-templating a chat history each turn is how tokens drift; see
../shared/research/scale_sim_agentic.md, Q3.2), so the next generation's prompt is
always an exact extension of the previous one.

`flatten_turns` gives the trainer its per-token arrays: ids, loss mask (1 exactly on
sampled tokens), behaviour log-probs and versions (-1 where fed). A trajectory's
staleness version is its oldest sampled token's version (`oldest_version`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

FED_VERSION = -1
"""The version recorded on fed tokens: no policy produced them."""


@dataclass(frozen=True, kw_only=True)
class SampledTurn:
    version: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str = "stop"

    def __post_init__(self):
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"SampledTurn has {len(self.token_ids)} tokens but "
                             f"{len(self.logprobs)} log-probs")
        if self.version < 0:
            raise ValueError(f"SampledTurn.version={self.version} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class FedTurn:
    token_ids: tuple[int, ...]
    source: str = "tool"
    """Who produced the tokens ("tool", "env"): for metrics and the journal."""

    def __post_init__(self):
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))


Turn = Union[SampledTurn, FedTurn]


@dataclass(frozen=True, kw_only=True, eq=False)
class TokenSequence:
    """A trajectory's response side, per token (length T, prompt excluded)."""

    token_ids_T: np.ndarray      # int32
    loss_mask_T: np.ndarray      # float32: 1 on sampled tokens, 0 on fed ones
    logprobs_T: np.ndarray       # float32: behaviour log-prob; 0 where fed
    versions_T: np.ndarray       # int32: policy version; FED_VERSION where fed
    turn_starts: tuple[int, ...]
    """Offset of each turn's first token (turn boundaries, for the journal and resume)."""


def flatten_turns(turns: Sequence[Turn]) -> TokenSequence:
    """The trainer's arrays for a trajectory's turns, in order, each turn verbatim."""
    ids, mask, logp, vers, starts = [], [], [], [], []
    for turn in turns:
        if not isinstance(turn, (SampledTurn, FedTurn)):
            raise TypeError(f"a turn must be a SampledTurn or a FedTurn, got {type(turn).__name__}")
        starts.append(len(ids))
        ids.extend(turn.token_ids)
        n = len(turn.token_ids)
        if isinstance(turn, SampledTurn):
            mask.extend([1.0] * n)
            logp.extend(turn.logprobs)
            vers.extend([turn.version] * n)
        else:
            mask.extend([0.0] * n)
            logp.extend([0.0] * n)
            vers.extend([FED_VERSION] * n)
    return TokenSequence(token_ids_T=np.asarray(ids, np.int32),
                         loss_mask_T=np.asarray(mask, np.float32),
                         logprobs_T=np.asarray(logp, np.float32),
                         versions_T=np.asarray(vers, np.int32), turn_starts=tuple(starts))


def context_ids(prompt_ids: Sequence[int], turns: Sequence[Turn]) -> tuple[int, ...]:
    """The ids the next generation continues from: the prompt and every turn, verbatim."""
    return tuple(prompt_ids) + tuple(t for turn in turns for t in turn.token_ids)


def oldest_version(turns: Sequence[Turn]) -> int:
    """V_traj: the oldest version that sampled any token (fed tokens do not count)."""
    versions = [t.version for t in turns if isinstance(t, SampledTurn) and t.token_ids]
    if not versions:
        raise ValueError("a trajectory with no sampled tokens has no version")
    return min(versions)


def is_extension(before: Sequence[int], after: Sequence[int]) -> bool:
    """Whether `after` starts with exactly `before` (the prefix property every turn keeps)."""
    return len(after) >= len(before) and tuple(after[:len(before)]) == tuple(before)
