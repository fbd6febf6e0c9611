"""Two ways for a rollout to serve a LoRA version, side by side on one vLLM server.

    python -m lab.benchmarks.lora_serving [--hidden 512 --layers 4] [--rank 8] [--rounds 3]

  merge   what fnrl does: the trainer publishes the adapters through a relay, the
          worker merges them into the base it started from and reloads the merged
          projections in place (fnrl.serving.worker_ext); requests name the base model.
  vllm    vLLM's dynamic LoRA: each version written as a PEFT directory and loaded with
          POST /v1/load_lora_adapter (`--enable-lora`,
          VLLM_ALLOW_RUNTIME_LORA_UPDATING); requests name the adapter, and the engine
          applies it beside the base weights at every decode step.

Per round, on one server started with `--enable-lora` (so both run on the same engine
and cores): the time to make a new version servable (merge: publish + pull + prefix-cache
reset, the worker's own load printed apart; vllm: the adapter directory written + the
load call), then decode throughput of 32 requests × 64 tokens through each (the order
alternates between rounds). A random Qwen2-shaped checkpoint and adapters with random A
and B: throughput does not depend on the values. Prints medians over rounds and the
ratio vllm / merge of each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from safetensors.numpy import save_file

from fnrl.config import LoraConfig
from fnrl.models.hf_io import read_config
from fnrl.models.lora import init_adapters, peft_config, peft_tensors
from fnrl.models.synthetic import build_bpe_tokenizer, write_checkpoint
from fnrl.relay.client import RelayClient
from fnrl.relay.launch import launch_relay, stop_relay, wait_relay_ready
from fnrl.serving.client import RolloutClient
from fnrl.serving.server import ServerSpec, launch_server, stop_server, wait_ready
from fnrl.shell.net import free_port


def trained_adapters(cfg, lora: LoraConfig, seed: int) -> dict:
    """Adapters with A and B both random (a trained adapter: B is not zero)."""
    rng = np.random.default_rng(seed)

    def fill(tree):
        return {k: fill(v) if isinstance(v, dict) else
                (rng.normal(0, 0.02, v.shape).astype(np.float32) if k.endswith("_lora_b") else v)
                for k, v in tree.items()}
    return fill(init_adapters(cfg, lora, seed))


async def decode(session: aiohttp.ClientSession, base_url: str, model: str, seed: int,
                 vocab: int, requests: int = 32, tokens: int = 64) -> float:
    """Tokens per second of `requests` concurrent completions of `tokens` tokens."""
    rng = np.random.default_rng(seed)

    async def one(i: int) -> int:
        body = {"model": model, "prompt": [int(t) for t in rng.integers(10, vocab - 10, 16)],
                "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True,
                "seed": seed * 1000 + i}
        async with session.post(f"{base_url}/v1/completions", json=body) as resp:
            reply = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{model}: HTTP {resp.status}: {reply}")
            return reply["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    done = sum(await asyncio.gather(*(one(i) for i in range(requests))))
    return done / (time.perf_counter() - t0)


async def bench(args, model_dir: Path, work: Path, base_url: str, relay: str) -> dict:
    cfg = read_config(model_dir)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    figures: dict[str, list[float]] = {k: [] for k in (
        "merge_version_s", "merge_worker_load_s", "vllm_version_s", "merge_tok_s", "vllm_tok_s")}
    async with aiohttp.ClientSession() as session:
        client = RolloutClient(base_url, session)
        base_name = (await client._get_json("/v1/models"))["data"][0]["id"]
        for version in range(1, args.rounds + 2):   # the first round warms up, not counted
            adapters = trained_adapters(cfg, lora, seed=version)
            # merge: publish through the relay, pull, reset the prefix cache.
            t0 = time.perf_counter()
            with RelayClient(relay, timeout_s=30) as rc:
                rc.publish(version, peft_tensors(cfg, lora, adapters))
            assert await client.pull(relay) == version
            merge_s = time.perf_counter() - t0
            load_s = float((await client._post("/collective_rpc", {
                "method": "fnrl_reload_seconds"}, 30))["results"][0])
            # vllm: a PEFT directory per version, loaded under a new name.
            t0 = time.perf_counter()
            adapter_dir = work / f"adapter-v{version}"
            adapter_dir.mkdir()
            save_file(peft_tensors(cfg, lora, adapters, scaling=False),
                      str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
            (adapter_dir / "adapter_config.json").write_text(
                json.dumps(peft_config(lora, str(model_dir))))
            async with session.post(f"{base_url}/v1/load_lora_adapter", json={
                    "lora_name": f"v{version}", "lora_path": str(adapter_dir)}) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"load_lora_adapter: HTTP {resp.status}: {await resp.text()}")
            vllm_s = time.perf_counter() - t0
            arms = [("merge", base_name), ("vllm", f"v{version}")]
            throughput = {}
            for arm, name in (arms if version % 2 else arms[::-1]):
                throughput[arm] = await decode(session, base_url, name, version, cfg.vocab_size)
            if version > 1 and version - 1 > 0:
                async with session.post(f"{base_url}/v1/unload_lora_adapter",
                                        json={"lora_name": f"v{version - 1}"}):
                    pass
            if version == 1:
                continue
            for key, value in (("merge_version_s", merge_s), ("merge_worker_load_s", load_s),
                               ("vllm_version_s", vllm_s), ("merge_tok_s", throughput["merge"]),
                               ("vllm_tok_s", throughput["vllm"])):
                figures[key].append(value)
            print(f"round {version - 1}: merge {merge_s * 1e3:.1f} ms (worker {load_s * 1e3:.1f}),"
                  f" {throughput['merge']:.0f} tok/s | vllm {vllm_s * 1e3:.1f} ms, "
                  f"{throughput['vllm']:.0f} tok/s", flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8, help="one of vLLM's 1, 8, 16, 32, ...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fnrl-lora-serving-") as tmp:
        work = Path(tmp)
        tok = build_bpe_tokenizer(work / "tok")
        model_dir = write_checkpoint(work / "model", "qwen2", seed=0, tokenizer_dir=tok,
                                     hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                     num_hidden_layers=args.layers,
                                     num_attention_heads=args.hidden // 64,
                                     num_key_value_heads=max(1, args.hidden // 256))
        relay_name, relay = f"b{uuid.uuid4().hex[:10]}", f"tcp://127.0.0.1:{free_port()}"
        relay_proc = launch_relay(relay, relay_name, work / "relay.log")
        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"   # the server inherits it
        spec = ServerSpec(model_dir=str(model_dir), port=free_port(), max_model_len=256,
                          max_num_seqs=32, cpu_threads=args.cpu_threads,
                          extra_args=("--enable-lora", "--max-lora-rank", str(args.rank),
                                      "--max-loras", "2"))
        server = launch_server(spec, work / "vllm.log")
        try:
            wait_relay_ready(relay, relay_proc)
            wait_ready(spec.base_url, server, timeout_s=600)
            figures = asyncio.run(bench(args, model_dir, work, spec.base_url, relay))
        finally:
            stop_server(server)
            stop_relay(relay_proc, relay_name)
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"\nmedians over {args.rounds} rounds (hidden {args.hidden}, {args.layers} layers, "
          f"rank {args.rank}, {args.cpu_threads} thread(s)):")
    print(f"  new version servable: merge {med['merge_version_s'] * 1e3:.1f} ms (worker load "
          f"{med['merge_worker_load_s'] * 1e3:.1f}), vllm {med['vllm_version_s'] * 1e3:.1f} ms;"
          f" vllm / merge {med['vllm_version_s'] / med['merge_version_s']:.2f}")
    print(f"  decode: merge {med['merge_tok_s']:.0f} tok/s, vllm {med['vllm_tok_s']:.0f} tok/s;"
          f" vllm / merge {med['vllm_tok_s'] / med['merge_tok_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
