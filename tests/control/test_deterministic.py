"""`--deterministic` in the loop, on fakes: every stream request carries the seed its
trajectory's name derives (fnrl.policy.seeding), and every Consume's groups go to the
trainer in the order their prompts were drawn, whatever order they finished in."""

import asyncio
import dataclasses
import json

import pytest

from fnrl.policy.seeding import request_seed
from fnrl.control.journal import records as journal_records

from tests.control.fakes import FakeRollout
from tests.control.test_loop import make_cfg, make_roles, run


class SeedRecorder(FakeRollout):
    """A fake rollout that notes each request's id and seed, and finishes trajectories
    of even-numbered problems later than odd ones (so arrival order is not draw order)."""

    seen: list = []

    async def generate_stream(self, prompt_ids, *, request_id=None, seed=None, **kw):
        self.seen.append((request_id, seed))
        slow = int(request_id.split("/")[0].rsplit("-", 1)[1]) % 2 == 0
        async for chunk in super().generate_stream(prompt_ids, **kw):
            for _ in range(3 * slow):
                await asyncio.sleep(0)
            yield chunk


def _journal(run_dir):
    return journal_records(run_dir / "journal.jsonl")


@pytest.mark.parametrize("deterministic", [True, False])
def test_requests_are_seeded_and_batches_ordered(tmp_path, deterministic):
    cfg = dataclasses.replace(make_cfg("sync", steps=3), deterministic=deterministic, seed=7)
    roles = make_roles(rollouts=1)
    rollout = SeedRecorder(0, roles.relays)
    SeedRecorder.seen = []
    roles = dataclasses.replace(roles, rollouts=[rollout])
    run(cfg, roles, tmp_path)
    assert SeedRecorder.seen
    for request_id, seed in SeedRecorder.seen:
        uid = request_id.split("#")[0]
        # Nothing is interrupted under sync: every request starts its trajectory.
        assert seed == (request_seed(7, uid, 0) if deterministic else None)
    journal = _journal(tmp_path)
    drawn = [r["problem"]["uid"] for r in journal if r["ev"] == "fill"]
    batches = [[drawn.index(name) for name in r["groups"]] for r in journal
               if r["ev"] == "consume"]
    assert len(batches) == 3
    # Arrival order (fifo) puts the later-drawn, faster group first.
    assert all(b == sorted(b) for b in batches) == deterministic, batches
