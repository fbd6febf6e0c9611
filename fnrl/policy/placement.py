"""Where each role of a job runs on a cluster of named nodes: a pure decision.

    plan = place_roles(("a", "b", "c"), num_rollouts=2, trainer_node="a", with_eval=True)

Rules (the seeds run trainer and generation on disjoint machines; LlamaRL §4, Laminar
§5): the trainer's processes all run on `trainer_node` (the first node by default);
rollouts go round-robin over the other nodes (every node when there is only one); the
evaluation server, when there is one, on the least-loaded rollout node (the trainer's
when it is alone). Every node that hosts a trainer or a rollout gets one relay, the
trainer's node first, so the chain's master sits beside the trainer; each rollout pulls
from the relay on its own node (its "home" relay).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Placement:
    trainer: str                    # node of every trainer process
    rollouts: tuple[str, ...]       # node of rollout i
    eval: str | None                # node of the evaluation server (None: none)
    relays: tuple[str, ...]         # node of relay i (relay i is named f"relay{i}")

    def home_relay(self, rid: int) -> int:
        """Index of the relay on rollout `rid`'s node."""
        return self.relays.index(self.rollouts[rid])

    def node_of(self, role: str) -> str:
        """The node of a role by its job name: trainer*, rollout<i>, relay<i>, eval."""
        if role.startswith("trainer"):
            return self.trainer
        if role.startswith("rollout"):
            return self.rollouts[int(role[len("rollout"):])]
        if role.startswith("relay"):
            return self.relays[int(role[len("relay"):])]
        if role == "eval" and self.eval is not None:
            return self.eval
        raise KeyError(f"no node planned for role {role!r}")


def place_roles(nodes: Sequence[str], num_rollouts: int, *, trainer_node: str = "",
                with_eval: bool = False) -> Placement:
    """The placement of the rules above. Raises ValueError for an unknown trainer node,
    an empty or repeated node list, or no rollouts."""
    nodes = tuple(nodes)
    if not nodes or len(set(nodes)) != len(nodes):
        raise ValueError(f"nodes must be distinct and at least one: {nodes}")
    if num_rollouts < 1:
        raise ValueError(f"num_rollouts={num_rollouts}: need at least one rollout")
    trainer = trainer_node or nodes[0]
    if trainer not in nodes:
        raise ValueError(f"trainer node {trainer!r} is not in the cluster's nodes {nodes}")
    generation = tuple(n for n in nodes if n != trainer) or (trainer,)
    rollouts = tuple(generation[i % len(generation)] for i in range(num_rollouts))
    load = Counter(rollouts)
    eval_node = min(generation, key=lambda n: (load[n], generation.index(n))) if with_eval else None
    relays = (trainer,) + tuple(dict.fromkeys(n for n in rollouts if n != trainer))
    return Placement(trainer=trainer, rollouts=rollouts, eval=eval_node, relays=relays)
