"""The trainer role: a process that owns the TrainState.

    python -m fnrl.trainer.role --run-dir DIR --model-dir DIR --address tcp://... --relay tcp://...

It answers the controller over ZeroMQ (REP): `train` with a batch of arrays runs one
jitted step, checkpoints it (Orbax, async) and publishes the new version to the
master relay, then replies with metrics and timings. On start it resumes from the
newest finished checkpoint and publishes that version, so rollouts never go back.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import jax
import numpy as np
import zmq

from fnrl.config import RunConfig, from_dict
from fnrl.control import wire
from fnrl.models.hf_io import load_pretrained, params_to_hf
from fnrl.models.qwen2 import logical_axes
from fnrl.relay.client import RelayClient
from fnrl.sharding.mesh import batch_sharding, make_mesh, shardings_for
from fnrl.trainer.checkpoint import Checkpointer
from fnrl.trainer.step import compile_train_step, init_state, make_optimizer


class Trainer:
    """Holds the jitted step, the state and the checkpointer; no sockets."""

    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path):
        self.cfg = cfg
        self.model_cfg, self.graphdef, params = load_pretrained(model_dir)
        self.mesh = make_mesh()
        param_sh = shardings_for(logical_axes(self.model_cfg), params, self.mesh)
        params = jax.device_put(params, param_sh)
        self.optimizer = make_optimizer(cfg.algo)
        # Initialising under jit lets XLA place the Adam moments like their parameters.
        state = jax.jit(lambda p: init_state(p, self.optimizer))(params)
        self.checkpoints = Checkpointer(run_dir / "checkpoints")
        self.resumed_from = None
        if cfg.resume and self.checkpoints.latest_step() is not None:
            state, _ = self.checkpoints.restore(state)
            self.resumed_from = int(state.step)
        self.state = state
        state_sh = jax.tree.map(lambda x: x.sharding, state)
        self._step = compile_train_step(self.graphdef, self.optimizer, cfg.algo, state_sh,
                                        batch_sharding(self.mesh))

    @property
    def version(self) -> int:
        return int(self.state.step)

    def hf_weights(self) -> dict[str, np.ndarray]:
        return params_to_hf(self.model_cfg, jax.device_get(self.state.params))

    def train(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        t0 = time.perf_counter()
        self.state, metrics = self._step(self.state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        metrics["time/train_s"] = time.perf_counter() - t0
        if metrics["update_skipped"] == 0.0:
            t1 = time.perf_counter()
            # A version is published only once its checkpoint is durable, so a restarted
            # trainer never serves rollouts an older version than they have seen.
            self.checkpoints.save(self.version, self.state)
            self.checkpoints.wait()
            metrics["time/checkpoint_s"] = time.perf_counter() - t1
        return metrics


def serve(args: argparse.Namespace) -> None:
    cfg = from_dict(RunConfig, json.loads(Path(args.config).read_text()))
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(args.address)
    relay = RelayClient(args.relay, timeout_s=120.0)
    trainer = None
    while True:
        header, arrays = wire.decode(sock.recv_multipart(copy=False))
        try:
            cmd = header["cmd"]
            if cmd == "init":
                trainer = Trainer(cfg, Path(args.model_dir), Path(args.run_dir))
                latest = relay.latest()
                if latest is None or latest.version < trainer.version:
                    relay.publish(trainer.version, trainer.hf_weights())
                wire.send(sock, {"version": trainer.version, "resumed_from": trainer.resumed_from})
            elif cmd == "train":
                metrics = trainer.train(arrays)
                t0 = time.perf_counter()
                if metrics["update_skipped"] == 0.0:
                    relay.publish(trainer.version, trainer.hf_weights())
                metrics["time/publish_s"] = time.perf_counter() - t0
                wire.send(sock, {"version": trainer.version, "metrics": metrics})
            elif cmd == "shutdown":
                if trainer is not None:
                    trainer.checkpoints.close()
                wire.send(sock, {"ok": True})
                return
            else:
                raise ValueError(f"unknown trainer command {cmd!r}")
        except Exception:  # noqa: BLE001 - any failure goes back to the controller, named
            wire.send(sock, {"error": traceback.format_exc()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--relay", required=True)
    serve(parser.parse_args())


if __name__ == "__main__":
    main()
