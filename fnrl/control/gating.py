"""The correctness gates' I/O side: feeds each returned step to the pure rules
(fnrl.policy.gates), records every firing and carries the actions out.

- Skip: the trainer already enforced the rules' bounds inside its step (they travel
  with each batch, `controls`); here the firing is only recorded.
- Rollback and LowerLR: the next batch carries the rollback target and the new
  learning-rate scale (fnrl.trainer.controls); the trainer restores and re-checkpoints
  before training it.
- Stop: `stop_report` is set (the loop then ends the run cleanly) and written to
  `gates_stop.json` in the run directory, naming the rule and its figures.

Every firing goes to metrics.jsonl (kind "gate"), the run log and the journal (a "gate"
record with the learning-rate scale and rollback count, which a restarted controller
reads back so a lowered rate survives restarts).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from fnrl.config import RunConfig
from fnrl.policy import gates
from fnrl.shell.files import write_atomic
from fnrl.trainer.controls import NO_ROLLBACK, pack_controls

STOP_REPORT = "gates_stop.json"


def batch_controls(state: gates.GateState, cfg: RunConfig,
                   rollback_to: int = NO_ROLLBACK) -> dict[str, np.ndarray]:
    """The arrays a batch carries for the gates in `state`: the learning-rate scale, the
    bounds of the rules that skip, and a rollback (fnrl.trainer.controls)."""
    upper, lower = gates.limits(state, cfg.gates)
    return pack_controls(lr_scale=state.lr_scale, upper=upper, lower=lower,
                         rollback_to=rollback_to)


class Gating:
    """Holds the GateState of one attempt; `controls` before a step, `observe` after."""

    def __init__(self, cfg: RunConfig, *, run_dir: Path, journal, writer,
                 log: Callable[[str], None], version: int, lr_scale: float = 1.0,
                 rollbacks: int = 0):
        """`lr_scale` and `rollbacks`: where the run's journal left them (journal.replay)."""
        self.cfg, self.run_dir, self.journal = cfg, run_dir, journal
        self.writer, self.log = writer, log
        self.state = gates.initial_state(version, lr_scale=lr_scale, rollbacks=rollbacks)
        self.pending_rollback = NO_ROLLBACK
        self.stop_report: dict | None = None
        self.fired: list[dict] = []

    def controls(self) -> dict[str, np.ndarray]:
        """The arrays the next batch carries: scale, bounds and any pending rollback."""
        return batch_controls(self.state, self.cfg, self.pending_rollback)

    def sent(self) -> int:
        """The batch with the controls went out; returns the rollback it carried."""
        rollback, self.pending_rollback = self.pending_rollback, NO_ROLLBACK
        return rollback

    def observe(self, metrics: dict, stats: dict, *, version: int, new_version: int,
                rollback_sent: int) -> tuple[gates.Firing, ...]:
        """Runs the rules on a returned step and acts on what fires."""
        rolled = metrics.get("gate/rolled_back_to")
        tel = gates.telemetry(metrics, stats, version=version, new_version=new_version,
                              rolled_back_to=None if rollback_sent == NO_ROLLBACK or rolled is None
                              else int(rolled))
        self.state, firings = gates.evaluate(self.state, tel, self.cfg.gates)
        for firing in firings:
            record = firing.record()
            self.fired.append(record)
            names = "+".join(a["action"] for a in record["actions"])
            self.log(f"gate {firing.rule} fired at version {firing.version}: {firing.reason} "
                     f"-> {names}")
            self.writer.write("gate", firing.version, {**record, "lr_scale": self.state.lr_scale})
            self.journal.write("gate", **record, lr_scale=self.state.lr_scale,
                               rollbacks=self.state.rollbacks)
            for action in firing.actions:
                if isinstance(action, gates.Rollback):
                    self.pending_rollback = action.to_version
                elif isinstance(action, gates.Stop) and self.stop_report is None:
                    self.stop_report = {**record, "fired_before": self.fired[:-1],
                                        "lr_scale": self.state.lr_scale}
                    write_atomic(self.run_dir / STOP_REPORT,
                                 json.dumps(self.stop_report, indent=2, default=float))
                    self.log(f"gates: stopping the run ({firing.rule}); report in "
                             f"{self.run_dir / STOP_REPORT}")
        return firings

    def summary(self) -> dict:
        """The run summary's gate figures."""
        rules = Counter(r["rule"] for r in self.fired)
        return {"gate_firings": len(self.fired), "gate_rules": dict(rules),
                "gate_lr_scale": self.state.lr_scale,
                "gate_rollbacks": self.state.rollbacks,
                "gate_stopped": None if self.stop_report is None else self.stop_report["rule"]}
