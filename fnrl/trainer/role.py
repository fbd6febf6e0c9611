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
import os
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
from fnrl.relay.client import MasterPublisher
from fnrl.sharding.mesh import batch_sharding, mesh_from_config, shardings_for
from fnrl.trainer.checkpoint import Checkpointer
from fnrl.trainer.step import compile_train_step, init_state, make_optimizer


class Trainer:
    """Holds the jitted step, the state and the checkpointer; no sockets."""

    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path):
        self.cfg = cfg
        self.model_cfg, self.graphdef, params = load_pretrained(model_dir)
        self.mesh = mesh_from_config(cfg.trainer.mesh)
        param_sh = shardings_for(logical_axes(self.model_cfg), params, self.mesh)
        params = jax.device_put(params, param_sh)
        # The KL reference is the initial model, frozen; without KL it is never loaded.
        self.ref_params = None
        if cfg.algo.needs_reference:
            self.ref_params = jax.device_put(load_pretrained(model_dir)[2], param_sh)
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
        self._step = compile_train_step(
            self.graphdef, self.optimizer, cfg.algo, state_sh, batch_sharding(self.mesh),
            micro_batches=cfg.trainer.micro_batches,
            ref_sharding=param_sh if self.ref_params is not None else None)

    @property
    def version(self) -> int:
        return int(self.state.step)

    def hf_weights(self) -> dict[str, np.ndarray]:
        return params_to_hf(self.model_cfg, jax.device_get(self.state.params))

    def train(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, float], dict | None]:
        """One step. Returns metrics and the new version's HF weights (None if skipped).

        The Orbax save runs in the background while the weights are converted to the
        rollout layout; it must finish before the caller publishes, so a restarted
        trainer never serves rollouts a version older than one they have seen.
        """
        t0 = time.perf_counter()
        self.state, metrics = self._step(self.state, batch, self.ref_params)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        metrics["time/train_s"] = time.perf_counter() - t0
        if metrics["update_skipped"] != 0.0:
            return metrics, None
        t1 = time.perf_counter()
        self.checkpoints.save(self.version, self.state)
        weights = self.hf_weights()
        self.checkpoints.wait()
        metrics["time/checkpoint_s"] = time.perf_counter() - t1
        return metrics, weights


def enable_compilation_cache() -> None:
    """XLA executables persist across processes (JAX_COMPILATION_CACHE_DIR, else
    ~/.cache/fnrl/jax): a restarted trainer loads its train step instead of compiling it
    (7.3 s -> 1.1 s for the default model on a 2-core CPU), and so does every new run."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(Path("~/.cache/fnrl/jax").expanduser())
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def serve(args: argparse.Namespace) -> None:
    cfg = from_dict(RunConfig, json.loads(Path(args.config).read_text()))
    enable_compilation_cache()
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(args.address)
    # Relays in chain order, master first; the publisher follows a re-elected master.
    relay = MasterPublisher(args.relay.split(","), timeout_s=120.0)
    trainer = None
    while True:
        header, arrays = wire.decode(sock.recv_multipart(copy=False))
        try:
            cmd = header["cmd"]
            if cmd == "init":
                trainer = Trainer(cfg, Path(args.model_dir), Path(args.run_dir))
                latest = relay.latest()
                if latest is None or latest.version < trainer.version:
                    # Visible before the reply: rollouts pull right after a resume.
                    relay.publish(trainer.version, trainer.hf_weights(), wait="visible")
                wire.send(sock, {"version": trainer.version, "resumed_from": trainer.resumed_from})
            elif cmd == "train":
                metrics, weights = trainer.train(arrays)
                t0 = time.perf_counter()
                if weights is not None:
                    relay.publish(trainer.version, weights)
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
    parser.add_argument("--relay", required=True,
                        help="relay addresses, comma-separated, the master's first")
    serve(parser.parse_args())


if __name__ == "__main__":
    main()
