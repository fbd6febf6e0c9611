"""Held-out evaluation: where it runs and how many samples it draws (fnrl.control.eval_lane)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from fnrl.config.base import check, positive

EVAL_SERVERS = ("dedicated", "rollout", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Every `every`-th version is scored on the held-out set:
    greedy accuracy, plus pass@k and mean@k over `samples` draws per problem at the run's
    sampling settings (algo.temperature, top_p, top_k), each draw seeded so that the same
    weights give the same record.

    server: "dedicated" (default) starts one more vLLM server that is never routed
    training work; it loads exactly version v from the relay tier when v is due, so the
    trainer never waits and no rollout's pull waits on an evaluation. It costs a second
    copy of the served weights, a KV cache for `max_num_seqs` sequences and a server
    process (about 1.5 GiB on CPU): the memory plan lists it, and refuses a host that
    cannot hold it before anything starts. "rollout": evaluate on an idle rollout at the
    version it serves (no extra server; that rollout's pulls wait for the evaluation).
    "off": no held-out evaluation.
    """

    server: Literal["dedicated", "rollout", "off"] = "dedicated"
    every: int = 10
    """Score every this many versions (version 0 and the last are always scored)."""
    samples: int = 0
    """Sampled responses per problem (k of pass@k and mean@k); 0: greedy accuracy only.
    Off by default: on a 2-core laptop k = 4 makes each evaluation of the default run
    about 5 times longer (1,280 requests instead of 256), and the CPU it takes is the
    rollouts' and the trainer's."""
    seed: int = 0
    """Sample j of held-out problem i is drawn with seed `seed + i * samples + j`."""
    max_num_seqs: int = 64
    """The dedicated server's concurrent sequences (its KV cache is sized for these)."""

    def __post_init__(self):
        check(self.server in EVAL_SERVERS, "EvalConfig", "server", self.server,
              f"must be one of {EVAL_SERVERS}")
        check(isinstance(self.samples, int) and self.samples >= 0, "EvalConfig", "samples",
              self.samples, "must be an int >= 0 (0: greedy accuracy only)")
        check(self.seed >= 0, "EvalConfig", "seed", self.seed, "must be >= 0")
        positive(self, "max_num_seqs", "every")
