"""Held-out scores from per-problem rewards: greedy accuracy, pass@k and mean@k.

Pure functions (no I/O). A problem counts as solved by a response whose reward is at
least `SOLVED` (the verifier's 1 for a correct final answer; shaping terms such as a
format bonus stay below a second correct answer's worth, see fnrl.data.reward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SOLVED = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` samples of which `c` are correct (Chen et
    al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1):
    1 - C(n-c, k) / C(n, k), the chance that k of the n samples drawn without
    replacement hold at least one correct one. Computed as a product, so large n does
    not overflow."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@dataclass(frozen=True, kw_only=True)
class ProblemScore:
    """One held-out problem's rewards: its greedy response and its sampled ones."""

    level: int
    greedy: float
    samples: tuple[float, ...] = ()


def eval_record(scores: Sequence[ProblemScore], *, k: int) -> dict:
    """The scores of an `eval` record (metrics.jsonl) over `scores`:

    accuracy            greedy accuracy (mean reward of the greedy responses)
    accuracy_level{L}   the same per task level
    pass@{k}, mean@{k}  with k sampled responses per problem: the unbiased pass@k
                        (here n = k: a problem with any correct sample counts), and the
                        mean reward over all samples (= pass@1's estimate for 0/1 rewards)
    pass@1              the unbiased pass@1 from the same k samples
    num_problems, samples_per_problem
    """
    if not scores:
        raise ValueError("eval_record: no held-out problems were scored")
    if any(len(s.samples) != k for s in scores):
        raise ValueError(f"eval_record: every problem needs k={k} sampled rewards")
    greedy = np.array([s.greedy for s in scores], np.float64)
    record = {"accuracy": float(greedy.mean())}
    levels = sorted({s.level for s in scores})
    for level in levels:
        record[f"accuracy_level{level}"] = float(np.mean(
            [s.greedy for s in scores if s.level == level]))
    if k > 0:
        rewards_PxK = np.array([s.samples for s in scores], np.float64)
        correct_P = (rewards_PxK >= SOLVED).sum(axis=1)
        record[f"pass@{k}"] = float(np.mean([pass_at_k(k, int(c), k) for c in correct_P]))
        record[f"mean@{k}"] = float(rewards_PxK.mean())
        record["pass@1"] = float(np.mean([pass_at_k(k, int(c), 1) for c in correct_P]))
    record.update(num_problems=len(scores), samples_per_problem=k)
    return record


def sample_seed(base: int, problem: int, sample: int, samples: int) -> int:
    """The seed of sample `sample` of held-out problem `problem`: the same weights and
    seeds draw the same responses, in the run and in a stop-the-world re-evaluation."""
    return base + problem * samples + sample


def finite_or_zero(x: float | None) -> float:
    """A reward the verifier could not give (None, non-finite) scores 0."""
    return 0.0 if x is None or not math.isfinite(x) else float(x)
