"""Weight synchronisation through the relay tier, each figure beside its reference in
rounds of one run.

    python -m lab.benchmarks.weight_sync [--sizes-mb 10 100 500] [--max-p 4] [--runs 25] [--rounds 16]
    python -m lab.benchmarks.weight_sync --sizes-mb 500 --tensors 8 18432 --no-broadcast

(the second: a version as 8 tensors beside the same bytes as a mixture of experts' 18,432,
where a cost per tensor in the relay or the pull would show.)

(25 and 16 rounds: fewer gave spreads that a second run's median often fell outside;
docs/benchmarks.md.)

For each weight size it prints, beside its reference:
  1. the trainer's stall per publish (hand-off to the master relay through shared memory)
     against one memory copy of the same bytes (goal <= 1.5x);
  2. the chain broadcast time to p = 1..max_p relays on this host, T(p)/T(1) (goal <= 1.5),
     beside Laminar's Appendix C cost model, and beside the CPU time all relays used
     meanwhile: p + 1 relays sharing this host's cores cannot broadcast faster than that
     CPU time over the number of cores (on separate hosts, as in Laminar, each relay has
     its own);
  3. a rollout's pull-to-serving time (ask the local relay, map the version, copy it into
     preallocated serving parameters as vLLM's reload does) against one memory copy into
     those parameters (goal <= 3x); each pull reads a newly published version, as a
     rollout does, in a segment the relay recycled.

Method (lab/benchmarks/rounds.py): a ratio is taken within a round, between figures measured
seconds apart, and printed as the median with the min–max spread over rounds. For 1 and
3 each round runs the measurement and its reference once, which first varying; for 2
each round measures T(1), ..., T(max_p) once in an order that varies between rounds,
and T(p)/T(1) divides by the T(1) of the same round.

The model: T = (n + k − 2)(M/k · T_byte + T_start) for n = p + 1 nodes and k chunks.
Fitted on T(1) alone (as before) its T(p)/T(1) is (p + k − 1)/k whatever T_byte and
T_start are, so it predicted nothing. Here T_byte and T_start are fitted by least squares
on the p in `--fit-p` of every size and the model predicts the other p, with its error
against the measured median printed; with one chunk it says T grows as p (a relay
forwards a chunk only once it has all of it).
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


from fnrl.relay import store
from fnrl.relay.chain import ChainPlan
from fnrl.relay.client import RelayClient
from fnrl.config import MIB, RelayConfig
from fnrl.relay.tier import RelayTier
from fnrl.serving.worker_ext import torch_views

from lab.benchmarks.rounds import Spread, environment, load, round_orders

TENSORS = 8  # by default a version is 8 float32 tensors of equal size
MOE_TENSORS = 48 * 128 * 3
"""Qwen3-30B-A3B's expert tensors (48 layers x 128 experts x gate, up, down): the count
`--tensors` compares against, where a per-tensor cost would show."""


def weights(total_bytes: int, version: int, tensors: int = TENSORS) -> dict[str, np.ndarray]:
    n = total_bytes // tensors // 4
    out = {}
    for i in range(tensors):
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


def _paired(orders, tier, ref, run, *, start: int = 0, before=None):
    """Each round's sides in its order, on quiet relays: (reference seconds, run
    seconds), one of each per round. `run` and `before` get the round's version."""
    refs, runs = [], []
    for version, order in enumerate(orders, start=start):
        if before is not None:
            before(version)
        for side in order:
            wait_spares(tier.addresses)
            if side == "ref":
                refs.append(ref())
            else:
                runs.append(run(version))
    return refs, runs


def stall_and_pull(size: int, log_dir: str, runs: int, seed: int,
                   tensors: int = TENSORS) -> dict:
    """Trainer stall and pull-to-serving on one master relay, `runs` of each after a
    warm-up, each beside its reference in the same round; per-round ratios."""
    cfg = RelayConfig(num_relays=1, keep_versions=1, inbox_slots=1)
    tier = RelayTier.launch(cfg, log_dir, prefix=f"bs{size // MIB}r")
    # Which of a round's two goes first varies (rounds.round_orders), so neither always
    # runs on the caches and the CPU state the other leaves behind.
    orders = round_orders(("ref", "run"), runs + 1, seed=seed)
    try:
        master = RelayClient(tier.master.address, timeout_s=120)
        src = weights(size, 0, tensors)
        # Two references: a copy into warm numpy memory (the fastest copy this host makes:
        # numpy asks for huge pages) for the stall, and a copy into the serving parameters
        # (the copy any reload makes; torch memory has 4 KiB pages, ~3x slower at 2 GB)
        # for the pull.
        dst = {k: np.ones_like(a) for k, a in src.items()}

        def stall(version: int) -> float:
            t = time.perf_counter()
            master.publish(version, src, wait="held")
            took = time.perf_counter() - t
            master.wait_version(version, timeout_s=120)
            return took

        # The first publish maps the inbox: a warm-up.
        refs, stalls = _paired(orders, tier, lambda: memcpy_s(src, dst), stall)
        del dst  # one reference destination at a time: 2 GB fits in less memory
        serving = {k: torch.zeros(a.shape, dtype=torch.float32) for k, a in src.items()}
        serving_np = {k: t.numpy() for k, t in serving.items()}

        def timed_pull(version: int) -> float:
            t = time.perf_counter()
            pull(master, serving)
            return time.perf_counter() - t

        # The first pull maps: a warm-up.
        pull_refs, pulls = _paired(orders, tier, lambda: memcpy_s(src, serving_np), timed_pull,
                                   start=len(orders),
                                   before=lambda v: master.publish(v, src, wait="visible"))
        master.close()
        return {"ref": statistics.median(refs[1:]), "stall": statistics.median(stalls[1:]),
                "stall_ratio": Spread.of([s / r for s, r in zip(stalls[1:], refs[1:])]),
                "pull_ref": statistics.median(pull_refs[1:]), "pull": statistics.median(pulls[1:]),
                "pull_ratio": Spread.of([p / r for p, r in zip(pulls[1:], pull_refs[1:])])}
    finally:
        tier.stop()


def pull(relay: RelayClient, serving: dict[str, torch.Tensor]) -> None:
    """What fnrl_pull does, with vLLM's parameter copy done by torch here. The views die
    on return, and with them this reader's lock: the relay can recycle the segment."""
    arrays = store.open_version(relay.latest())
    for name, view in torch_views(arrays):
        serving[name].copy_(view)


def broadcast(size: int, max_p: int, log_dir: str, rounds: int,
              seed: int) -> dict[int, list[tuple[float, float]]]:
    """Per p = 1..max_p, per round: (T(p), CPU seconds all p + 1 relays used meanwhile);
    T runs from the end of the hand-off to the last relay verified. Each round measures
    every p once, T(1) included, in an order that varies between rounds."""
    cfg = RelayConfig(num_relays=max_p + 1, keep_versions=1, inbox_slots=1)
    tier = RelayTier.launch(cfg, log_dir, prefix=f"bb{size // MIB}r")
    names = list(tier.plan.order)
    src = weights(size, 0)
    times: dict[int, list[tuple[float, float]]] = {p: [] for p in range(1, max_p + 1)}
    try:
        master = RelayClient(tier.master.address, timeout_s=120)
        # A first version through the whole chain: a relay's first version faults its
        # pages in (it has no spare segment yet), a one-off cost that is not broadcast's.
        master.publish(0, src, wait="held")
        with RelayClient(tier.addresses[-1], timeout_s=120) as last:
            last.wait_version(0, timeout_s=300)
        version = epoch = 1
        for order in round_orders(tuple(range(1, max_p + 1)), rounds, seed=seed):
            for p in order:
                epoch += 1
                tier.plan = ChainPlan(order=tuple(names[: p + 1]), epoch=epoch)
                tier.configure()
                pids = [tier.members[n].proc.pid for n in names[: p + 1]]
                with RelayClient(tier.members[names[p]].address, timeout_s=120) as tail:
                    wait_spares(tier.addresses)
                    master.publish(version, src, wait="held")
                    t, cpu = time.perf_counter(), sum(map(cpu_seconds, pids))
                    tail.wait_version(version, timeout_s=300)
                    times[p].append((time.perf_counter() - t, sum(map(cpu_seconds, pids)) - cpu))
                version += 1
        master.close()
    finally:
        tier.stop()
    return times


def laminar_terms(p: int, size: int, chunk: int) -> tuple[float, float]:
    """Appendix C: T = (n + k - 2)(M/k T_byte + T_start), n = p + 1 nodes with the master,
    k chunks: the coefficients of T_byte and T_start, so the model is linear in them."""
    k = max(1, -(-size // chunk))
    return (p + k - 1) * size / k, float(p + k - 1)


def fit_laminar(points: list[tuple[int, int, float]], chunk: int) -> tuple[float, float]:
    """(T_byte, T_start) by least squares over (p, size, T) points."""
    a = np.array([laminar_terms(p, size, chunk) for p, size, _ in points])
    t = np.array([x for _, _, x in points])
    (t_byte, t_start), *_ = np.linalg.lstsq(a, t, rcond=None)
    return float(t_byte), float(t_start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--max-p", type=int, default=4)
    parser.add_argument("--runs", type=int, default=25,
                        help="rounds of stall/pull beside their reference, per size")
    parser.add_argument("--rounds", type=int, default=16,
                        help="rounds of T(1..max_p) in varying order, per size")
    parser.add_argument("--fit-p", type=int, nargs="+", default=[1, 2],
                        help="p whose T(p) fit the cost model; it predicts the others")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (the pull's copy); numpy's copy uses one")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rounds' orders")
    parser.add_argument("--tensors", type=int, nargs="+", default=[TENSORS],
                        help=f"tensors a version is split into, each count measured in turn "
                             f"for 1 and 3 (a mixture of experts' many small ones: "
                             f"{MOE_TENSORS:,} for Qwen3-30B-A3B's experts)")
    parser.add_argument("--no-broadcast", action="store_true", help="measure 1 and 3 only")
    args = parser.parse_args()
    # The pull's torch copy_ and the reference's numpy copy get the same single thread
    # by default: a parallel copy_ against a serial reference would flatter the pull.
    torch.set_num_threads(args.threads)
    chunk = RelayConfig().chunk_bytes
    cores = len(os.sched_getaffinity(0))
    log_dir = tempfile.mkdtemp(prefix="fnrl-weight-sync-")
    print(f"# relay logs in {log_dir}; chunk {chunk // MIB} MiB; UCX over shared memory/CMA; "
          f"torch threads {torch.get_num_threads()}, numpy copy 1 thread, relays on {cores} CPUs")
    print(f"# {environment()}", flush=True)

    print("\n## 1. trainer stall per publish vs one memcpy (goal <= 1.5x)  and"
          "  3. pull-to-serving vs one memcpy (goal <= 3x)")
    print(f"# {args.runs} rounds after a warm-up, each a run and its reference in varying order;")
    print("# ratios: median (min-max) of per-round ratios")
    print("# stall/cp: against a copy into warm numpy memory; pull/cp: against a copy into the")
    print("# serving parameters (torch), the copy vLLM's reload makes in any case")
    print(f"{'size':>8} {'tensors':>8} {'memcpy':>9} {'stall':>9} {'stall/cp':>18} "
          f"{'cp->torch':>9} {'pull':>9} {'pull/cp':>18}  load")
    for mb in args.sizes_mb:
        size = mb * MIB
        if size * 5 > available_bytes() * 0.7:
            print(f"{mb:>6}MB  skipped (memory: needs ~{5 * mb} MB, 70% of available is "
                  f"{available_bytes() * 0.7 / MIB:.0f} MB)")
            continue
        for tensors in args.tensors:
            load_start = load()
            r = stall_and_pull(size, log_dir, args.runs, args.seed, tensors)
            sr, pr = r["stall_ratio"], r["pull_ratio"]
            print(f"{mb:>6}MB {tensors:>8,} {r['ref'] * 1e3:>7.1f}ms {r['stall'] * 1e3:>7.1f}ms "
                  f"{f'{sr.median:.2f}x ({sr.low:.2f}-{sr.high:.2f})':>18} "
                  f"{r['pull_ref'] * 1e3:>7.1f}ms {r['pull'] * 1e3:>7.1f}ms "
                  f"{f'{pr.median:.2f}x ({pr.low:.2f}-{pr.high:.2f})':>18}  "
                  f"{load_start} -> {load()}", flush=True)
    if args.no_broadcast:
        return

    print("\n## 2. broadcast to p relays: T(p)/T(1) (goal <= 1.5) and Laminar App. C's model")
    print(f"# {args.rounds} rounds; each measures T(1..p) once in varying order; T(p)/T(1): "
          f"median (min-max) of per-round ratios.\n# relay CPU: CPU time of all p + 1 relays "
          f"during T(p); CPU/cores: the least T(p) can be with them sharing {cores} cores.\n"
          f"# model: T_byte and T_start fitted on p in {args.fit_p} of every size, predicting "
          f"the other p (held out)")
    measured = {}
    for mb in args.sizes_mb:
        size = mb * MIB
        max_p, budget = args.max_p, available_bytes() * 0.7
        while max_p > 0 and size * (2 * max_p + 4) > budget:
            max_p -= 1
        if max_p == 0:
            print(f"{mb:>6}MB  skipped (memory: even p = 1 needs ~{6 * mb} MB, 70% of "
                  f"available is {budget / MIB:.0f} MB)")
            continue
        if max_p < args.max_p:
            print(f"{mb}MB: p > {max_p} skipped (memory: p relays hold (2p + 4) x {mb} MB, a "
                  f"version and a spare each plus the master's inbox and the source; 70% of "
                  f"available is {budget / MIB:.0f} MB)")
        load_start = load()
        measured[size] = broadcast(size, max_p, log_dir, args.rounds, args.seed)
        print(f"# {mb} MB measured (load {load_start} -> {load()})", flush=True)
    fit = [(p, size, statistics.median(t for t, _ in runs))
           for size, by_p in measured.items() for p, runs in by_p.items() if p in args.fit_p]
    t_byte, t_start = fit_laminar(fit, chunk) if fit else (float("nan"), float("nan"))
    print(f"# fitted T_byte = {1 / t_byte / 1e9 if t_byte > 0 else float('nan'):.2f} GB/s per "
          f"hop, T_start = {t_start * 1e3:.2f} ms")
    for size, by_p in measured.items():
        k = max(1, -(-size // chunk))
        print(f"{size // MIB}MB ({k} chunks)")
        print(f"{'p':>4} {'T(p)':>9} {'T(p)/T(1)':>20} {'model':>9} {'model err':>9} "
              f"{'relay CPU':>9} {'CPU/cores':>9}")
        t1 = [t for t, _ in by_p[1]]
        for p, runs in by_p.items():
            t = statistics.median(x for x, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            ratio = Spread.of([x / y for (x, _), y in zip(runs, t1)])
            model = float(np.dot(laminar_terms(p, size, chunk), (t_byte, t_start)))
            err = "fit" if p in args.fit_p else f"{100 * (model / t - 1):+.0f}%"
            print(f"{p:>4} {t * 1e3:>7.1f}ms "
                  f"{f'{ratio.median:.2f}x ({ratio.low:.2f}-{ratio.high:.2f})':>20} "
                  f"{model * 1e3:>7.1f}ms {err:>9} {cpu * 1e3:>7.0f}ms {cpu / cores * 1e3:>7.0f}ms",
                  flush=True)
    print(f"load average at end: {load()}")


if __name__ == "__main__":
    main()
