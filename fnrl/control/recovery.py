"""What a restarted controller rebuilds, and the accounting that makes it exact.

`log_consumed` writes one line per consumed group to trajectories.jsonl (the run's
accounting by id) before its tokens leave the partial response pool. `recover` reads
the journal (fnrl.control.journal) and the pool a previous controller of the run left
and puts every outstanding group back where it was.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from fnrl.data.arith import Problem
from fnrl.policy import staleness as st

if TYPE_CHECKING:
    from fnrl.control.loop import Controller


def log_consumed(ctl: "Controller", name: str, version: int, trajectories, **extra) -> None:
    """Accounting by id: one line per consumed group, then its tokens leave the pool."""
    ctl._trajectory_log.write(json.dumps({
        "group": name, "consumed_version": version, **extra,
        "trajectories": [{"uid": tr.uid, "segments": [[s.version, len(s.token_ids)]
                                                      for s in tr.segments]}
                         for tr in trajectories]}) + "\n")
    for tr in trajectories:
        ctl.pool.drop(tr.uid)

def recover(ctl: "Controller") -> None:
    """Rebuilds what a previous controller of this run left (journal + pool): the
    prompt cursor, consumption the trainer applied unseen, and every outstanding group
    with its streamed tokens. A group with tokens keeps its staleness reservation at
    V = its oldest token's version (finished groups are rewarded again and wait in the
    experience buffer); one whose tokens are now too old for the bound (V + η below the
    trainer's version) restarts from its prompt, and the discarded tokens are counted."""
    rp = ctl.replayed
    if not rp.groups:
        return
    eta = ctl.cfg.coord.eta
    counts = ctl.book.counts
    ctl.prompts.skip(rp.prompts_taken)   # the stream is deterministic: skip what was taken
    members = {g.problem["uid"]: g.uids for g in rp.groups}
    for version, names in rp.unlogged:
        for name in names:
            trajs = [ctl.pool.get(u) for u in members[name] if u in ctl.pool]
            log_consumed(ctl, name, version, trajs, recovered=True)
        ctl.journal.write("trained", version=version)
    for g in rp.groups:   # consumed or dropped: nothing of them stays in the pool
        if g.problem["uid"] in rp.consumed | rp.dropped:
            for uid in g.uids:
                if uid in ctl.pool:
                    ctl.pool.drop(uid)
    admissions, finished = [], []
    for g in rp.outstanding():
        problem = Problem(**g.problem)
        rec = ctl.table.add_group(problem, tuple(ctl.encode(problem.prompt)),
                                   list(g.target_lens))
        items = [ctl.pool.get(u) if u in ctl.pool else None for u in g.uids]
        versions = [s.version for it in items if it for s in it.segments if s.token_ids]
        if not versions:
            for it in filter(None, items):   # nothing streamed: start the group afresh
                ctl.pool.drop(it.uid)
            continue
        v_group = min(versions)
        if v_group + eta < ctl.book.trainer_version:
            for it in items:
                if it is not None:
                    counts["recovery_discarded_tokens"] += it.num_tokens
                    ctl.pool.drop(it.uid)
            continue
        for it, tid in zip(items, rec.tids):
            if it is not None:
                t = ctl.table.trajs[tid]
                t.tokens = it.num_tokens
                t.finished = it.finish_reason is not None
        admissions.append((rec.gid, v_group))
        if all(it is not None and it.finish_reason is not None for it in items):
            finished.append(rec.gid)
    cycle = ctl.state.cycle
    ctl.state = dataclasses.replace(ctl.state, cycle=dataclasses.replace(
        cycle, staleness=st.reserve_many(cycle.staleness, admissions)))
    for gid in finished:
        ctl._group_done(gid)
    counts["recovered_groups"] += len(admissions)
    counts["recovered_trajectories"] += sum(
        1 for gid, _ in admissions for tid in ctl.table.groups[gid].tids
        if ctl.table.trajs[tid].tokens)
    ctl._bar.write(f"recovered from the journal: {rp.prompts_taken} prompts taken, "
                    f"{len(rp.consumed)} groups consumed, {len(admissions)} in flight "
                    f"({len(finished)} finished), "
                    f"{counts['recovery_discarded_tokens']} stale tokens discarded")
