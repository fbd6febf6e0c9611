"""Weight synchronisation through the relay tier, measured side by side in one run.

    python benchmarks/weight_sync.py [--sizes-mb 10 100 500 2048] [--max-p 8] [--runs 4]

For each weight size it prints, beside its reference:
  1. the trainer's stall per publish (hand-off to the master relay through shared memory)
     against one memory copy of the same bytes (goal <= 1.5x);
  2. the chain broadcast time to p = 1..max_p relays on this host, T(p)/T(1) (goal <= 1.5),
     beside the prediction of Laminar's Appendix C cost model fitted on this host, and
     beside the CPU time all relays used meanwhile: p + 1 relays sharing this host's cores
     cannot broadcast faster than that CPU time over the number of cores (on separate
     hosts, as in Laminar, each relay has its own);
  3. a rollout's pull-to-serving time (ask the local relay, map the version, copy it into
     preallocated serving parameters as vLLM's reload does) against one memory copy into
     those parameters (goal <= 3x); each pull reads a newly published version, as a
     rollout does, in a segment the relay recycled.
Configurations that would not fit in 70% of the available memory are skipped and say so
(each relay holds its newest version plus a populated spare segment for the next).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fnrl.relay import store  # noqa: E402
from fnrl.relay.chain import ChainPlan  # noqa: E402
from fnrl.relay.client import RelayClient  # noqa: E402
from fnrl.config import MIB, RelayConfig  # noqa: E402
from fnrl.relay.tier import RelayTier  # noqa: E402
from fnrl.serving.worker_ext import torch_views  # noqa: E402

TENSORS = 8  # a version is 8 float32 tensors of equal size


def weights(total_bytes: int, version: int) -> dict[str, np.ndarray]:
    n = total_bytes // TENSORS // 4
    out = {}
    for i in range(TENSORS):
        a = np.empty(n, np.float32)
        a[:] = version + i  # touches every page, so the source is warm like a trainer's
        out[f"model.layers.{i}.mlp.weight"] = a
    return out


def memcpy_s(src: dict[str, np.ndarray], dst: dict[str, np.ndarray]) -> float:
    """One copy of the same bytes into warm, preallocated memory (the reference)."""
    t = time.perf_counter()
    for k, a in src.items():
        np.copyto(dst[k], a)
    return time.perf_counter() - t


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_spares(addresses: list[str], timeout_s: float = 120.0) -> None:
    """Let every relay finish populating its segment for the next version, so one
    measurement's page allocation does not run under the next."""
    deadline = time.monotonic() + timeout_s
    for address in addresses:
        with RelayClient(address, timeout_s=5) as c:
            while not c.ping()["spare_ready"] and time.monotonic() < deadline:
                time.sleep(0.02)


def stall_and_pull(size: int, log_dir: str, runs: int = 4) -> dict:
    """Trainer stall and pull-to-serving on one master relay, `runs` of each after a
    warm-up."""
    cfg = RelayConfig(num_relays=1, keep_versions=1, inbox_slots=1)
    tier = RelayTier.launch(cfg, log_dir, prefix=f"bs{size // MIB}r")
    try:
        master = RelayClient(tier.master.address, timeout_s=120)
        src = weights(size, 0)
        # Two references: a copy into warm numpy memory (the fastest copy this host makes:
        # numpy asks for huge pages) for the stall, and a copy into the serving parameters
        # (the copy any reload makes; torch memory has 4 KiB pages, ~3x slower at 2 GB)
        # for the pull.
        dst = {k: np.ones_like(a) for k, a in src.items()}
        # Reference and measurement alternate, so load from other jobs hits both alike.
        refs, stalls = [], []
        for version in range(runs + 1):  # the first publish maps the inbox slot: warm-up
            wait_spares(tier.addresses)
            refs.append(memcpy_s(src, dst))
            t = time.perf_counter()
            master.publish(version, src, wait="held")
            stalls.append(time.perf_counter() - t)
            master.wait_version(version, timeout_s=120)
        del dst  # one reference destination at a time: 2 GB fits in less memory
        serving = {k: torch.zeros(a.shape, dtype=torch.float32) for k, a in src.items()}
        serving_np = {k: t.numpy() for k, t in serving.items()}
        pull_refs, pulls = [], []
        for version in range(runs + 1, 2 * runs + 2):  # the first pull maps: warm-up
            master.publish(version, src, wait="visible")
            wait_spares(tier.addresses)
            pull_refs.append(memcpy_s(src, serving_np))
            t = time.perf_counter()
            pull(master, serving)
            pulls.append(time.perf_counter() - t)
        master.close()
        return {"ref": statistics.median(refs[1:]), "stall": statistics.median(stalls[1:]),
                "stall_ratio": statistics.median(s / r for s, r in zip(stalls[1:], refs[1:])),
                "pull_ref": statistics.median(pull_refs[1:]), "pull": statistics.median(pulls[1:]),
                "pull_ratio": statistics.median(p / r for p, r in zip(pulls[1:], pull_refs[1:]))}
    finally:
        tier.stop()


def pull(relay: RelayClient, serving: dict[str, torch.Tensor]) -> None:
    """What fnrl_pull does, with vLLM's parameter copy done by torch here. The views die
    on return, and with them this reader's lock: the relay can recycle the segment."""
    arrays = store.open_version(relay.latest())
    for name, view in torch_views(arrays):
        serving[name].copy_(view)


def broadcast(size: int, max_p: int, log_dir: str) -> list[tuple[float, float]]:
    """(T(p), CPU seconds all p + 1 relays used meanwhile) for p = 1..max_p; T runs from
    the end of the hand-off to the last relay verified."""
    cfg = RelayConfig(num_relays=max_p + 1, keep_versions=1, inbox_slots=1)
    tier = RelayTier.launch(cfg, log_dir, prefix=f"bb{size // MIB}r")
    names = list(tier.plan.order)
    src = weights(size, 0)
    times = []
    try:
        master = RelayClient(tier.master.address, timeout_s=120)
        # A first version through the whole chain: a relay's first version faults its
        # pages in (it has no spare segment yet), a one-off cost that is not broadcast's.
        master.publish(0, src, wait="held")
        with RelayClient(tier.addresses[-1], timeout_s=120) as last:
            last.wait_version(0, timeout_s=300)
        version = 1
        for p in range(1, max_p + 1):
            tier.plan = ChainPlan(order=tuple(names[: p + 1]), epoch=p)
            tier.configure()
            tail = RelayClient(tier.members[names[p]].address, timeout_s=120)
            pids = [tier.members[n].proc.pid for n in names[: p + 1]]
            best = (float("inf"), 0.0)
            for _ in range(2 if size <= 512 * MIB else 1):
                wait_spares(tier.addresses)
                master.publish(version, src, wait="held")
                t, cpu = time.perf_counter(), sum(map(cpu_seconds, pids))
                tail.wait_version(version, timeout_s=300)
                best = min(best, (time.perf_counter() - t, sum(map(cpu_seconds, pids)) - cpu))
                version += 1
            times.append(best)
            tail.close()
        master.close()
    finally:
        tier.stop()
    return times


def laminar_model(p: int, size: int, chunk: int, t_byte: float, t_start: float) -> float:
    """Appendix C: T = (n + k - 2)(M/k T_byte + T_start), n = p + 1 nodes with the master."""
    k = max(1, -(-size // chunk))
    return (p + 1 + k - 2) * (size / k * t_byte + t_start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100, 500, 2048])
    parser.add_argument("--max-p", type=int, default=8)
    parser.add_argument("--runs", type=int, default=4,
                        help="measured stalls and pulls per size (medians are printed)")
    args = parser.parse_args()
    chunk = RelayConfig().chunk_bytes
    cores = len(os.sched_getaffinity(0))
    log_dir = tempfile.mkdtemp(prefix="fnrl-weight-sync-")
    print(f"# relay logs in {log_dir}; chunk {chunk // MIB} MiB; UCX over shared memory/CMA")

    # T_start of the cost model: a one-chunk, 64 KiB version through one hop.
    t_start = broadcast(64 * 1024, 1, log_dir)[0][0]
    print(f"# fitted T_start = {t_start * 1e3:.2f} ms (64 KiB, one hop)\n")

    print("## 1. trainer stall per publish vs one memcpy (goal <= 1.5x)  and"
          "  3. pull-to-serving vs one memcpy (goal <= 3x)")
    print(f"# medians of {args.runs} runs; ratios are medians of per-run ratios (reference measured")
    print("# right before each run: this box is shared and its load moves both alike)")
    print("# stall/cp: against a copy into warm numpy memory; pull/cp: against a copy into the")
    print("# serving parameters (torch), the copy vLLM's reload makes in any case")
    print(f"{'size':>8} {'memcpy':>9} {'stall':>9} {'stall/cp':>8} {'cp->torch':>9} {'pull':>9} "
          f"{'pull/cp':>8}")
    for mb in args.sizes_mb:
        size = mb * MIB
        if size * 5 > available_bytes() * 0.7:
            print(f"{mb:>6}MB  skipped (memory: needs ~{5 * mb} MB, 70% of available is "
                  f"{available_bytes() * 0.7 / MIB:.0f} MB)")
            continue
        r = stall_and_pull(size, log_dir, args.runs)
        print(f"{mb:>6}MB {r['ref'] * 1e3:>7.1f}ms {r['stall'] * 1e3:>7.1f}ms "
              f"{r['stall_ratio']:>7.2f}x {r['pull_ref'] * 1e3:>7.1f}ms {r['pull'] * 1e3:>7.1f}ms "
              f"{r['pull_ratio']:>7.2f}x", flush=True)

    print("\n## 2. broadcast to p relays: measured T(p), T(p)/T(1) (goal <= 1.5), "
          "Laminar App. C model")
    print(f"# best of 2 runs (1 above 512 MB); relay CPU: CPU time of all p + 1 relays during "
          f"T(p);\n# CPU/cores: the least T(p) can be with them sharing {cores} cores; /T(1): "
          f"that floor over T(1)")
    for mb in args.sizes_mb:
        size = mb * MIB
        max_p, budget = args.max_p, available_bytes() * 0.7
        while max_p > 0 and size * (2 * max_p + 4) > budget:
            max_p -= 1
        if max_p == 0:
            print(f"{mb:>6}MB  skipped (memory: even p = 1 needs ~{6 * mb} MB, 70% of "
                  f"available is {budget / MIB:.0f} MB)")
            continue
        measured = broadcast(size, max_p, log_dir)
        times = [t for t, _ in measured]
        k = max(1, -(-size // chunk))
        t_byte = max(times[0] - k * t_start, 1e-9) / size  # fitted on T(1)
        print(f"{mb}MB ({k} chunks): fitted T_byte = {1 / t_byte / 1e9:.2f} GB/s per hop"
              + ("" if max_p == args.max_p else
                 f"; p > {max_p} skipped (memory: p relays hold (2p + 4) x {mb} MB, a version "
                 f"and a spare each plus the master's inbox and the source; p = {max_p + 1} "
                 f"needs {(2 * max_p + 6) * mb} MB, 70% of available is {budget / MIB:.0f} MB)"))
        print(f"{'p':>4} {'T(p)':>9} {'T(p)/T(1)':>9} {'model':>9} {'model/T1':>9} "
              f"{'relay CPU':>9} {'CPU/cores':>9} {'/T(1)':>6}")
        for p, (t, cpu) in enumerate(measured, start=1):
            model = laminar_model(p, size, chunk, t_byte, t_start)
            print(f"{p:>4} {t * 1e3:>7.1f}ms {t / times[0]:>8.2f}x {model * 1e3:>7.1f}ms "
                  f"{model / laminar_model(1, size, chunk, t_byte, t_start):>8.2f}x "
                  f"{cpu * 1e3:>7.0f}ms {cpu / cores * 1e3:>7.0f}ms {cpu / cores / times[0]:>5.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
