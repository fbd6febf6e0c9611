"""Rollout routing replay through the real loop over the fake cluster (fnrl.sim.handles
reports routes as vLLM does: on a request's last chunk, every fed position from the one
asked for, here position p routed to experts (p, 1000 + the version serving)). Every
trained input position must carry its own routes, through interrupts, a killed rollout
and a killed controller."""

from __future__ import annotations

import dataclasses

import numpy as np

from fnrl.control.metrics import read_jsonl
from fnrl.sim.handles import SimRelays, run_virtual

from tests.control.fakes import FakeTrainer
from tests.control.test_loop import _run_until, make_cfg, make_roles, run


def replay_cfg(preset: str, **kw):
    cfg = make_cfg(preset, **kw)
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, num_experts=4, routing_replay="replay"))


def check_batches(batches) -> list[int]:
    """Each row's routes name their own position at every input position of its sample
    (and nothing past it); returns, per row, how many versions reported its routes."""
    assert batches
    versions = []
    for arrays in batches:
        routes = arrays["routes_BxTxLxK"]
        assert routes.shape[:2] == arrays["input_BxT"].shape and routes.shape[2:] == (1, 2)
        for row in range(routes.shape[0]):
            mask = arrays["mask_BxT"][row]
            if not mask.any():
                continue                      # a padding row
            fed = int(np.nonzero(mask)[0][-1]) + 1   # the inputs: prompt + response but last
            np.testing.assert_array_equal(routes[row, :fed, 0, 0], np.arange(fed))
            assert (routes[row, :fed, 0, 1] >= 1000).all()
            assert not routes[row, fed:].any()
            versions.append(len(set(routes[row, :fed, 0, 1].tolist())))
    return versions


def test_interrupted_trajectories_train_with_every_positions_routes(tmp_path):
    """partial_rollout interrupts every trajectory in flight at each new version: the cut
    request reports nothing, and its continuation reports the positions it re-prefilled."""
    cfg = replay_cfg("partial_rollout")
    relays = SimRelays()
    trainer = FakeTrainer(relays)
    roles = make_roles(trainer, relays, length=8, tokens_per_turn=1)
    _, summary = run(cfg, roles, tmp_path)
    assert summary["steps"] == 6 and summary["interrupted"] > 0
    # Trajectories continued across versions were trained: tokens sampled under two.
    continued = [tr for r in read_jsonl(tmp_path / "trajectories.jsonl")
                 for tr in r["trajectories"]
                 if len({v for v, n in tr["segments"] if n}) > 1]
    assert continued
    # Each row's routes came from one report: a single-turn trajectory's last request,
    # which re-prefilled what its cut-off predecessors streamed.
    assert set(check_batches(trainer.batches)) == {1}


def test_routes_survive_a_killed_rollout_and_a_killed_controller(tmp_path):
    cfg = replay_cfg("fnrl", steps=8, inject=["rollout1:at=3"])
    relays = SimRelays()
    trainer = FakeTrainer(relays)
    run_virtual(_run_until(cfg, make_roles(trainer, relays, length=8, tokens_per_turn=1),
                           tmp_path, 5))
    roles = make_roles(trainer, relays, length=8, tokens_per_turn=1)
    _, summary = run(cfg, roles, tmp_path, version=trainer.version)
    assert trainer.version == 8
    check_batches(trainer.batches)
