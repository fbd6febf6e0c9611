"""fnrl's jitted train step against a PyTorch reference step, side by side in one run.

    python benchmarks/train_step.py                    # CPU-sized Qwen2
    python benchmarks/train_step.py --preset 1b        # ~1B Qwen2 in bf16 (GPU), with MFU

Both sides run the same model config, batch and loss (PPO clip on per-token
log-probs, token mean), global-norm clipping and AdamW. The reference is
transformers' Qwen2ForCausalLM forward and backward with torch.optim.AdamW.
Each side runs in its own fresh process, one after the other, so peak memory is
its own and neither competes for cores. The script prints trained tokens per
second, peak memory and the fnrl/torch throughput ratio (goal ≥ 1.0 on CPU). On a
GPU it also prints model FLOPs utilisation (goal ≥ 45% on H100 for the 1B preset).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

PRESETS = {
    # Small enough for a 2-core CPU; big enough that matmuls, not dispatch, dominate.
    "cpu": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, batch=8, seq=128, dtype="float32"),
    # Qwen2.5-1.5B's shape with fewer layers: ~1.0B parameters.
    "1b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=20,
               num_attention_heads=12, num_key_value_heads=2, batch=8, seq=2048, dtype="bfloat16"),
}
# Dense bf16 peak of one GPU, for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


def run_fnrl(p: dict, steps: int, warmup: int) -> dict:
    import jax
    import jax.numpy as jnp

    from fnrl.config import AlgoConfig
    from fnrl.models.decoder import DecoderConfig, init_model
    from fnrl.trainer.step import compile_train_step, init_state, make_optimizer

    base_mb = _rss_mb()
    cfg = DecoderConfig(**{k: v for k, v in p.items() if k not in ("batch", "seq", "dtype")})
    dtype = jnp.bfloat16 if p["dtype"] == "bfloat16" else jnp.float32
    graphdef, params = init_model(cfg, seed=0, dtype=dtype)  # f32 master weights
    algo = AlgoConfig(learning_rate=1e-5)
    optimizer = make_optimizer(algo)
    state = jax.jit(lambda q: init_state(q, optimizer))(params)
    del params
    step = compile_train_step(graphdef, optimizer, algo, None, None)
    batch = jax.device_put(_batch_numpy(p))
    for _ in range(warmup):
        state, metrics = step(state, batch, None)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch, None)
    jax.block_until_ready((state, metrics))
    elapsed = time.perf_counter() - t0
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {"seconds_per_step": elapsed / steps, "loss": float(metrics["loss"]),
            "device": device.device_kind, "platform": device.platform,
            "peak_device_mb": stats.get("peak_bytes_in_use", 0) / 2**20,
            "peak_rss_mb": _peak_rss_mb(), "rss_growth_mb": _peak_rss_mb() - base_mb}


def run_torch(p: dict, steps: int, warmup: int) -> dict:
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base_mb = _rss_mb()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = Qwen2Config(**{k: v for k, v in p.items() if k not in ("batch", "seq", "dtype")},
                      max_position_embeddings=max(p["seq"], 512), tie_word_embeddings=False,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dev).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0)
    b = {k: torch.from_numpy(np.asarray(v)).to(dev) for k, v in _batch_numpy(p).items()}
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=p["dtype"] == "bfloat16")

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
        return loss

    for _ in range(warmup):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"seconds_per_step": elapsed / steps, "loss": float(loss),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "platform": "gpu" if cuda else "cpu",
            "peak_device_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0,
            "peak_rss_mb": _peak_rss_mb(), "rss_growth_mb": _peak_rss_mb() - base_mb,
            "threads": torch.get_num_threads()}


def _child(side: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--preset", args.preset,
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    if args.seq:
        cmd += ["--seq", str(args.seq)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _preset(args) -> dict:
    p = dict(PRESETS[args.preset])
    if args.batch:
        p["batch"] = args.batch
    if args.seq:
        p["seq"] = args.seq
    return p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--seq", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per side")
    parser.add_argument("--side", choices=("fnrl", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    p = _preset(args)
    if args.side:  # child process: one side, one JSON line
        fn = run_fnrl if args.side == "fnrl" else run_torch
        print(json.dumps(fn(p, args.steps, args.warmup)))
        return

    # Alternate sides and keep each one's best, so a burst of load from other jobs on
    # a shared machine penalises neither side systematically.
    results = {"fnrl": [], "torch": []}
    for _ in range(args.repeats):
        for side in ("fnrl", "torch"):
            results[side].append(_child(side, args))
    tokens = p["batch"] * p["seq"]
    flops = model_flops_per_token(p) * tokens
    best = {s: min(r, key=lambda x: x["seconds_per_step"]) for s, r in results.items()}
    print(f"preset={args.preset} batch={p['batch']} seq={p['seq']} dtype={p['dtype']} "
          f"layers={p['num_hidden_layers']} hidden={p['hidden_size']} vocab={p['vocab_size']}")
    for side, r in best.items():
        tps = tokens / r["seconds_per_step"]
        line = (f"{side:6s} {r['device']:>24s}  {tps:10.0f} tokens/s  "
                f"{1e3 * r['seconds_per_step']:8.1f} ms/step  peak RSS {r['peak_rss_mb']:7.0f} MB "
                f"(+{r['rss_growth_mb']:.0f} MB for the run)")
        if r["platform"] == "gpu":
            peak = next((v for k, v in PEAK_FLOPS.items() if k in r["device"]), None)
            mfu = flops / r["seconds_per_step"] / peak if peak else float("nan")
            line += f"  peak device memory {r['peak_device_mb']:.0f} MB  MFU {100 * mfu:.1f}%"
        print(line)
    ratio = best["torch"]["seconds_per_step"] / best["fnrl"]["seconds_per_step"]
    print(f"ratio fnrl/torch tokens per second: {ratio:.2f}  (goal >= 1.0)")


if __name__ == "__main__":
    main()
