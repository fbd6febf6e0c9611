"""The trainer's log-probs match a real vLLM server's on the same weights (float32).

The step's own telemetry (`logp_abs_diff`) is checked too, on a batch built from
vLLM's completions exactly as the controller builds one.
"""

import asyncio

import aiohttp
import numpy as np
import pytest

from fnrl.config import AlgoConfig, TrainerConfig
from fnrl.models.hf_io import load_pretrained
from fnrl.serving.client import RolloutClient
from fnrl.serving.server import ServerSpec, serve, stop_server
from fnrl.shell.net import free_port
from fnrl.types import Segment, Trajectory
from fnrl.trainer.batching import build_batch
from fnrl.trainer.step import compile_train_step, init_state, make_optimizer, token_logprobs

pytestmark = pytest.mark.slow


def Sample(prompt_ids, response_ids, logprobs, versions, reward) -> Trajectory:
    """A version-0 trajectory: what build_batch and the loop consume."""
    return Trajectory(uid="t", prompt_ids=tuple(prompt_ids),
                      segments=(Segment(versions[0] if versions else 0, tuple(response_ids),
                                        tuple(logprobs)),), finish_reason="stop", reward=reward)


@pytest.fixture(scope="module", params=[(1.0, -1, 1.0), (0.7, 5, 0.9)],
                ids=["T1", "T0.7-topk5-topp0.9"])
def completions(peaked_model_dir, tmp_path_factory, request):
    """Samples at temperature 1, and at 0.7 with top-k 5 and top-p 0.9 together: vLLM
    returns the log-probs of the distribution it sampled from, which the trainer computes
    as softmax(logits / T) on the same support (before, the truncated run's ratio was the
    kept mass on every token)."""
    temperature, top_k, top_p = request.param
    spec = ServerSpec(model_dir=str(peaked_model_dir), port=free_port(), max_model_len=32,
                      max_num_seqs=16)
    spec, proc = serve(spec, tmp_path_factory.mktemp("vllm") / "vllm.log", timeout_s=300)
    prompts = [tuple(int(t) for t in np.random.default_rng(i).integers(3, 20, 6)) for i in range(4)]

    async def sample():
        async with aiohttp.ClientSession() as session:
            client = RolloutClient(spec.base_url, session)
            return await asyncio.gather(*[client.generate(p, n=4, max_tokens=12,
                                                          temperature=temperature, seed=i,
                                                          top_k=top_k, top_p=top_p)
                                          for i, p in enumerate(prompts)])
    try:
        return prompts, asyncio.run(sample()), request.param
    finally:
        stop_server(proc)


def test_trainer_logprobs_match_vllm_within_1e3(peaked_model_dir, completions):
    prompts, groups, (temperature, top_k, top_p) = completions
    _, graphdef, params = load_pretrained(peaked_model_dir)
    diffs, values = [], []
    for prompt, group in zip(prompts, groups):
        for c in group:
            tokens = np.array(prompt + c.token_ids, np.int32)[None]
            logp = np.asarray(token_logprobs(graphdef, params, tokens[:, :-1], tokens[:, 1:],
                                             temperature=temperature, top_k=top_k,
                                             top_p=top_p))[0]
            ours = logp[len(prompt) - 1:]
            diffs.extend(np.abs(ours - np.array(c.logprobs)))
            values.extend(c.logprobs)
    assert len(diffs) >= 16
    assert np.std(values) > 0.3, "near-uniform log-probs would make this test vacuous"
    print(f"mean |Δlogp| = {np.mean(diffs):.2e}, max = {np.max(diffs):.2e}, n = {len(diffs)}")
    assert np.mean(diffs) < 1e-3


def test_train_step_reports_the_mismatch(peaked_model_dir, completions):
    prompts, groups, (temperature, top_k, top_p) = completions
    samples = [[Sample(p, c.token_ids, c.logprobs, (0,) * len(c.token_ids), float(i % 2))
                for i, c in enumerate(group)] for p, group in zip(prompts, groups)]
    algo = AlgoConfig(group_size=4, groups_per_step=4, max_new_tokens=12, temperature=temperature,
                      top_k=top_k, top_p=top_p)
    batch, _ = build_batch(samples, algo=algo, trainer=TrainerConfig(), seq_len=24, pad_id=0)
    _, graphdef, params = load_pretrained(peaked_model_dir)
    opt = make_optimizer(algo)
    state = init_state(params, opt)
    step = compile_train_step(graphdef, opt, algo, None, None)
    _, metrics = step(state, batch, None)
    assert float(metrics["logp_abs_diff"]) < 1e-3
    assert 0.99 < float(metrics["mismatch/is_p01"]) <= float(metrics["mismatch/is_p99"]) < 1.01
    assert abs(float(metrics["mismatch/kl_k3"])) < 1e-5
