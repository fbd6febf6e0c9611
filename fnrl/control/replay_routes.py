"""Rollout routing replay on the controller's side (issue 39, after R3, arXiv 2510.11370).

vLLM reports a request's routes once, on its stream's last chunk, for the positions of
prompt + sample from the request's `routed_experts_prompt_start` on (fnrl.serving.client).
A request cut off (an interrupt drops its connection; a rollout dies) reports nothing, so
every request asks from the first position the partial response pool has no routes for:
a continuation re-prefills the positions its predecessor streamed and reports them then.
Positions already covered keep the routes first reported (fnrl.data.partial_pool).

Gap the paper leaves (it has no partial rollouts): a position re-prefilled under a newer
version after an interrupt has two routings, the one the engine used when it first fed it
and the re-prefill's. We keep the first where it was reported and the re-prefill's where
it was not; either way one routing per position, which is what the trainer can replay.

A trajectory must end with every position covered but its last token's (never fed, only
a target). One that would not (its budget was spent before a continuation reported, or
a multi-turn episode ends on fed tokens) gets one more request of one token, whose
report is kept and whose token is not.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fnrl.data.partial_pool import PartialResponsePool
from fnrl.types import StreamChunk


def routes_request(pool: PartialResponsePool, uid: str, replay: bool) -> dict[str, int]:
    """The generate_stream argument asking for routes (nothing when replay is off)."""
    return {"routes_from": pool.routes_covered(uid)} if replay else {}


def record_routes(pool: PartialResponsePool, uid: str, chunk: StreamChunk) -> None:
    """Keeps a last chunk's routes (after its tokens are in the pool); a report of one
    more position than the pool holds (the token `complete_routes` discards) is cut."""
    if chunk.routes is not None:
        end = pool.get(uid).positions - chunk.routes_from
        pool.add_routes(uid, chunk.routes_from, chunk.routes[:end])


async def complete_routes(pool: PartialResponsePool, uid: str, handle, *,
                          sampling: dict[str, Any], request_id: str) -> bool:
    """Makes `uid`'s routes whole when some position but the last lacks them, with one
    request of one token over the trajectory so far; returns whether it asked."""
    item = pool.get(uid)
    if item.trajectory_routes() is not None:
        return False
    context = item.prompt_ids + tuple(t for s in item.segments for t in s.token_ids)
    stream = handle.generate_stream(context, max_tokens=1, ignore_eos=True,
                                    request_id=f"{request_id}:routes", **sampling,
                                    **routes_request(pool, uid, True))
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            record_routes(pool, uid, chunk)
            if chunk.finish_reason is not None:
                break
    if pool.get(uid).trajectory_routes() is None:
        raise RuntimeError(f"trajectory {uid!r}: the engine reported no routes for "
                           f"positions {pool.routes_covered(uid)}.. of {item.positions}")
    return True
