"""The multi-process trainer (fnrl.trainer.distributed): how a process finds its group,
the global mesh and arrays, and (slow) two real JAX processes on loopback running the
jitted step, a several-MiB reduce-scatter and Orbax save/restore, against numpy and one
process with as many devices."""

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from fnrl.config import DistributedConfig, TrainerConfig
from fnrl.shell.net import free_port
from fnrl.sharding.mesh import batch_sharding, global_arrays, make_mesh
from fnrl.trainer.distributed import (first_slurm_host, join, resolve_group,
                                      set_local_devices)
from fnrl.trainer.distributed_check import (NATIVE_REDUCE_SCATTER, CheckArgs, _tiny_trainer,
                                            scatter_input, scatter_sum, toy_batch)


# ---------------------------------------------------------------- config and resolution

@pytest.mark.parametrize("kwargs, field", [
    (dict(num_processes=-1), "num_processes"),
    (dict(process_id=-2), "process_id"),
    (dict(num_processes=2, process_id=2), "process_id"),
    (dict(coordinator="10.0.0.1"), "coordinator"),
    (dict(coordinator="10.0.0.1:99999"), "coordinator"),
    (dict(coordinator="bad host:80"), "coordinator"),
    (dict(coordinator_port=70000), "coordinator_port"),
    (dict(local_devices=-1), "local_devices"),
    (dict(init_timeout_s=0), "init_timeout_s"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"DistributedConfig.{field}="):
        DistributedConfig(**kwargs)


def test_default_is_one_process_whatever_the_environment():
    assert TrainerConfig().distributed == DistributedConfig()
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n[1-4]",
             "FNRL_NUM_PROCESSES": "3", "FNRL_PROCESS_ID": "2"}
    assert resolve_group(DistributedConfig(), slurm) is None
    assert resolve_group(DistributedConfig(num_processes=0), {"FNRL_NUM_PROCESSES": "1",
                                                              "FNRL_PROCESS_ID": "0"}) is None


def test_explicit_config_wins_over_the_environment():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n[1-4]",
           "FNRL_COORDINATOR": "10.1.1.1:7000"}
    group = resolve_group(DistributedConfig(num_processes=2, process_id=1,
                                            coordinator="10.0.0.9:1234"), env)
    assert (group.num_processes, group.process_id, group.coordinator, group.source) == (
        2, 1, "10.0.0.9:1234", "config")


def test_slurm_environment():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "4100",
           "SLURM_STEP_NODELIST": "gpu[007-010,012],cpu1", "SLURM_NODELIST": "other"}
    group = resolve_group(DistributedConfig(num_processes=0), env)
    # The port follows the job id (61440 + 4100 % 4096), the host the step's first node.
    assert (group.num_processes, group.process_id, group.coordinator, group.source) == (
        8, 5, "gpu007:61444", "slurm")
    fixed = resolve_group(DistributedConfig(num_processes=0, coordinator_port=9000), env)
    assert fixed.coordinator == "gpu007:9000"
    # An explicit coordinator variable beats the node list.
    chosen = resolve_group(DistributedConfig(num_processes=0),
                           dict(env, FNRL_COORDINATOR="10.2.0.1:6000"))
    assert chosen.coordinator == "10.2.0.1:6000"


def test_kubernetes_style_environment():
    env = {"FNRL_NUM_PROCESSES": "4", "FNRL_PROCESS_ID": "2",
           "FNRL_COORDINATOR": "trainer-0.trainer.ns.svc:8476"}
    group = resolve_group(DistributedConfig(num_processes=0), env)
    assert (group.num_processes, group.process_id, group.coordinator, group.source) == (
        4, 2, "trainer-0.trainer.ns.svc:8476", "env")
    # Explicit size and rank, coordinator from nowhere: process 0's loopback.
    local = resolve_group(DistributedConfig(num_processes=2, process_id=0), {})
    assert local.coordinator == "127.0.0.1:8476" and local.coordinator_host == "127.0.0.1"


@pytest.mark.parametrize("cfg, env, match", [
    (DistributedConfig(num_processes=0), {}, "SLURM_NTASKS or FNRL_NUM_PROCESSES"),
    (DistributedConfig(num_processes=2), {}, "SLURM_PROCID or FNRL_PROCESS_ID; neither is set"),
    (DistributedConfig(num_processes=0), {"FNRL_NUM_PROCESSES": "two"}, "FNRL_NUM_PROCESSES"),
    (DistributedConfig(num_processes=0), {"FNRL_NUM_PROCESSES": "2", "FNRL_PROCESS_ID": "2"},
     r"process_id=2 is not in \[0, num_processes=2\)"),
    (DistributedConfig(num_processes=2, process_id=0), {"FNRL_COORDINATOR": "nohost"},
     "FNRL_COORDINATOR"),
])
def test_missing_or_bad_environment_is_named(cfg, env, match):
    with pytest.raises(ValueError, match=match):
        resolve_group(cfg, env)


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"), ("gpu[003-010,012],cpu1", "gpu003"), ("a-[1,3]", "a-1"),
    ("rack[2-3]-ib,x", "rack2-ib"), ("h1,h2", "h1"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_join_does_nothing_for_one_process():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert join(DistributedConfig(), env) is None
    assert env == {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert join(DistributedConfig(local_devices=3), env) is None
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
    assert not jax.distributed.is_initialized()


def test_set_local_devices_replaces_the_count():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo=1"}
    set_local_devices(2, env)
    assert env["XLA_FLAGS"].split() == ["--foo=1", "--xla_force_host_platform_device_count=2"]
    set_local_devices(0, env)
    assert env["XLA_FLAGS"].endswith("count=2")


# ---------------------------------------------------------------- mesh and global arrays

def test_mesh_must_give_every_process_a_device():
    fake = [SimpleNamespace(process_index=i // 2, id=i) for i in range(4)]
    with pytest.raises(ValueError, match=r"leaves process\(es\) \[1\] without devices"):
        make_mesh(data=1, fsdp=2, devices=fake)


def test_global_arrays_place_a_host_batch_like_device_put():
    mesh = make_mesh(data=2, fsdp=2)
    sharding = batch_sharding(mesh)
    host = {"input_BxT": np.arange(32, dtype=np.int32).reshape(8, 4),
            "adv_B": np.linspace(-1, 1, 8, dtype=np.float32)}
    placed = global_arrays(host, sharding)
    for key, x in placed.items():
        assert x.sharding == sharding and np.array_equal(np.asarray(x), host[key])
        expected = jax.device_put(host[key], sharding)
        assert [s.index for s in x.addressable_shards] == [
            s.index for s in expected.addressable_shards]
        assert len({s.data.shape for s in x.addressable_shards}) == 1
        assert x.addressable_shards[0].data.shape[0] == 2


@pytest.mark.parametrize("data, fsdp", [(1, 4), (2, 2)])
def test_cpu_train_step_holds_no_native_reduce_scatter(data, fsdp):
    """XLA:CPU's native reduce-scatter can be wrong across processes (jax-ml/jax#40830):
    the step must reduce its FSDP gradients without it, as it does on jax 0.10."""
    step, state, _, mesh = _tiny_trainer(CheckArgs(out="-", data=data, fsdp=fsdp))
    batch = global_arrays(toy_batch(8), batch_sharding(mesh))
    hlo = step.lower(state, batch).compile().as_text()
    assert " all-reduce(" in hlo and NATIVE_REDUCE_SCATTER not in hlo
    # The marker does find the native op where one is compiled.
    native = jax.jit(jax.shard_map(
        lambda x: jax.lax.psum_scatter(x, "fsdp", scatter_dimension=0, tiled=True),
        mesh=mesh, in_specs=jax.P("fsdp"), out_specs=jax.P("fsdp")))
    assert NATIVE_REDUCE_SCATTER in native.lower(np.zeros(64, np.float32)).compile().as_text()


def test_scatter_sum_on_cpu_is_a_reduce_scatter():
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    inputs = [scatter_input(0.01, d, 4) for d in range(4)]
    n = inputs[0].size // 4
    scatter = scatter_sum(mesh, "x", "cpu")
    x = jax.device_put(np.concatenate(inputs), jax.NamedSharding(mesh, jax.P("x")))
    assert NATIVE_REDUCE_SCATTER not in scatter.lower(x).compile().as_text()
    got = np.asarray(scatter(x))
    total = np.sum(inputs, axis=0)
    # Device d holds the sum's d-th slice: the global result is the sum itself.
    assert got.shape == (4 * n,) and np.array_equal(got, total)


def test_check_args_refuse_unknown_checks(tmp_path):
    with pytest.raises(ValueError, match="unknown check"):
        CheckArgs(out=str(tmp_path), checks=("step", "allreduce"))


# ---------------------------------------------------------------- two real processes

_GROUP_TIMEOUT_S = 420


def _listening(pid: int) -> set[str]:
    """host:port of the TCP sockets process `pid` listens on (from /proc)."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1]
                  for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return set()
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        # The children share this process's network namespace, so its tables.
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:      # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word little-endian.
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
                ip = ipaddress.ip_address(words)
                if ip.version == 6 and ip.ipv4_mapped:
                    ip = ip.ipv4_mapped
                found.add(f"{ip}:{int(port, 16)}")
    return found


def _run_group(out: Path, num_processes: int, local_devices: int, extra: list[str]):
    """Runs fnrl.trainer.distributed_check in `num_processes` processes on loopback;
    returns the addresses each listened on. Kills the rest as soon as one fails."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)     # conftest's 8 devices: each process sets its own count
    procs = []
    listened: dict[int, set[str]] = {}
    try:
        for rank in range(num_processes):
            group = (["--distributed.num-processes", str(num_processes),
                      "--distributed.process-id", str(rank),
                      "--distributed.coordinator", f"127.0.0.1:{port}",
                      "--distributed.init-timeout-s", "120"] if num_processes > 1 else [])
            log = open(out.parent / f"{out.name}_{rank}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fnrl.trainer.distributed_check", "--out", str(out),
                 "--distributed.local-devices", str(local_devices), *group, *extra],
                env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        deadline = time.monotonic() + _GROUP_TIMEOUT_S
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            assert not failed, f"a trainer process exited with {failed}: see {out.parent}"
            assert time.monotonic() < deadline, f"group not done in {_GROUP_TIMEOUT_S} s"
            for rank, p in enumerate(procs):
                listened.setdefault(rank, set()).update(_listening(p.pid))
            running = [p for p in procs if p.poll() is None]
            try:
                if running:
                    running[0].wait(timeout=0.2)   # sample the sockets while it runs
            except subprocess.TimeoutExpired:
                pass
        logs = {r: (out.parent / f"{out.name}_{r}.log").read_text()[-3000:]
                for r in range(num_processes)}
        assert all(p.returncode == 0 for p in procs), logs
        return listened, port
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two processes x 2 CPU devices (every check), then one process x 4 devices running
    the same step and restoring the two processes' checkpoint."""
    base = tmp_path_factory.mktemp("distributed")
    listened, port = _run_group(base / "two", 2, 2, [])
    _run_group(base / "one", 1, 4, ["--checks", "step", "--restore-from",
                                    str(base / "two" / "checkpoints")])
    return SimpleNamespace(two=base / "two", one=base / "one", listened=listened, port=port)


def _params(npz) -> dict:
    return {k[len("params/"):]: npz[k] for k in npz.files if k.startswith("params/")}


@pytest.mark.slow   # two JAX processes compile the step: about a minute on 2 busy cores
def test_both_processes_saw_the_whole_group(runs):
    for rank in (0, 1):
        assert (runs.two / f"done_{rank}").read_text().split() == ["2", "4"]
    assert (runs.one / "done_0").read_text().split() == ["1", "4"]


@pytest.mark.slow
def test_the_group_listens_on_loopback_only(runs):
    # Process 0 runs the coordinator on the given port; gloo listens in both.
    assert f"127.0.0.1:{runs.port}" in runs.listened[0]
    assert all(runs.listened[rank] for rank in (0, 1))
    everything = runs.listened[0] | runs.listened[1]
    assert all(a.startswith("127.0.0.1:") for a in everything), everything


@pytest.mark.slow
def test_two_process_step_equals_one_process_step(runs):
    two = [np.load(runs.two / f"step_{r}.npz") for r in (0, 1)]
    one = np.load(runs.one / "step_0.npz")
    assert int(one["step"]) == int(two[0]["step"]) == 2
    # Both processes hold the same whole state (gathered over the group).
    for key in two[0].files:
        assert np.array_equal(two[0][key], two[1][key]), key
    p1, p2 = _params(one), _params(two[0])
    assert p1.keys() == p2.keys() and len(p1) > 10
    # Gradients are reduced over gloo in another order than within one process: float32
    # sums differ by a few ulps (measured: at most 7e-7 after two AdamW steps at lr 1e-2;
    # the first step's loss is bit-identical). A lost or doubled shard moves the update
    # by ~lr = 1e-2, so 1e-5 separates the two by three orders of magnitude.
    for key in p1:
        np.testing.assert_allclose(p2[key], p1[key], rtol=0, atol=1e-5, err_msg=key)
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=1e-6)
    assert two[0]["losses"][0] == one["losses"][0]
    moved = max(float(np.abs(one[f"init/{k}"] - p1[k]).max()) for k in p1)
    assert moved > 1e-3     # the step did train: the tolerance is far below its update


@pytest.mark.slow
def test_reduce_scatter_of_several_mib_matches_numpy(runs):
    shards = {}
    for rank in (0, 1):
        with np.load(runs.two / f"reduce_scatter_{rank}.npz") as z:
            shards.update({k: z[k] for k in z.files})
    sizes = CheckArgs(out="-").reduce_scatter_mib
    assert len(shards) == 4 * len(sizes)
    for mib in sizes:
        inputs = [scatter_input(mib, d, 4) for d in range(4)]
        n = inputs[0].size // 4
        assert n * 4 >= 3 * 2**20      # several MiB per output shard
        total = np.sum(inputs, axis=0, dtype=np.float64)
        for d in range(4):
            got = shards[f"{mib}/{d}"]
            # Whole numbers: every summation order is exact, so equality is required.
            assert got.shape == (n,) and np.array_equal(got, total[d * n:(d + 1) * n]), (mib, d)


@pytest.mark.slow
def test_checkpoint_restores_bit_for_bit_in_both_processes(runs):
    step = np.load(runs.two / "step_0.npz")
    for rank in (0, 1):
        restored = np.load(runs.two / f"checkpoint_{rank}.npz")
        assert bool(restored["same"]), rank    # every addressable shard, in each process
        np.testing.assert_array_equal(restored["extra_losses"], step["losses"])
        for key, value in _params(step).items():
            assert np.array_equal(restored[f"params/{key}"], value), (rank, key)


@pytest.mark.slow
def test_two_process_checkpoint_restores_on_one_process(runs):
    """A trainer group restarted with another process count resumes the same state."""
    saved = _params(np.load(runs.two / "step_0.npz"))
    with np.load(runs.one / "restored_params_0.npz") as restored:
        assert sorted(restored.files) == sorted(saved)
        for key, value in saved.items():
            assert np.array_equal(restored[key], value), key
