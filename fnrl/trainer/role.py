"""The trainer role: a process that owns the TrainState.

    python -m fnrl.trainer.role --run-dir DIR --model-dir DIR --address tcp://... --relay tcp://...

It answers the controller over ZeroMQ (REP): `train` with a batch of arrays logs the
batch, runs one jitted step, checkpoints every `trainer.checkpoint_every` versions
(Orbax, async) and publishes the new version to the master relay in the servers' dtype
(`rollout.serve_dtype`), then replies with metrics and timings. On start it resumes from the
newest finished checkpoint, replays the batches logged after it (so it is back at the
version it had: fnrl.trainer.checkpoint) and publishes that version if the relays lack
it, so rollouts never go back.

Parameters are held in `trainer.param_dtype` with Adam's moments, computed in
`trainer.compute_dtype`, rematerialised per layer by a named policy (`trainer.remat`),
attended by a named kernel (`trainer.attention`) and with log-probs in chunks
(`trainer.logprob_chunk`); every "auto" is resolved for the platform the process runs on
(fnrl.trainer.platform) and printed. The state is born sharded.

With `trainer.distributed.num_processes` > 1 this is one rank of a group started by
fnrl.trainer.group: every rank joins one global mesh, process 0 alone answers the
controller and publishes, and hands each command to the others (fnrl.trainer.fanout), who
run the same Trainer calls in the same order (`follow`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from fnrl.config import RunConfig, TrainerConfig, load_json
from fnrl.models.hf_io import load_pretrained, params_to_hf, read_config
from fnrl.models.decoder import abstract_model, logical_axes
from fnrl.models.lora import init_adapters, peft_tensors, split_adapters
from fnrl.relay.chain import detection_window_s
from fnrl.relay.client import MasterPublisher
from fnrl.sharding.mesh import batch_sharding, global_arrays, mesh_from_config, shardings_for
from fnrl.shell import wire
from fnrl.shell.files import no_space, write_atomic
from fnrl.trainer import distributed
from fnrl.trainer.checkpoint import BatchLog, Checkpointer
from fnrl.trainer.controls import NO_ROLLBACK, split_controls
from fnrl.trainer.fanout import CommandFanout, CommandFeed
from fnrl.trainer.group import FANOUT_VAR
from fnrl.trainer.fit import abstract_batch, fit_remat
from fnrl.trainer.memory import resolve_for_device
from fnrl.trainer.platform import describe, model_kernels, storage_dtype
from fnrl.trainer.step import (compile_train_step, init_sharded_state, initial_critic,
                               make_optimizer, place_params, state_shardings)
from fnrl.trainer.xla_flags import compilation_cache_dir, set_cpu_threads, use_memory_scheduler


BATCH_SPECS = "batch_specs.json"


class Trainer:
    """Holds the jitted step, the state, the checkpointer and the batch log; no sockets."""

    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path):
        model_cfg = read_config(model_dir)
        self.max_len = cfg.model.context_len(model_cfg.max_position_embeddings)
        remat_auto = cfg.trainer.remat == "auto"
        tc = self._resolve(cfg, model_cfg)
        self.cfg = cfg = dataclasses.replace(cfg, trainer=tc)
        compute = jnp.dtype(tc.compute_dtype)
        self.lora = tc.lora if tc.lora.enabled else None
        self.model_cfg, self.graphdef, host_params = load_pretrained(
            model_dir, dtype=compute, param_dtype=jnp.dtype(storage_dtype(tc)),
            adapter_seed=cfg.seed, adapter_dtype=jnp.dtype(tc.param_dtype), **model_kernels(tc))
        self._graphdef_remat = tc.remat
        self.serve_dtype = np.dtype(jnp.dtype(cfg.rollout.serve_dtype))
        self.mesh = mesh_from_config(tc.mesh)
        # In a group (fnrl.trainer.distributed) every process runs every step; process 0
        # alone writes the run directory's files and publishes.
        self.group_size, self.writer = jax.process_count(), jax.process_index() == 0
        param_sh = shardings_for(logical_axes(self.model_cfg, self.lora), host_params, self.mesh)
        # With LoRA the state trains the adapters; the base is a frozen argument of the
        # step, in its own dtype, never differentiated, checkpointed or published.
        self.frozen, self._frozen_sh = None, None
        if self.lora is not None:
            (host_params, host_base), (param_sh, self._frozen_sh) = (
                split_adapters(host_params), split_adapters(param_sh))
            self.frozen = place_params(host_base, self._frozen_sh)
        self.optimizer = make_optimizer(cfg.algo, total_steps=cfg.steps)
        # Sharded init: shardings from shapes alone, then the state is built in place.
        state_sh = state_shardings(self.optimizer, host_params, param_sh,
                                   critic=initial_critic(cfg.algo, self.model_cfg.hidden_size))
        self._model_dir, self._param_sh, self._state_sh = model_dir, param_sh, state_sh
        self.state = self._initial_state(host_params)
        # The KL reference is the initial model, frozen: no gradients, so it is held in
        # the compute dtype. Without KL it is never loaded; with LoRA it is the base.
        self.ref_params = None
        if cfg.algo.needs_reference and self.lora is None:
            self.ref_params = place_params(load_pretrained(model_dir, param_dtype=compute)[2],
                                           param_sh)
        self.run_dir = run_dir
        self._seen_specs: set[str] = set()
        self._warmed: set[str] = set()
        self.resumed_from = None
        self.replayed = 0
        self.checkpoints = Checkpointer(run_dir / "checkpoints", max_to_keep=tc.checkpoint_keep)
        self.batches = BatchLog(run_dir / "batches")
        self._step = self._build_step(tc)
        if self._device_limit and remat_auto:
            self._fit_remat_to_device()
        self._serving_cast = jax.jit(lambda p: jax.tree.map(
            lambda x: x.astype(self.serve_dtype), p))
        self.restore_latest(replay=False)

    def _resolve(self, cfg: RunConfig, model_cfg) -> TrainerConfig:
        """The trainer config with its platform defaults (printed: the run's log says
        what the step computes with), remat planned against the first device's memory."""
        device = jax.devices()[0]
        limit = (device.memory_stats() or {}).get("bytes_limit") if device.platform != "cpu" else None
        buckets = [b for b in cfg.trainer.length_buckets if b <= self.max_len]
        self._largest = (cfg.trainer.pack_rows or cfg.batch_size,
                         max(buckets) if buckets else self.max_len)
        tc, self._why = resolve_for_device(cfg.trainer, platform=device.platform,
                                           model=model_cfg, algo=cfg.algo,
                                           rows=self._largest[0], length=self._largest[1],
                                           device_bytes=limit)
        self._device_limit = limit
        print(describe(tc, self._why), flush=True)
        return tc

    def _build_step(self, tc: TrainerConfig):
        """The jitted step for `tc`'s kernels (the graphdef carries the remat policy)."""
        if tc.remat != self._graphdef_remat:
            self._graphdef_remat = tc.remat
            self.graphdef = abstract_model(self.model_cfg, dtype=jnp.dtype(tc.compute_dtype),
                                           param_dtype=jnp.dtype(tc.param_dtype),
                                           **model_kernels(tc))[0]
        return compile_train_step(
            self.graphdef, self.optimizer, self.cfg.algo, self._state_sh,
            batch_sharding(self.mesh), micro_batches=tc.micro_batches,
            logprob_chunk=tc.logprob_chunk,
            ref_sharding=self._param_sh if self.ref_params is not None else None,
            matmul_precision=tc.matmul_precision, frozen_sharding=self._frozen_sh,
            lora_scaling=self.lora.scaling if self.lora is not None else 0.0)

    def _fit_remat_to_device(self) -> None:
        """On an accelerator, the automatic remat checked against XLA's plan of the step
        compiled for the largest batch (fnrl.trainer.fit): the next policy while it is
        over the device's limit. Printed when it changes anything."""
        batch = abstract_batch(self.cfg, *self._largest)
        tc, why, step, _ = fit_remat(self.cfg.trainer, self._why, build=self._build_step,
                                  args=(self.state, batch, self.ref_params, None, self.frozen),
                                  limit=self._device_limit)
        print(f"trainer remat: {tc.remat} ({why['remat']})", flush=True)
        self.cfg = dataclasses.replace(self.cfg, trainer=tc)
        self._step = step

    def _initial_state(self, host_params=None):
        """The state at version 0: the model directory's weights (read again unless
        given), fresh optimizer state and critic (if the algorithm has one), born sharded."""
        if host_params is None and self.lora is not None:
            host_params = init_adapters(self.model_cfg, self.lora, self.cfg.seed,
                                        dtype=jnp.dtype(self.cfg.trainer.param_dtype))
        elif host_params is None:
            tc = self.cfg.trainer
            host_params = load_pretrained(self._model_dir, dtype=jnp.dtype(tc.compute_dtype),
                                          param_dtype=jnp.dtype(tc.param_dtype),
                                          **model_kernels(tc))[2]
        return init_sharded_state(place_params(host_params, self._param_sh), self.optimizer,
                                  self._state_sh, initial_critic(self.cfg.algo,
                                                                 self.model_cfg.hidden_size))

    @property
    def version(self) -> int:
        return int(self.state.step)

    def restore_latest(self, *, rescan: bool = False, replay: bool = True) -> None:
        """Brings the state to the newest version this run's trainers reached (if
        resuming): the newest finished checkpoint if it is ahead of the state held, then
        the batches logged since, replayed in order (fnrl.trainer.checkpoint). A warm
        standby calls it again at takeover, with a manager that rescans the directory
        (another trainer has been writing to it); it replays only then."""
        if rescan:
            self.checkpoints.close()
            self.checkpoints = Checkpointer(self.run_dir / "checkpoints",
                                            max_to_keep=self.cfg.trainer.checkpoint_keep)
        if not self.cfg.resume:
            return
        latest = self.checkpoints.latest_step()
        if latest is not None and latest > self.version:
            # The newest checkpoint storage has not damaged; any skipped is named, moved
            # aside, and rolled past with the logged batches (fnrl.trainer.checkpoint).
            state, step, skipped = self.checkpoints.restore_newest_good(self.state)
            for bad, why in skipped:
                print(f"trainer: checkpoint {bad} skipped: {why} (moved to "
                      f"{self.run_dir / 'checkpoints_bad' / str(bad)})", flush=True)
            if state is not None and step > self.version:
                self.state = state
        if replay:
            for version in self.batches.versions():
                if version != self.version:
                    continue   # older than the checkpoint (not yet pruned), or after a skip
                # The same learning-rate scale and bounds as the first time (a rollback
                # sent with the batch is not redone: its result is the checkpoint).
                batch, controls, _ = split_controls(self.batches.read(version))
                self.state, _ = self._run_step(batch, controls)
                self.replayed += 1
        if self.version > 0:
            self.resumed_from = self.version

    def apply(self, batch: dict[str, np.ndarray]) -> dict:
        """One jitted step on a batch and the controls it carries, and nothing else
        (no log, checkpoint or publish): how fnrl.experiments.replay re-trains a run."""
        arrays, controls, _ = split_controls(batch)
        self.state, metrics = self._run_step(arrays, controls)
        return metrics

    def _run_step(self, arrays: dict[str, np.ndarray], controls: dict | None):
        """The jitted step on host arrays. In a group each process places only the rows
        its devices hold (a multi-process jit refuses numpy for a sharded argument)."""
        if self.group_size > 1:
            arrays = global_arrays(arrays, batch_sharding(self.mesh))
            if controls is not None:
                controls = global_arrays(controls, NamedSharding(self.mesh, PartitionSpec()))
        return self._step(self.state, arrays, self.ref_params, controls, self.frozen)

    def warm_up(self) -> int:
        """Compiles (or loads from the compilation cache) the step for every batch shape
        a trainer of this run has seen, on zeros, and throws the result away: the step is
        pure, so the state is untouched. A standby then trains its first batch at once."""
        path = self.run_dir / BATCH_SPECS
        specs = json.loads(path.read_text()) if path.exists() else []
        for spec in specs:
            key = json.dumps(spec)
            if key in self._warmed:
                continue
            batch, controls, _ = split_controls(
                {k: np.zeros(shape, dtype) for k, (shape, dtype) in spec.items()})
            jax.block_until_ready(self._run_step(batch, controls))
            self._warmed.add(key)
        return len(self._warmed)

    def note_batch_spec(self, batch: dict[str, np.ndarray]) -> None:
        """Records a new batch shape for `warm_up` (atomically: a reader never sees half)."""
        spec = {k: [list(v.shape), str(v.dtype)] for k, v in sorted(batch.items())}
        key = json.dumps(spec)
        if key in self._seen_specs or not self.writer:
            return
        self._seen_specs.add(key)
        path = self.run_dir / BATCH_SPECS
        specs = json.loads(path.read_text()) if path.exists() else []
        if spec not in specs:
            write_atomic(path, json.dumps(specs + [spec]))

    def rollback(self, to_version: int) -> int:
        """The correctness gates' rollback (fnrl.policy.gates): the newest checkpoint at or
        before `to_version` becomes the state, under the current version number (versions
        only go forward: the next step publishes its result as usual), and is saved as
        this version's checkpoint, so a restart resumes from it. Returns the version
        restored, or -1 when no such checkpoint is left (nothing changes)."""
        self.checkpoints.wait()
        steps = self.checkpoints.all_steps()
        source = max((s for s in steps if s <= to_version), default=NO_ROLLBACK)
        version = self.version
        if source == NO_ROLLBACK and to_version == 0:
            # Version 0 is the pretrained model itself, never checkpointed: rebuilt from it.
            # (An older good version whose checkpoint is gone is not replaced by it: that
            # would silently drop every good step since; the gates stop instead.)
            source = 0
        if source == NO_ROLLBACK or source == version:
            return source
        if source in steps:
            restored, _ = self.checkpoints.restore(self.state, step=source)
        else:
            restored = self._initial_state()
        self.state = restored.replace(step=self.state.step)
        if version in steps:
            self.checkpoints.delete(version)
        self.checkpoints.save(version, self.state)
        self.checkpoints.wait()
        if self.writer:
            self.checkpoints.seal(version)
            self.batches.prune(below=min(self.checkpoints.all_steps()))
        return source

    def hf_weights(self) -> dict[str, np.ndarray] | None:
        """The current params in the HF layout and the servers' dtype (cast on device,
        so a bfloat16 server gets half the bytes, converted by XLA, not numpy). In a group
        every process takes part in gathering them; process 0 gets them, the rest None.
        With LoRA, the adapters alone, in PEFT's layout (fnrl.models.lora.peft_tensors):
        a rollout merges them into the base it started from."""
        params = self.state.params
        if any(x.dtype != self.serve_dtype for x in jax.tree.leaves(params)):
            params = self._serving_cast(params)
        if self.group_size > 1:
            # Every process's shards to every process (a collective: all must call it).
            params = multihost_utils.process_allgather(params, tiled=True)
            if not self.writer:
                return None
        if self.lora is not None:
            return peft_tensors(self.model_cfg, self.lora, jax.device_get(params),
                                dtype=self.serve_dtype)
        return params_to_hf(self.model_cfg, jax.device_get(params), dtype=self.serve_dtype)

    def train(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, float], dict | None]:
        """One step. Returns metrics and the new version's HF weights (None if skipped).

        The batch is logged before the step runs, so from then on a restarted trainer
        reaches the new version by replaying it. Every `checkpoint_every` versions the
        state is saved (Orbax, in the background while the weights are converted) and
        the save finishes before the caller publishes; the logged batches it covers go.
        """
        length = batch["input_BxT"].shape[1]
        if length > self.max_len:
            raise ValueError(f"a batch of {length} positions exceeds the run's context of "
                             f"{self.max_len} tokens (model.max_seq_len)")
        t0 = time.perf_counter()
        arrays, controls, rollback_to = split_controls(batch)
        rolled_back_to = self.rollback(rollback_to) if rollback_to != NO_ROLLBACK else None
        if self.writer:
            self.batches.write(self.version, batch)
        self.state, metrics = self._run_step(arrays, controls)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if rolled_back_to is not None:
            metrics["gate/rolled_back_to"] = float(rolled_back_to)
        metrics["time/train_s"] = time.perf_counter() - t0
        if metrics["update_skipped"] != 0.0:
            return metrics, None
        t1 = time.perf_counter()
        saving = self.version % self.cfg.trainer.checkpoint_every == 0
        lost = None   # a save the disk had no room for
        if saving:
            lost = _unless_no_space(lambda: self.checkpoints.save(self.version, self.state))
        t2 = time.perf_counter()
        weights = self.hf_weights()
        # The weights' share of the stall: cast, gather (a group) and HF layout.
        metrics["time/weights_s"] = time.perf_counter() - t2
        if saving and lost is None:
            lost = _unless_no_space(self.checkpoints.wait)
        if saving and lost is None and self.writer:
            lost = _unless_no_space(lambda: self.checkpoints.seal(self.version))
        if lost is not None:
            metrics.update(self._checkpoint_lost(lost))
        elif saving and self.writer:
            # Batches from the oldest kept checkpoint on: a resume that must skip a
            # damaged newer one still rolls forward to this version.
            self.batches.prune(below=min(self.checkpoints.all_steps()))
        metrics["time/checkpoint_s"] = time.perf_counter() - t1
        return metrics, weights

    def _checkpoint_lost(self, err: BaseException) -> dict[str, float]:
        """A save the disk had no room for: its temporary files removed, said with the
        free bytes, and the run goes on without it. Nothing is lost: the batches since
        the last checkpoint stay logged, so a restart replays them (the cost named)."""
        removed = self.checkpoints.discard_unfinished()
        free = shutil.disk_usage(self.checkpoints.directory).free
        last = self.checkpoints.latest_step() or 0
        print(f"trainer: checkpoint {self.version} not saved, no space left on the device "
              f"of {self.checkpoints.directory} ({free / 2**20:.1f} MiB free; {err}); "
              f"removed {removed or 'nothing'}; going on: a restart now replays the "
              f"{self.version - last} batch(es) logged since checkpoint {last}", flush=True)
        return {"checkpoint/no_space": 1.0, "checkpoint/free_bytes": float(free),
                "checkpoint/versions_since_saved": float(self.version - last)}


def _unless_no_space(action) -> BaseException | None:
    """Runs `action`; a full disk (fnrl.shell.files.no_space) is returned, not
    raised: the caller goes on without that checkpoint."""
    try:
        action()
    except Exception as err:  # noqa: BLE001 - only a full disk is caught here
        if not no_space(err):
            raise
        return err
    return None


def corrupt_weights(weights: dict[str, np.ndarray], noise: float, *, seed: int
                    ) -> dict[str, np.ndarray]:
    """FAULT INJECTION (`--faults.inject.corrupt-publish`): every tensor plus Gaussian
    noise of `noise` × its own std, the kind of damage a bad weight transfer does."""
    rng = np.random.default_rng(seed)
    return {k: (v + noise * float(np.std(v.astype(np.float32)))
                * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in weights.items()}


def enable_compilation_cache() -> None:
    """XLA executables persist across processes (JAX_COMPILATION_CACHE_DIR, else
    ~/.cache/fnrl/jax): a restarted trainer loads its train step instead of compiling it
    (7.3 s -> 1.1 s for the default model on a 2-core CPU), and so does every new run."""
    jax.config.update("jax_compilation_cache_dir", compilation_cache_dir())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def fanout_addresses(environ=os.environ) -> list[str]:
    """Ranks 1..N-1's command feeds (fnrl.trainer.group sets them); a named error when a
    group was started some other way."""
    value = environ.get(FANOUT_VAR, "")
    if not value:
        raise RuntimeError(f"{FANOUT_VAR} is not set: a trainer group's processes are "
                           "started by `python -m fnrl.trainer.group` (the launchers do)")
    return value.split(",")


def prepare_process(cfg: RunConfig) -> None:
    """What a trainer process sets before JAX starts its backend: the XLA scheduler flag
    and its CPUs (fnrl.trainer.xla_flags; XLA sizes its CPU pool at backend start), and
    the persistent compilation cache. Whatever compiles the trainer's step elsewhere
    (the ablation warm-up) calls it too, so its compiled code is the role's."""
    use_memory_scheduler()
    set_cpu_threads(cfg.trainer.cpu_threads)
    enable_compilation_cache()


def serve(args: argparse.Namespace) -> None:
    cfg = load_json(RunConfig, args.config)
    prepare_process(cfg)
    group = distributed.join(cfg.trainer.distributed)   # None: one process
    if group is not None:
        print(f"trainer process {group.process_id} of {group.num_processes} joined "
              f"(coordinator {group.coordinator}, {jax.device_count()} devices, "
              f"pid {os.getpid()})", flush=True)
        if group.process_id > 0:
            return follow(cfg, args, CommandFeed(fanout_addresses()[group.process_id - 1]))
    fanout = CommandFanout(fanout_addresses()) if group is not None else None

    def tell(header: dict, arrays: dict | None = None) -> None:
        """Hands a command to the other processes first: they enter it with this one."""
        if fanout is not None:
            fanout.send(header, arrays)

    # Only requests sealed with the run's secret get through (fnrl.shell.auth).
    server = wire.RoleServer(args.address, role="trainer")
    # Relays in chain order, master first; the publisher follows a re-elected master.
    # A master that stops answering is left after the tier's detection window, not 120 s.
    relay = MasterPublisher(args.relay.split(","), timeout_s=120.0,
                            liveness_s=detection_window_s(cfg.relay))
    trainer = None
    while True:
        header, arrays = server.recv()
        try:
            cmd = header["cmd"]
            if cmd in ("standby", "warm"):
                # A warm spare: built, restored and compiled, waiting for `takeover`;
                # `warm` compiles batch shapes seen since.
                tell({"cmd": cmd})
                if trainer is None:
                    trainer = Trainer(cfg, Path(args.model_dir), Path(args.run_dir))
                server.reply({"warmed": trainer.warm_up()})
            elif cmd in ("init", "takeover"):
                tell({"cmd": cmd})
                standby = trainer is not None
                if trainer is None:
                    trainer = Trainer(cfg, Path(args.model_dir), Path(args.run_dir))
                trainer.restore_latest(rescan=standby)
                latest = relay.latest()
                if latest is None or latest.version < trainer.version:
                    tell({"cmd": "gather"})
                    # Visible before the reply: rollouts pull right after a resume.
                    relay.publish(trainer.version, trainer.hf_weights(), wait="visible")
                server.reply({"version": trainer.version, "resumed_from": trainer.resumed_from})
            elif cmd == "train":
                tell({"cmd": "train"}, arrays)
                trainer.note_batch_spec(arrays)
                metrics, weights = trainer.train(arrays)
                if weights is not None and trainer.version == cfg.faults.inject.corrupt_publish:
                    weights = corrupt_weights(weights, cfg.faults.inject.noise, seed=cfg.seed)
                    metrics["fault/corrupt_publish"] = 1.0
                t0 = time.perf_counter()
                if weights is not None:
                    metrics["publish_bytes"] = float(sum(w.nbytes for w in weights.values()))
                    relay.publish(trainer.version, weights)
                metrics["time/publish_s"] = time.perf_counter() - t0
                server.reply({"version": trainer.version, "metrics": metrics})
            elif cmd == "shutdown":
                tell({"cmd": "shutdown"})
                if trainer is not None:
                    trainer.checkpoints.close()
                server.reply({"ok": True})
                return
            else:
                raise ValueError(f"unknown trainer command {cmd!r}")
        except Exception as err:  # noqa: BLE001 - any failure goes back to the controller, named
            # A full disk (the batch log) is said as such: the controller stops cleanly
            # rather than restarting a trainer that would fail the same way.
            server.reply({"error": traceback.format_exc(),
                          **({"no_space": str(err)} if no_space(err) else {})})


def follow(cfg: RunConfig, args: argparse.Namespace, feed: CommandFeed) -> None:
    """Processes 1..N-1 of a group: process 0's commands, in its order, with the same
    Trainer calls (so every collective, save and restore is entered by all), writing no
    files and publishing nothing."""
    trainer = None
    while True:
        header, arrays = feed.recv()
        cmd = header["cmd"]
        try:
            if cmd in ("standby", "warm", "init", "takeover"):
                standby = trainer is not None
                if trainer is None:
                    trainer = Trainer(cfg, Path(args.model_dir), Path(args.run_dir))
                if cmd in ("standby", "warm"):
                    trainer.warm_up()
                else:
                    trainer.restore_latest(rescan=standby)
            elif cmd == "gather":
                trainer.hf_weights()
            elif cmd == "train":
                trainer.train(arrays)
            elif cmd == "shutdown":
                if trainer is not None:
                    trainer.checkpoints.close()
                return
            else:
                raise ValueError(f"unknown trainer command {cmd!r} from process 0")
        except Exception:  # noqa: BLE001 - process 0 failed the same way and reports it
            traceback.print_exc()


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
