"""Generation settings: the model's generation_config.json gives temperature, top_p and
top_k unless a flag sets them; every request carries them; the server returns the
log-probs of the distribution it sampled from."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from fnrl.config import AlgoConfig
from fnrl.config.algo import sampling_defaults
from fnrl.experiments.math_grpo import parse_config
from fnrl.serving.client import RolloutClient, ServerError
from fnrl.serving.server import ServerSpec, server_command

from tests.serving.fake_http import serving

QWEN_INSTRUCT = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True,
                 "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_a_models_sampling_values_become_config_fields_and_nothing_else():
    assert sampling_defaults(QWEN_INSTRUCT) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert sampling_defaults({"top_k": 0}) == {"top_k": -1}          # HF's "off"
    assert sampling_defaults({"eos_token_id": 2}) == {}


@pytest.mark.parametrize("field, value", [("top_p", 0.0), ("top_p", 1.5), ("top_k", 0),
                                          ("temperature", 0.0)])
def test_invalid_sampling_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"AlgoConfig.{field}={value}"):
        AlgoConfig(**{field: value})


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_INSTRUCT))
    return str(tmp_path)


def test_the_models_values_apply_unless_a_flag_sets_them(model_dir):
    algo = parse_config(["--model.model-dir", model_dir]).algo
    assert (algo.temperature, algo.top_p, algo.top_k) == (0.7, 0.8, 20)
    algo = parse_config(["--model.model-dir", model_dir, "--algo.temperature", "1.0",
                         "--algo.top-k", "-1", "--algo.max-new-tokens", "4096"]).algo
    assert (algo.temperature, algo.top_p, algo.top_k) == (1.0, 0.8, -1)
    assert algo.max_new_tokens == 4096
    algo = parse_config([]).algo          # the embedded model sets none
    assert (algo.temperature, algo.top_p, algo.top_k) == (1.0, 1.0, -1)


def test_the_server_keeps_its_own_sampling_defaults_and_returns_sampled_logprobs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 2, "hidden_size": 64, "num_hidden_layers": 2}))
    argv = server_command(ServerSpec(model_dir=str(tmp_path), port=1, max_model_len=64,
                                     max_num_seqs=2))
    assert argv[argv.index("--generation-config") + 1] == "vllm"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"


class FakeServer:
    """/v1/completions that records request bodies and streams `chunks` with `gap_s`
    between them."""

    def __init__(self, chunks: int, gap_s: float):
        self.bodies: list[dict] = []
        self.chunks, self.gap_s = chunks, gap_s

    async def models(self, request):
        return web.json_response({"data": [{"id": "m"}]})

    async def completions(self, request):
        self.bodies.append(await request.json())
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(self.chunks):
            await asyncio.sleep(self.gap_s)
            last = i == self.chunks - 1
            choice = {"index": 0, "token_ids": [5], "finish_reason": "length" if last else None,
                      "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.5]}}
            await response.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


async def _stream(fake: FakeServer, *, timeout_s: float, **sampling) -> list:
    async with serving(web.get("/v1/models", fake.models),
                       web.post("/v1/completions", fake.completions)) as url:
        async with aiohttp.ClientSession() as session:
            client = RolloutClient(url, session, timeout_s=timeout_s)
            return [c async for c in client.generate_stream(
                [1, 2], max_tokens=fake.chunks, temperature=0.7, seed=None, **sampling)]


def test_each_request_carries_the_sampling_settings():
    fake = FakeServer(chunks=2, gap_s=0.0)
    asyncio.run(_stream(fake, timeout_s=5, top_p=0.8, top_k=20))
    (body,) = fake.bodies
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.8, 20)
    assert (body["min_p"], body["repetition_penalty"]) == (0.0, 1.0)   # nothing else changes μ


def test_a_stream_longer_than_its_timeout_is_not_cut_while_tokens_keep_coming():
    # 12 chunks 0.1 s apart: 1.2 s in all, each within the 0.5 s timeout.
    chunks = asyncio.run(_stream(FakeServer(chunks=12, gap_s=0.1), timeout_s=0.5))
    assert len(chunks) == 12 and chunks[-1].finish_reason == "length"
    with pytest.raises(ServerError, match="no answer for 0.5 s"):
        asyncio.run(_stream(FakeServer(chunks=2, gap_s=1.0), timeout_s=0.5))
