"""The preset's coordinator as the simulator runs it: the real job's preset
(fnrl.config.presets) with the cost model `SimConfig.coord_cost` names, and the
mechanisms a `SimConfig` switches off (`ablate`) or on (`enable`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fnrl.config import BalanceConfig, CostModel, RepackConfig
from fnrl.config.presets import apply_preset
from fnrl.policy import schedule
from fnrl.sim import costs
from fnrl.sim.config import SimConfig


def _switch(coord, name: str, on: bool):
    """The coordinator with mechanism `name` (config.ABLATIONS) switched on or off.
    Off: lazy sync becomes greedy (StaleFlow's vanilla sync, §6.5), routing the fewest
    trajectories (its vanilla routing), the sampler the
    protocol's head buffer (§4.2), η the one-step bound (the least that keeps generation
    overlapped with training). `enable` takes the first four, "global_sync"
    (config.ENABLES: every rollout pulls at once, once all have run dry) and "dispatch"
    (every waiting trajectory routed at once, by count; the engines queue)."""
    routing = coord.routing
    if name == "repack":
        return dataclasses.replace(coord, repack=(coord.repack or RepackConfig()) if on else None)
    if name == "balance":
        return dataclasses.replace(coord, balance=(coord.balance or BalanceConfig()) if on else None)
    if name == "migration":
        return dataclasses.replace(coord, routing=dataclasses.replace(routing, migrate=on))
    if name == "lazy_sync":
        sync = "lazy" if on else ("greedy" if routing.sync == "lazy" else routing.sync)
        return dataclasses.replace(coord, routing=dataclasses.replace(routing, sync=sync))
    if name == "global_sync":   # enable only (config.ENABLES)
        return dataclasses.replace(coord, routing=dataclasses.replace(routing, sync="global"))
    if name == "dispatch":      # enable only: verl hands each replica its share at once
        return dataclasses.replace(coord, routing=dataclasses.replace(
            routing, policy="fewest", max_routes=None))
    if name == "routing":
        policy = "waterfall" if on else "fewest"
        return dataclasses.replace(coord, routing=dataclasses.replace(routing, policy=policy))
    if name == "sampler":
        return coord if on else dataclasses.replace(coord, sampler="protocol")
    if name == "eta":
        return coord if on else dataclasses.replace(
            coord, eta=min(coord.eta, apply_preset("one_step").coord.eta))
    raise ValueError(f"unknown mechanism {name!r}")


def coord_cost(spec: str, decode: costs.DecodeCosts, table: dict | None = None) -> CostModel:
    """The cost model `SimConfig.coord_cost` names, `decode` being the engines' own."""
    if spec == "engine":
        return decode.cost
    if spec == "default":
        return CostModel()
    table = table or costs.load_table()
    if spec in table.get("decode", {}):
        return costs.named_decode(spec, table)
    if not Path(spec).is_file():
        raise ValueError(f"invalid config coord_cost={spec!r}: must be 'engine', 'default', "
                         f"one of {sorted(table.get('decode', {}))} (fnrl/sim/costs.toml) or "
                         "an existing cost file (python -m fnrl.experiments.profile_cost)")
    return costs.load_profiled(spec).cost


def plan_for(cfg: SimConfig, decode: costs.DecodeCosts,
             table: dict | None = None) -> schedule.SchedulePlan:
    """The preset's coordinator, with the cost model `cfg.coord_cost` names (by default
    the engine's, as the real job loads its profile into `coord.cost`)."""
    run = apply_preset(cfg.preset)
    coord = dataclasses.replace(run.coord, cost=coord_cost(cfg.coord_cost, decode, table),
                                **({"eta": cfg.eta} if cfg.eta >= 0 else {}))
    for name, on in [*((n, True) for n in cfg.enable), *((n, False) for n in cfg.ablate)]:
        coord = _switch(coord, name, on)
    if cfg.cluster.placement == "colocated" and coord.eta != 0:
        raise ValueError(f"invalid config cluster.placement='colocated' with η={coord.eta}: "
                         "colocated roles take turns, which only η = 0 guarantees")
    g = cfg.workload.groups_per_step
    return schedule.plan(coord, batch_groups=g, prompt_groups=g, total_steps=cfg.steps)
