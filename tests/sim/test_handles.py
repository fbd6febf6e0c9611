"""The simulated roles as processes (fnrl.sim.handles): a killed role fails what it was
doing and refuses what comes after until restarted; a stopped one finishes nothing."""

from __future__ import annotations

import asyncio
import signal

import pytest

from fnrl.config import CostModel
from fnrl.sim.costs import DecodeCosts
from fnrl.sim.handles import EOS, SimRelays, SimRollout, SimTrainer, run_virtual
from fnrl.types import RoleError, ServerError

DECODE = DecodeCosts(cost=CostModel(k1=0.0, k2=0.0, k3=0.0, k4=1.0))


def rollout(relays: SimRelays) -> SimRollout:
    return SimRollout(0, relays, DECODE, kv_capacity=100, pull_s=0.5, tokens_per_step=2,
                      eos_after=5, start_s=3.0)


async def stream(r: SimRollout, *, max_tokens: int = 8, ignore_eos: bool = False) -> list:
    chunks = r.generate_stream([5, 6], max_tokens=max_tokens, temperature=1.0,
                               ignore_eos=ignore_eos)
    return [(asyncio.get_running_loop().time(), c) async for c in chunks]


def test_a_rollout_decodes_on_its_cost_model_and_ends_with_eos_or_its_budget():
    async def main():
        r = rollout(SimRelays())
        return await stream(r), await stream(r, ignore_eos=True)

    natural, forced = run_virtual(main())
    # One step a second, two tokens a step: EOS after 5 tokens; a forced length runs on.
    assert [t for t, _ in natural] == [1.0, 2.0, 3.0]
    assert [c.token_ids for _, c in natural] == [(3, 4), (5, 6), (EOS,)]
    assert [c.finish_reason for _, c in natural] == [None, None, "stop"]
    assert sum(len(c.token_ids) for _, c in forced) == 8
    assert forced[-1][1].finish_reason == "length" and EOS not in forced[-1][1].token_ids


def test_a_killed_rollout_fails_its_streams_refuses_until_restarted_then_serves():
    async def main():
        relays = SimRelays()
        r = rollout(relays)
        task = asyncio.create_task(stream(r))
        await asyncio.sleep(1.5)
        r.kill()
        with pytest.raises(ServerError):
            await task
        assert r.exit_code() == -9
        with pytest.raises(ServerError):
            await r.metrics()
        started_s = await r.restart()
        relays.published.append(1)
        version = await r.pull(relays.address_for(0), min_version=1)
        return started_s, version, r.restarts, await stream(r)

    started_s, version, restarts, chunks = run_virtual(main())
    assert (started_s, version, restarts) == (3.0, 1, 1)
    # Killed at 1.5, back at 4.5, pulled by 5.0: its first step ends at 6.0.
    assert chunks[0][0] == 6.0 and chunks[-1][1].finish_reason == "stop"


def test_a_stopped_role_finishes_nothing_until_it_is_killed():
    async def main():
        relays = SimRelays()
        r, trainer = rollout(relays), SimTrainer(relays, train_s=1.0, publish_s=0.0)
        streaming, training = asyncio.create_task(stream(r)), asyncio.create_task(trainer.train({}))
        await asyncio.sleep(0.5)
        r.kill(signal.SIGSTOP)
        trainer.kill(signal.SIGSTOP)
        beat = asyncio.create_task(r.metrics())
        await asyncio.sleep(600.0)
        assert not (streaming.done() or training.done() or beat.done())
        assert r.exit_code() is None and trainer.exit_code() is None
        r.kill()
        trainer.kill()
        for task, error in ((streaming, ServerError), (training, RoleError), (beat, ServerError)):
            with pytest.raises(error):
                await task
        return relays.published

    assert run_virtual(main()) == [0]   # the stopped step published nothing


def test_a_restarted_trainer_publishes_the_checkpoint_the_relays_lack():
    async def main():
        relays = SimRelays()
        trainer = SimTrainer(relays, train_s=1.0, publish_s=0.0)
        await trainer.train({})
        trainer.version = 2        # checkpointed, then it died before publishing
        trainer.kill()
        with pytest.raises(RoleError):
            await trainer.train({})
        return await trainer.restart(), relays.published

    assert run_virtual(main()) == (2, [0, 1, 2])
