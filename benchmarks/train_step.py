"""fnrl's jitted train step against a PyTorch reference step, in paired rounds.

    python benchmarks/train_step.py --rounds 5 --steps 8          # CPU-sized Qwen2, speed
    python benchmarks/train_step.py --rounds 5 --threads 1        # one intra-op thread each
    python benchmarks/train_step.py --preset 1b                   # ~1B Qwen2, bf16 (GPU), MFU
    flock /tmp/fnrl-heavy.lock python benchmarks/train_step.py --memory [--layers 2 --batch 2]

Both sides run the same model config, batch and loss (PPO clip on per-token
log-probs, token mean), global-norm clipping and AdamW. The reference is
transformers' Qwen2ForCausalLM forward and backward with torch.optim.AdamW.

Speed. Each side runs in its own fresh process (its own peak memory, no shared
thread pools). A round starts one process per side, lets each compile and warm up
in turn, then has them take turns one step at a time in the order fnrl, torch,
torch, fnrl, ... (ABBA), while the other waits idle: a burst of load from other jobs
on a shared machine lands on both sides' steps of the same seconds instead of on one
side's whole run. The first side alternates within each pair of rounds, the pairs in
seeded random order (benchmarks/rounds.py, `--seed`). A round's ratio is
torch's median step over fnrl's (the fnrl/torch throughput ratio); the result is the
median of the rounds' ratios with their min–max spread, beside the same ratio of CPU
seconds per step (all threads), which counts work rather than waiting for a core.
Both sides get the same CPUs and thread count (`--threads`: the affinity that sizes
XLA's intra-op pool, torch.set_num_threads and OMP/MKL; see fnrl.trainer.xla_flags),
printed with the environment (CPUs, MemAvailable, versions) and each round's load
average at its start and end.

Memory. `--memory` reports the peak trainer memory of one step of the
Qwen2.5-0.5B-shaped model at 8 × 1,024 tokens: plain, chunked log-probs, chunked
log-probs + remat, for each of `--memory-dtypes` (compute dtypes over float32 master
weights), each measured in a fresh process by fnrl.trainer.peak beside the trainer's
memory plan; a configuration whose plan is above `--memory-limit-gb` is not run (the
plan stands as its estimate); `--layers` / `--batch` measure a smaller shape beside its
own plan instead. At the full shape chunked log-probs + remat is measured (about 16 min
a configuration on 2 busy cores); the others' plans are above the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_memory  # noqa: E402
from rounds import Spread, environment, round_orders  # noqa: E402
from rounds import load as _load  # noqa: E402

from fnrl.trainer.xla_flags import set_cpu_threads  # noqa: E402

PRESETS = {
    # Small enough for a 2-core CPU; big enough that matmuls, not dispatch, dominate.
    "cpu": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, batch=8, seq=128, dtype="float32",
                tie_word_embeddings=False),
    # Qwen2.5-1.5B's shape with fewer layers: ~1.0B parameters.
    "1b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=20,
               num_attention_heads=12, num_key_value_heads=2, batch=8, seq=2048, dtype="bfloat16",
               tie_word_embeddings=False),
    # Qwen2.5-0.5B's real config (tied embeddings): the memory column's model.
    "qwen0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                     num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     batch=8, seq=1024, dtype="bfloat16", tie_word_embeddings=True),
}
_NOT_MODEL = ("batch", "seq", "dtype")
# Dense bf16 peak of one GPU, for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _trainer_xla_flags() -> None:
    """The XLA options the trainer role sets, so the step is measured as it runs there."""
    try:
        from fnrl.trainer.xla_flags import use_memory_scheduler
    except ImportError:  # a tree from before the trainer set any (a "before" figure)
        return
    use_memory_scheduler()


def model_flops_per_token(p: dict) -> float:
    """6·(matmul params) + 12·layers·seq·hidden for attention scores (Chinchilla-style)."""
    E, I, L, V = p["hidden_size"], p["intermediate_size"], p["num_hidden_layers"], p["vocab_size"]
    D = E // p["num_attention_heads"]
    kv = p["num_key_value_heads"] * D
    per_layer = E * E * 2 + 2 * E * kv + 3 * E * I  # q, o, k, v, gate/up/down
    matmul_params = L * per_layer + E * V            # lm_head (the embedding is a gather)
    return 6 * matmul_params + 12 * L * p["seq"] * E


def _batch_numpy(p: dict, seed: int = 0):
    import numpy as np
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, p["vocab_size"], (p["batch"], p["seq"] + 1)).astype(np.int32)
    mask = np.ones((p["batch"], p["seq"]), np.float32)
    mask[:, : p["seq"] // 4] = 0.0  # a prompt quarter: trained on the response only
    return {"input_BxT": tokens[:, :-1], "target_BxT": tokens[:, 1:], "mask_BxT": mask,
            "behaviour_logp_BxT": np.full(mask.shape, -8.0, np.float32) * mask,
            "adv_B": rng.standard_normal(p["batch"]).astype(np.float32)}


def _time_steps(step, steps: int, warmup: int, paced: bool):
    """(wall seconds of each timed step, CPU seconds of each (all threads), seconds of the
    first call, compile included).

    paced: the parent sends one line per step on stdin and reads each step's time
    back, so two sides' steps interleave (see `speed`); else the steps run back to back.
    """
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    if paced:
        print(json.dumps({"ready": first}), flush=True)
    times, cpu = [], []
    for _ in range(steps):
        if paced and sys.stdin.readline().strip() != "step":
            break
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if paced:
            print(json.dumps({"step_s": times[-1]}), flush=True)
    return times, cpu, first


def run_fnrl(p: dict, steps: int, warmup: int, paced: bool = False) -> dict:
    import jax
    import jax.numpy as jnp

    from fnrl.config import AlgoConfig
    from fnrl.models.decoder import DecoderConfig, init_model
    from fnrl.trainer.step import compile_train_step, init_state, make_optimizer

    base_mb = _rss_mb()
    cfg = DecoderConfig(**{k: v for k, v in p.items() if k not in _NOT_MODEL})
    dtype = jnp.bfloat16 if p["dtype"] == "bfloat16" else jnp.float32
    graphdef, params = init_model(cfg, seed=0, dtype=dtype)  # f32 master weights
    algo = AlgoConfig(learning_rate=1e-5)
    optimizer = make_optimizer(algo)
    state = jax.jit(lambda q: init_state(q, optimizer), donate_argnums=0)(params)
    del params
    step = compile_train_step(graphdef, optimizer, algo, None, None)
    batch = jax.device_put(_batch_numpy(p))
    box = {"state": state}

    def one():
        box["state"], box["metrics"] = step(box["state"], batch, None)
        jax.block_until_ready(box["metrics"])

    times, cpu, first = _time_steps(one, steps, warmup, paced)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {"step_s": times, "cpu_s": cpu, "first_call_s": first,
            "loss": float(box["metrics"]["loss"]),
            "device": device.device_kind, "platform": device.platform,
            "peak_device_mb": stats.get("peak_bytes_in_use", 0) / 2**20,
            "peak_rss_mb": _peak_rss_mb(), "base_rss_mb": base_mb,
            "threads": len(os.sched_getaffinity(0)),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def run_torch(p: dict, steps: int, warmup: int, paced: bool = False) -> dict:
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base_mb = _rss_mb()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = Qwen2Config(**{k: v for k, v in p.items() if k not in _NOT_MODEL},
                      max_position_embeddings=max(p["seq"], 512), attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dev).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0)
    b = {k: torch.from_numpy(np.asarray(v)).to(dev) for k, v in _batch_numpy(p).items()}
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=p["dtype"] == "bfloat16")
    box = {}

    def step():
        with amp:
            logits = model(input_ids=b["input_BxT"].long()).logits
        logp = torch.log_softmax(logits.float(), -1).gather(-1, b["target_BxT"].long()[..., None])[..., 0]
        ratio = torch.exp(logp - b["behaviour_logp_BxT"])
        adv = b["adv_B"][:, None]
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
        mask = b["mask_BxT"]
        loss = (per_token * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        box["loss"] = loss
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, cpu, first = _time_steps(step, steps, warmup, paced)
    return {"step_s": times, "cpu_s": cpu, "first_call_s": first, "loss": float(box["loss"]),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "platform": "gpu" if cuda else "cpu",
            "peak_device_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0,
            "peak_rss_mb": _peak_rss_mb(), "base_rss_mb": base_mb,
            "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads()}


def _child_cmd(side: str, args) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--preset", args.preset,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    for flag, value in (("--batch", args.batch), ("--seq", args.seq), ("--layers", args.layers)):
        if value:
            cmd += [flag, str(value)]
    return cmd + ["--paced"]


class _PacedSide:
    """A side's process that runs one step each time it is told to (see `speed`)."""

    def __init__(self, side: str, args):
        self.side = side
        self.proc = subprocess.Popen(_child_cmd(side, args), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def _line(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"{self.side} child exited with {self.proc.returncode}:\n"
                               f"{self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def ready(self) -> float:
        return self._line()["ready"]

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._line()["step_s"]

    def result(self) -> dict:
        out = self._line()
        self.proc.wait()
        return out


def _preset(args) -> dict:
    p = dict(PRESETS[args.preset])
    overrides = (("batch", args.batch), ("seq", args.seq), ("num_hidden_layers", args.layers))
    for key, value in overrides:
        if value:
            p[key] = value
    return p


def speed(args, p: dict) -> None:
    """Rounds of paired processes, steps interleaved ABBA; per-round ratios, median, spread.

    Both sides of a round are set up (compiled, warmed up) first, then take turns one
    step at a time, in the order fnrl, torch, torch, fnrl, ...: a burst of load from
    other jobs lands on both sides' steps of the same seconds, not on one side's run.
    """
    rounds = []
    for r, order in enumerate(round_orders(("fnrl", "torch"), args.rounds, seed=args.seed)):
        load_start = _load()
        sides = {}
        for name in order:  # one at a time: each compiles while the other waits
            sides[name] = _PacedSide(name, args)
            sides[name].ready()
        for i in range(args.steps):
            for name in order if i % 2 == 0 else order[::-1]:
                sides[name].step()
        got = {name: side.result() for name, side in sides.items()}
        med = {s: statistics.median(got[s]["step_s"]) for s in got}
        cpu = {s: statistics.median(got[s]["cpu_s"]) for s in got}
        rounds.append({"first": order[0], "results": got, "median_s": med, "cpu_s": cpu,
                       "ratio": med["torch"] / med["fnrl"],
                       "cpu_ratio": cpu["torch"] / cpu["fnrl"]})
        print(f"round {r + 1}/{args.rounds} ({order[0]} first): fnrl {1e3 * med['fnrl']:7.1f} ms  "
              f"torch {1e3 * med['torch']:7.1f} ms  ratio {rounds[-1]['ratio']:.2f}  "
              f"(CPU time: fnrl {1e3 * cpu['fnrl']:.0f} ms, torch {1e3 * cpu['torch']:.0f} ms, "
              f"ratio {rounds[-1]['cpu_ratio']:.2f}; threads fnrl {got['fnrl']['threads']} "
              f"torch {got['torch']['threads']}; load {load_start} -> {_load()})", flush=True)
    tokens = p["batch"] * p["seq"]
    flops = model_flops_per_token(p) * tokens
    for side in ("fnrl", "torch"):
        per_round = [x["median_s"][side] for x in rounds]
        last = rounds[-1]["results"][side]
        sec = statistics.median(per_round)
        if side == "fnrl":
            print(f"fnrl's XLA_FLAGS: {last['xla_flags']!r}")
        line = (f"{side:6s} {last['device']:>10s}  median {1e3 * sec:8.1f} ms/step "
                f"(rounds {1e3 * min(per_round):.1f}–{1e3 * max(per_round):.1f})  "
                f"{tokens / sec:9.0f} tokens/s  peak RSS {last['peak_rss_mb']:6.0f} MB")
        if last["platform"] == "gpu":
            peak = next((v for k, v in PEAK_FLOPS.items() if k in last["device"]), None)
            mfu = flops / sec / peak if peak else float("nan")
            line += f"  peak device memory {last['peak_device_mb']:.0f} MB  MFU {100 * mfu:.1f}%"
        print(line)
    ratios = Spread.of([x["ratio"] for x in rounds])
    print(f"ratio fnrl/torch tokens per second: {ratios.line()}  (goal >= 1.0)")
    # CPU seconds count work, not waiting for a core, so other jobs move them less; with
    # more than one thread they also count a pool's spinning.
    print(f"ratio of CPU time per step, torch/fnrl: "
          f"{Spread.of([x['cpu_ratio'] for x in rounds]).line()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": p, "rounds": rounds}, f, indent=1)


def memory(args, p: dict) -> None:
    """Peak trainer memory per configuration, each in a fresh process (train_memory).

    The full shape runs only when its plan is under the limit; `--layers` / `--batch`
    measure a smaller shape of the same model instead, printed beside its own plan
    (how far to trust the full shape's plan) and the full shape's plan.
    """
    import dataclasses

    from fnrl.models.decoder import DecoderConfig
    from fnrl.models.synthetic import QWEN25_05B

    fields = {f.name for f in dataclasses.fields(DecoderConfig)}
    model_kw = {k: v for k, v in QWEN25_05B.items() if k in fields}
    full_L, full_B = model_kw["num_hidden_layers"], PRESETS["qwen0.5b"]["batch"]
    L, B, T = args.layers or full_L, p["batch"], p["seq"]
    small = (L, B) != (full_L, full_B)
    dtypes = [d for d in args.memory_dtypes.split(",") if d] or [p["dtype"]]
    print(f"memory: Qwen2.5-0.5B shape (vocab {model_kw['vocab_size']:,}, tied), activations "
          f"in {' / '.join(dtypes)} over f32 master weights and AdamW, {T:,} positions a row, "
          f"chunks of {train_memory.CHUNK_POSITIONS} positions; full shape {full_L} layers × "
          f"{full_B} rows" + (f"; measured at {L} layers × {B} rows" if small else ""))
    print(f"{'configuration':28s} {'dtype':>9s} {'full plan GB':>12s} {'plan GB':>8s} "
          f"{'peak GB':>8s}")
    for name, options in train_memory.MEMORY_CONFIGS.items():
        if args.only and args.only != name:
            continue
        for dtype in dtypes:
            full = train_memory.planned_peak_gb(model_kw, options, rows=full_B, length=T,
                                                dtype=dtype)
            plan = train_memory.planned_peak_gb({**model_kw, "num_hidden_layers": L}, options,
                                                rows=B, length=T, dtype=dtype)
            head = f"{name:28s} {dtype:>9s} {full:12.1f} {plan:8.1f}"
            if plan > args.memory_limit_gb:
                print(f"{head} {'not run':>8s}  (plan above the {args.memory_limit_gb:.0f} GB "
                      f"limit: the plan is the estimate)", flush=True)
                continue
            try:
                got = train_memory.measure(options, layers=L, rows=B, length=T, dtype=dtype)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                print(f"{head} {'failed':>8s}  {str(err)[-300:]}", flush=True)
                continue
            print(f"{head} {got['peak_bytes'] / 1e9:8.1f}  (process peak over one step, compile "
                  f"included; state {got['state_rss_bytes'] / 1e9:.1f} GB resident; step "
                  f"{got['step_s'][0]:.0f} s with compile)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="default: cpu, or qwen0.5b with --memory")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile)")
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--seq", type=int, default=0)
    parser.add_argument("--layers", type=int, default=0, help="override num_hidden_layers")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of one process per side, order alternating (ABBA)")
    parser.add_argument("--repeats", type=int, default=0, help=argparse.SUPPRESS)  # old name
    parser.add_argument("--seed", type=int, default=0, help="seed of the rounds' side order")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="CPUs and intra-op threads for both sides (default: all allowed)")
    parser.add_argument("--memory", action="store_true", help="the peak-memory column instead")
    parser.add_argument("--memory-dtypes", default="float32,bfloat16",
                        help="--memory: compute dtypes to measure, comma-separated")
    parser.add_argument("--memory-limit-gb", type=float, default=20.0,
                        help="--memory runs only configurations estimated below this")
    parser.add_argument("--only", default="", help="--memory: only the configuration of this name")
    parser.add_argument("--json", default="", help="write every round's raw timings here")
    parser.add_argument("--side", choices=("fnrl", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--paced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.preset = args.preset or ("qwen0.5b" if args.memory else "cpu")
    if args.repeats:
        args.rounds = args.repeats
    p = _preset(args)
    if args.side:  # child process: one side, one JSON line
        set_cpu_threads(args.threads)  # before JAX or torch starts its thread pools
        if args.side == "fnrl":
            _trainer_xla_flags()
        fn = run_fnrl if args.side == "fnrl" else run_torch
        print(json.dumps(fn(p, args.steps, args.warmup, args.paced)))
        return

    print(f"preset={args.preset} batch={p['batch']} seq={p['seq']} dtype={p['dtype']} "
          f"layers={p['num_hidden_layers']} hidden={p['hidden_size']} vocab={p['vocab_size']} "
          f"threads={args.threads} (of {os.cpu_count()} CPUs) "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(environment(), flush=True)
    (memory if args.memory else speed)(args, p)
    print(f"load average at end: {_load()}")


if __name__ == "__main__":
    main()
