"""fnrl's jitted train step against a PyTorch reference step, side by side.

    python -m lab.benchmarks.train_step --rounds 5 --steps 8          # CPU-sized Qwen2, speed
    python -m lab.benchmarks.train_step --rounds 5 --threads 1        # one intra-op thread each
    python -m lab.benchmarks.train_step --preset qwen1.5b --rounds 1  # on a GPU: in turns, MFU
    python -m lab.benchmarks.train_step --preset qwen3b --torch-compile --json out.json
    flock /tmp/fnrl-heavy.lock python -m lab.benchmarks.train_step --memory [--layers 2 --batch 2]

Both sides run the same model config, batch and loss (PPO clip on per-token
log-probs, token mean), global-norm clipping and AdamW. The reference is
transformers' Qwen2ForCausalLM forward and backward with torch.optim.AdamW, float32
weights under bfloat16 autocast where fnrl computes in bfloat16, SDPA attention: the
eager step people run (`--torch-compile` adds a torch.compile'd model as a third side,
never the default reference). fnrl runs as the trainer does: every "auto" of its
TrainerConfig resolved by fnrl.trainer.platform for the device it finds (on a GPU
bfloat16 compute over float32 master weights, cuDNN attention, remat planned against the
card's bytes_limit), the resolved kernels printed. What each side's process runs is in
lab/benchmarks/train_step_sides.py; this file is the presets, schedules and table.

Presets: `cpu` (a 2-core machine), the real Qwen2.5-0.5B (8 × 1,024), -1.5B and -3B
(8 × 2,048) configs, Qwen2.5-7B's widths with 8 of its 28 layers (`qwen7b-8l`), and `1b`
(1.5B's widths × 20 untied layers, the shape of the first GPU figures).

Schedules (`--schedule`, auto: turns on a GPU, paced on CPU):
  paced  A round starts one process per side, lets each compile and warm up in turn,
         then has them take turns one step at a time in the order fnrl, torch, torch,
         fnrl, ... (ABBA), while the other waits idle: a burst of load from other jobs on
         a shared machine lands on both sides' steps of the same seconds instead of on
         one side's whole run. Both processes live at once, so this is for CPUs only.
  turns  A round runs each side's process to its end, one after the other: each has the
         card to itself (JAX preallocates 75 % of a card by default, so a PyTorch
         process beside it runs out of memory). The fnrl process gets
         XLA_PYTHON_CLIENT_MEM_FRACTION=`--mem-fraction` of the card. A side that runs
         out of memory is recorded as such and the other still runs; a torch side out of
         memory is run again with gradient checkpointing (`--torch-remat auto`).
The first side alternates within each pair of rounds, the pairs in seeded random order
(lab/benchmarks/rounds.py, `--seed`). A round's ratio is torch's median step over fnrl's (the
fnrl/torch throughput ratio); the result is the median of the rounds' ratios with their
min–max spread, beside (paced) the same ratio of CPU seconds per step (all threads), which
counts work rather than waiting for a core. Both sides get the same CPUs and thread count
(`--threads`; see fnrl.trainer.xla_flags), printed with the environment.

MFU counts model FLOPs the PaLM / Megatron way: per token 6 × (matmul parameters: the
q, k, v, o, gate, up, down and vocabulary projections; the embedding lookup is a gather)
+ 12 × layers × sequence length × heads × head dim for attention's two matmuls in the
forward and backward pass, counted as if not causal (the convention MFU figures are
usually quoted in; the JSON also has `mfu_causal`, attention halved). Peak: dense
bfloat16 of the card (H100 SXM and H200 989 TFLOP/s).

Memory. On a GPU each side reports its peak device memory (fnrl: peak_bytes_in_use of
`device.memory_stats()`; torch: `torch.cuda.max_memory_allocated`), and fnrl's beside
its plans: XLA's own, from the compiled step's `memory_analysis()` (arguments + outputs
− donated aliases + temporaries), and fnrl.trainer.memory's. `--memory` instead reports
the peak trainer (host) memory of one step of the Qwen2.5-0.5B-shaped model at 8 × 1,024
tokens: plain, chunked log-probs, chunked log-probs + remat, for each of `--memory-dtypes`,
each measured in a fresh process by fnrl.trainer.peak beside the trainer's memory plan;
a configuration whose plan is above `--memory-limit-gb` is not run (the plan stands as
its estimate); `--layers` / `--batch` measure a smaller shape beside its own plan instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from fnrl.trainer.xla_flags import set_cpu_threads
from lab.benchmarks import train_memory
from lab.benchmarks.rounds import Spread, environment, round_orders
from lab.benchmarks.rounds import load as _load
from lab.benchmarks.train_step_sides import NOT_MODEL as _NOT_MODEL
from lab.benchmarks.train_step_sides import run_fnrl, run_torch, trainer_xla_flags

ROOT = Path(__file__).resolve().parents[2]   # the repository: lab/ is imported from it

_QWEN25 = dict(vocab_size=151936, num_key_value_heads=2, tie_word_embeddings=True,
               dtype="auto")
PRESETS = {
    # Small enough for a 2-core CPU; big enough that matmuls, not dispatch, dominate.
    "cpu": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, batch=8, seq=128, dtype="float32",
                tie_word_embeddings=False),
    # Qwen2.5-1.5B's widths with 20 untied layers (~1.4B parameters): the first GPU figures.
    "1b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=20,
               num_attention_heads=12, num_key_value_heads=2, batch=8, seq=2048, dtype="auto",
               tie_word_embeddings=False),
    # The real Qwen2.5 configs (HF config.json), 494M, 1.54B and 3.09B parameters.
    "qwen0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, batch=8, seq=1024),
    "qwen1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                     num_attention_heads=12, batch=8, seq=2048),
    "qwen3b": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                   num_attention_heads=16, batch=8, seq=2048),
    # Qwen2.5-7B's widths and untied vocabulary with 8 of its 28 layers (~3.0B parameters).
    "qwen7b-8l": dict(_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                      num_hidden_layers=8, num_attention_heads=28, num_key_value_heads=4,
                      tie_word_embeddings=False, batch=8, seq=2048),
}
# Dense bfloat16 peak of one card, for MFU; the first name in the device's name wins.
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
SIDES = ("fnrl", "torch")
TORCH_COMPILE = "torch-compile"


def matmul_params(p: dict) -> int:
    """Parameters that multiply activations: q, k, v, o, gate, up, down per layer and the
    vocabulary projection (tied or not: the embedding lookup itself is a gather)."""
    E, I, L, V = p["hidden_size"], p["intermediate_size"], p["num_hidden_layers"], p["vocab_size"]
    H = p["num_attention_heads"]
    D = p.get("head_dim") or E // H
    per_layer = 2 * E * H * D + 2 * E * p["num_key_value_heads"] * D + 3 * E * I
    return L * per_layer + E * V


def model_flops_per_token(p: dict, *, causal: bool = False) -> float:
    """Training FLOPs per token: 6 × matmul params + attention's QKᵀ and AV, forward and
    backward, 12 × layers × seq × heads × head dim (PaLM's count, the whole T × T square);
    `causal`: half of it, the lower triangle a causal kernel computes."""
    H = p["num_attention_heads"]
    D = p.get("head_dim") or p["hidden_size"] // H
    attention = 12 * p["num_hidden_layers"] * p["seq"] * H * D
    return 6 * matmul_params(p) + (attention / 2 if causal else attention)


def peak_flops(device: str) -> float | None:
    """The card's dense bfloat16 FLOP/s from its name, None if not known."""
    return next((v for k, v in PEAK_FLOPS if k in device), None)


def _child_cmd(side: str, args, torch_remat: str = "none") -> list[str]:
    cmd = [sys.executable, "-m", "lab.benchmarks.train_step", "--side", side, "--preset", args.preset,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--remat", args.remat, "--attention", args.attention, "--torch-remat", torch_remat]
    for flag, value in (("--batch", args.batch), ("--seq", args.seq), ("--layers", args.layers),
                        ("--dtype", args.dtype)):
        if value:
            cmd += [flag, str(value)]
    return cmd


class _PacedSide:
    """A side's process that runs one step each time it is told to (see `speed`)."""

    def __init__(self, side: str, args):
        self.side = side
        self.proc = subprocess.Popen(_child_cmd(side, args) + ["--paced"], cwd=ROOT, stdin=subprocess.PIPE,
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


def failure_kind(stderr: str) -> str:
    """"oom" when a process died of device (or host) memory, else "error"."""
    text = stderr.lower()
    oom = ("resource_exhausted", "out of memory", "outofmemoryerror", "cuda_error_out_of_memory")
    return "oom" if any(s in text for s in oom) else "error"


def _run_alone(side: str, args, torch_remat: str) -> dict:
    """One side's process run to its end with the device to itself: its result, or
    {"error": the tail of its stderr, "kind": "oom" | "timeout" | "error"}."""
    env = dict(os.environ)
    if side == "fnrl" and args.mem_fraction and args.platform == "gpu":
        # The old spelling is the one jaxlib reads; both set is reported to fail.
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
        env.pop("XLA_CLIENT_MEM_FRACTION", None)
    try:
        done = subprocess.run(_child_cmd(side, args, torch_remat), cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=args.child_timeout)
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"error": f"no result in {args.child_timeout:.0f} s\n{tail}", "kind": "timeout"}
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"exited with {done.returncode}: {done.stderr[-2500:]}",
                "kind": failure_kind(done.stderr)}
    return json.loads(lines[-1])


def _turns_round(order: tuple, args) -> dict:
    """Each side alone on the device, one after the other; a torch side out of memory is
    run again with gradient checkpointing under `--torch-remat auto`."""
    got = {}
    for name in order:
        remat = "none" if args.torch_remat == "auto" else args.torch_remat
        got[name] = _run_alone(name, args, remat)
        if (name != "fnrl" and args.torch_remat == "auto" and
                got[name].get("kind") == "oom"):
            print(f"  {name} ran out of memory: again with gradient checkpointing", flush=True)
            got[name] = {**_run_alone(name, args, "full"), "without_remat": "oom"}
        print(f"  {name}: " + (f"failed ({got[name]['kind']})" if "error" in got[name] else
                               f"{1e3 * statistics.median(got[name]['step_s']):.1f} ms/step"),
              flush=True)
    return got


def _paced_round(order: tuple, args) -> dict:
    """Both sides set up (compiled, warmed up) one at a time, then one step each in turn:
    fnrl, torch, torch, fnrl, ... (the order reversed every other step)."""
    sides = {}
    for name in order:  # one at a time: each compiles while the other waits
        sides[name] = _PacedSide(name, args)
        sides[name].ready()
    for i in range(args.steps):
        for name in order if i % 2 == 0 else order[::-1]:
            sides[name].step()
    return {name: side.result() for name, side in sides.items()}


def round_record(order: tuple, got: dict) -> dict:
    """A round's results with each finished side's median step and CPU time, and the
    fnrl/side throughput ratio of every side beside fnrl (None where either failed)."""
    ok = {s: r for s, r in got.items() if "error" not in r and r.get("step_s")}
    med = {s: statistics.median(r["step_s"]) for s, r in ok.items()}
    cpu = {s: statistics.median(r["cpu_s"]) for s, r in ok.items()}
    ratios = {s: med[s] / med["fnrl"] if s in med and "fnrl" in med else None
              for s in got if s != "fnrl"}
    cpu_ratio = (cpu["torch"] / cpu["fnrl"] if "torch" in cpu and "fnrl" in cpu and cpu["fnrl"]
                 else None)
    return {"first": order[0], "results": got, "median_s": med, "cpu_s": cpu,
            "ratio": ratios.get("torch"), "ratios": ratios, "cpu_ratio": cpu_ratio}


def summarize(rounds: list[dict], p: dict) -> dict:
    """Per side: median ms/step over rounds, tokens/s, MFU (on a card whose peak is known),
    peak device memory; fnrl's memory plans beside its peak; the ratios' spreads."""
    tokens = p["batch"] * p["seq"]
    flops = model_flops_per_token(p) * tokens
    flops_causal = model_flops_per_token(p, causal=True) * tokens
    sides: dict[str, dict] = {}
    for side in rounds[0]["results"]:
        per_round = [r["median_s"][side] for r in rounds if side in r["median_s"]]
        runs = [r["results"][side] for r in rounds]
        if not per_round:
            failed = runs[-1]
            sides[side] = {"error": failed.get("error", ""), "kind": failed.get("kind", "error")}
            continue
        last = next(x for x in reversed(runs) if "error" not in x)
        sec = statistics.median(per_round)
        peak = peak_flops(last["device"]) if last["platform"] == "gpu" else None
        peaks_mb = [x["peak_device_mb"] for x in runs if x.get("peak_device_mb")]
        row = {"ms_per_step": 1e3 * sec, "ms_low": 1e3 * min(per_round),
               "ms_high": 1e3 * max(per_round), "tokens_per_s": tokens / sec,
               "mfu": flops / sec / peak if peak else None,
               "mfu_causal": flops_causal / sec / peak if peak else None,
               "peak_device_gb": max(peaks_mb) * 2**20 / 1e9 if peaks_mb else None,
               "peak_rss_gb": max(x["peak_rss_mb"] for x in runs if "error" not in x) * 2**20 / 1e9,
               "device": last["device"], "platform": last["platform"],
               "kernels": last.get("kernels", ""), "first_call_s": last["first_call_s"],
               "rounds_failed": len(runs) - len(per_round)}
        if side == "fnrl":
            plan = last.get("xla_plan")
            row.update(compile_s=last.get("compile_s"), trainer=last.get("trainer"),
                       xla_plan_gb=plan["peak"] / 1e9 if plan else None, xla_plan=plan,
                       fnrl_plan_gb=last["fnrl_plan_step_peak"] / 1e9,
                       device_limit_gb=(last["device_limit_mb"] * 2**20 / 1e9
                                        if last.get("device_limit_mb") else None))
        else:
            row.update(torch_remat=last.get("torch_remat"))
        sides[side] = row
    ratios = {}
    for side in sides:
        values = [r["ratios"][side] for r in rounds if r["ratios"].get(side)]
        if side != "fnrl" and values:
            ratios[side] = Spread.of(values)
    return {"tokens_per_step": tokens, "flops_per_token": model_flops_per_token(p),
            "flops_per_token_causal": model_flops_per_token(p, causal=True),
            "sides": sides, "ratios": {s: vars(v) for s, v in ratios.items()},
            "ratio_lines": {s: v.line() for s, v in ratios.items()}}


def _gb(x) -> str:
    return "–" if x is None else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def table_lines(summary: dict) -> list[str]:
    """The final table: per side ms/step, tokens/s, MFU, peak GB; the ratios; fnrl's
    memory plans beside its measured peak."""
    lines = [f"{'side':14s} {'ms/step':>9s} {'tokens/s':>10s} {'MFU':>6s} {'peak GB':>8s}  "
             f"device / kernels"]
    for side, row in summary["sides"].items():
        if "error" in row:
            first = row["error"].strip().splitlines()
            lines.append(f"{side:14s} {'failed: ' + row['kind']:>36s}  "
                         f"{first[-1][:150] if first else ''}")
            continue
        mfu = f"{100 * row['mfu']:5.1f}%" if row["mfu"] is not None else "–"
        peak = row["peak_device_gb"] if row["peak_device_gb"] is not None else row["peak_rss_gb"]
        where = "" if row["peak_device_gb"] is not None else " (host RSS)"
        lines.append(f"{side:14s} {row['ms_per_step']:9.1f} {row['tokens_per_s']:10,.0f} "
                     f"{mfu:>6s} {_gb(peak):>8s}  {row['device']}: {row['kernels']}{where}")
    for side, line in summary["ratio_lines"].items():
        lines.append(f"ratio fnrl/{side} tokens per second: {line}")
    fnrl = summary["sides"].get("fnrl", {})
    if "error" not in fnrl and fnrl:
        plan = fnrl.get("xla_plan")
        measured = fnrl["peak_device_gb"]
        text = (f"fnrl memory: XLA plan {_gb(fnrl['xla_plan_gb'])} GB" +
                (f" (arguments {plan['argument'] / 1e9:.2f} + outputs {plan['output'] / 1e9:.2f}"
                 f" − aliased {plan['alias'] / 1e9:.2f} + temporaries {plan['temp'] / 1e9:.2f})"
                 if plan else "") +
                f", fnrl.trainer.memory plan {fnrl['fnrl_plan_gb']:.2f} GB")
        if measured is not None:
            ratio = f" ({measured / fnrl['xla_plan_gb']:.2f}× XLA's plan)" if fnrl["xla_plan_gb"] else ""
            text += f"; measured peak_bytes_in_use {measured:.1f} GB{ratio}"
            if fnrl.get("device_limit_gb"):
                text += f" of {fnrl['device_limit_gb']:.1f} GB the allocator may use"
        lines.append(text)
    return lines


def _preset(args) -> dict:
    p = dict(PRESETS[args.preset])
    overrides = (("batch", args.batch), ("seq", args.seq), ("num_hidden_layers", args.layers),
                 ("dtype", args.dtype))
    for key, value in overrides:
        if value:
            p[key] = value
    return p


def probe_platform() -> tuple[str, str]:
    """(platform, device name) of JAX's first device, asked of a child process with
    preallocation off, so this process never holds the card its children need."""
    code = "import jax; d = jax.devices()[0]; print(d.platform, d.device_kind, sep='|')"
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    platform, device = out.split("|", 1)
    return platform, device


def speed(args, p: dict) -> dict:
    """Rounds of one process per side, in turns (GPU) or paced ABBA (CPU); per-round
    ratios, their median and spread; the final table. Returns everything (`--json`)."""
    sides = SIDES + ((TORCH_COMPILE,) if args.torch_compile else ())
    rounds = []
    for r, order in enumerate(round_orders(sides, args.rounds, seed=args.seed)):
        load_start = _load()
        got = (_turns_round if args.schedule == "turns" else _paced_round)(order, args)
        rounds.append(round_record(order, got))
        med, rec = rounds[-1]["median_s"], rounds[-1]
        line = "  ".join(f"{s} {1e3 * med[s]:7.1f} ms" if s in med else f"{s} failed"
                         for s in sides)
        ratio = f"ratio {rec['ratio']:.2f}" if rec["ratio"] else "ratio –"
        extra = ""
        if args.schedule == "paced":
            cpu = rec["cpu_s"]
            extra = (f" (CPU time: fnrl {1e3 * cpu['fnrl']:.0f} ms, torch {1e3 * cpu['torch']:.0f}"
                     f" ms, ratio {rec['cpu_ratio']:.2f}; threads fnrl {got['fnrl']['threads']} "
                     f"torch {got['torch']['threads']})")
        print(f"round {r + 1}/{args.rounds} ({order[0]} first): {line}  {ratio}{extra}; "
              f"load {load_start} -> {_load()}", flush=True)
    summary = summarize(rounds, p)
    fnrl = rounds[-1]["results"]["fnrl"]
    if "error" not in fnrl:
        print(f"fnrl's XLA_FLAGS: {fnrl['xla_flags']!r}"
              + (f", XLA_PYTHON_CLIENT_MEM_FRACTION={fnrl['mem_fraction']}"
                 if fnrl.get("mem_fraction") else ""))
    print("\n".join(table_lines(summary)))
    if args.schedule == "paced":
        # CPU seconds count work, not waiting for a core, so other jobs move them less;
        # with more than one thread they also count a pool's spinning.
        print(f"ratio of CPU time per step, torch/fnrl: "
              f"{Spread.of([x['cpu_ratio'] for x in rounds]).line()}")
    return {"preset": args.preset, "config": p, "schedule": args.schedule,
            "platform": args.platform, "device": args.device,
            "peak_flops": peak_flops(args.device), "steps": args.steps, "warmup": args.warmup,
            "environment": environment(), "mfu_convention": (
                "6 x matmul params + 12 x layers x seq x heads x head_dim per token "
                "(attention counted non-causal, PaLM); mfu_causal halves attention"),
            "summary": summary, "rounds": rounds}
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
    parser.add_argument("--preset", choices=list(PRESETS), default=None,
                        help="default: cpu, or qwen0.5b with --memory")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile)")
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--seq", type=int, default=0)
    parser.add_argument("--layers", type=int, default=0, help="override num_hidden_layers")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="",
                        help="compute dtype of both sides (default: the preset's; auto: "
                             "bfloat16 on a GPU, float32 on CPU)")
    parser.add_argument("--remat", choices=("auto", "none", "dots", "full"), default="auto",
                        help="fnrl's TrainerConfig.remat")
    parser.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                        help="fnrl's TrainerConfig.attention")
    parser.add_argument("--torch-remat", choices=("auto", "none", "full"), default="auto",
                        help="torch's gradient checkpointing (auto: none, and full after an "
                             "out-of-memory in turns)")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also time a torch.compile'd model (a third side)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of one process per side, order alternating (ABBA)")
    parser.add_argument("--repeats", type=int, default=0, help=argparse.SUPPRESS)  # old name
    parser.add_argument("--seed", type=int, default=0, help="seed of the rounds' side order")
    parser.add_argument("--schedule", choices=("auto", "paced", "turns"), default="auto",
                        help="paced: steps interleaved ABBA (CPU); turns: each process alone "
                             "on the device (GPU); auto: by platform")
    parser.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                        help="the device the sides run on (auto: asked of JAX in a child)")
    parser.add_argument("--mem-fraction", type=float, default=0.9,
                        help="turns: XLA_PYTHON_CLIENT_MEM_FRACTION of the fnrl process "
                             "(0: JAX's default)")
    parser.add_argument("--child-timeout", type=float, default=1800,
                        help="turns: seconds a side's process may take")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="CPUs and intra-op threads for both sides (default: all allowed)")
    parser.add_argument("--memory", action="store_true", help="the peak-memory column instead")
    parser.add_argument("--memory-dtypes", default="float32,bfloat16",
                        help="--memory: compute dtypes to measure, comma-separated")
    parser.add_argument("--memory-limit-gb", type=float, default=20.0,
                        help="--memory runs only configurations estimated below this")
    parser.add_argument("--only", default="", help="--memory: only the configuration of this name")
    parser.add_argument("--json", default="", help="write the summary and every round's raw "
                                                   "timings here")
    parser.add_argument("--side", choices=(*SIDES, TORCH_COMPILE), help=argparse.SUPPRESS)
    parser.add_argument("--paced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.preset = args.preset or ("qwen0.5b" if args.memory else "cpu")
    if args.repeats:
        args.rounds = args.repeats
    p = _preset(args)
    if args.side:  # child process: one side, one JSON line
        set_cpu_threads(args.threads)  # before JAX or torch starts its thread pools
        if args.side == "fnrl":
            trainer_xla_flags()
            out = run_fnrl(p, args.steps, args.warmup, args.paced, remat=args.remat,
                           attention=args.attention)
        else:
            out = run_torch(p, args.steps, args.warmup, args.paced, remat=args.torch_remat,
                            compile_model=args.side == TORCH_COMPILE)
        print(json.dumps(out))
        return

    args.device = ""
    if not args.memory:
        if args.platform == "auto":
            args.platform, args.device = probe_platform()
        if args.schedule == "auto":
            args.schedule = "paced" if args.platform == "cpu" else "turns"
    print(f"preset={args.preset} batch={p['batch']} seq={p['seq']} dtype={p['dtype']} "
          f"layers={p['num_hidden_layers']} hidden={p['hidden_size']} vocab={p['vocab_size']} "
          f"threads={args.threads} (of {os.cpu_count()} CPUs) "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
          + ("" if args.memory else f" platform={args.platform} {args.device} "
                                    f"schedule={args.schedule}"))
    print(environment(), flush=True)
    if args.memory:
        memory(args, p)
    else:
        result = speed(args, p)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    print(f"load average at end: {_load()}")


if __name__ == "__main__":
    main()
