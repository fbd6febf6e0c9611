"""Ablation presets: plain functions from a RunConfig to a RunConfig.

    python -m fnrl.experiments.math_grpo --preset staleflow [--coord.eta 2 ...]

A preset sets the coordinator (fnrl.config.CoordinatorConfig) and nothing about the
model, task or algorithm, so presets compare like with like; flags given on the
command line override what the preset set. Every preset runs the same loop, the same
data path (per-trajectory streaming into the partial response pool) and writes the
same metrics (fnrl.control.report.COUNT_KEYS, staleness histogram, idle ratios, KV use).

  sync             η = 0: generate a batch on the newest version, train, pull, repeat.
  one_step         η = 1; a rollout pulls only when it has nothing left (no interrupts).
  partial_rollout  AReaL-like: every new version interrupts running trajectories, the
                   rollout pulls, and they continue on the new weights (re-prefill);
                   η bounds the oldest token of a trajectory.
  laminar          trajectory-level asynchrony: pull on running dry, dynamic repack of
                   long tails, a loose bound (η = 4) in place of Laminar's none.
  staleflow        StaleFlow: lazy per-rollout sync, throughput routing, migration, η = 1.
  fnrl             StaleFlow's coordination plus OrchestrRL's balancer, with η = 2.
                   Laminar's repack is not in it: on every simulated setup it did not
                   help (docs/simulation.md, "fnrl's mechanisms"), since lazy sync and
                   migration already free a rollout held by long tails; `coord.repack:on`
                   adds it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from fnrl.config.coord import BalanceConfig, CoordinatorConfig, RepackConfig, RoutingConfig
from fnrl.config.run import RunConfig


def _coord(cfg: RunConfig, name: str, **kw) -> RunConfig:
    # The cost model describes the engine, not the policy: every preset keeps it.
    engine = {"cost": cfg.coord.cost, "cost_file": cfg.coord.cost_file}
    return dataclasses.replace(cfg, preset=name, coord=CoordinatorConfig(**engine, **kw))


def sync(cfg: RunConfig) -> RunConfig:
    return _coord(cfg, "sync", eta=0, routing=RoutingConfig(sync="greedy", migrate=False))


def one_step(cfg: RunConfig) -> RunConfig:
    return _coord(cfg, "one_step", eta=1, routing=RoutingConfig(sync="on_idle", migrate=False))


def partial_rollout(cfg: RunConfig) -> RunConfig:
    return _coord(cfg, "partial_rollout", eta=2,
                  routing=RoutingConfig(sync="greedy", migrate=False))


def laminar(cfg: RunConfig) -> RunConfig:
    return _coord(cfg, "laminar", eta=4, routing=RoutingConfig(sync="on_idle", migrate=False),
                  repack=RepackConfig())


def staleflow(cfg: RunConfig) -> RunConfig:
    return _coord(cfg, "staleflow", eta=1, routing=RoutingConfig(sync="lazy", migrate=True))


def fnrl(cfg: RunConfig) -> RunConfig:
    return _coord(cfg, "fnrl", eta=2, routing=RoutingConfig(sync="lazy", migrate=True),
                  balance=BalanceConfig())


PRESETS: dict[str, Callable[[RunConfig], RunConfig]] = {
    "sync": sync, "one_step": one_step, "partial_rollout": partial_rollout,
    "laminar": laminar, "staleflow": staleflow, "fnrl": fnrl}
DEFAULT_PRESET = "fnrl"


def apply_preset(name: str, cfg: RunConfig | None = None) -> RunConfig:
    """`cfg` (defaults if None) with preset `name`'s coordinator."""
    if name not in PRESETS:
        raise ValueError(f"invalid config RunConfig.preset={name!r}: must be one of "
                         f"{sorted(PRESETS)}")
    return PRESETS[name](cfg or RunConfig())
