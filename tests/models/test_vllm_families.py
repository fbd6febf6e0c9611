"""vLLM serves fnrl's export of each family with fnrl's own greedy tokens and log-probs.

One real vLLM server per checkpoint (started as the job starts it), a chat-templated
prompt from the Qwen-style tokenizer, greedy decoding; fnrl's forward over prompt +
completion must pick the same tokens and give the same log-probs. Run under the heavy
lock: `flock /tmp/fnrl-heavy.lock .venv/bin/python -m pytest -q -m slow tests/models`.
"""

import asyncio

import aiohttp
import jax
import numpy as np
import pytest
import transformers

from fnrl.models.decoder import forward
from fnrl.models.hf_io import load_pretrained
from fnrl.models.synthetic import IM_END, build_bpe_tokenizer, write_checkpoint
from fnrl.serving.client import RolloutClient
from fnrl.serving.server import ServerSpec, serve, stop_server
from fnrl.shell.net import free_port

pytestmark = pytest.mark.slow

QUESTIONS = ("What is 48 + 24?", "Natalia has 12 clips and buys 7 more. How many?",
             "Compute 347 + 586 step by step.")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


def _serve_greedy(model_dir, prompts, log_path):
    spec = ServerSpec(model_dir=str(model_dir), port=free_port(), max_model_len=128,
                      max_num_seqs=4)

    async def sample():
        async with aiohttp.ClientSession() as session:
            client = RolloutClient(spec.base_url, session)
            return await asyncio.gather(*[
                client.generate(p, n=1, max_tokens=MAX_TOKENS, temperature=0.0, seed=0)
                for p in prompts])
    spec, proc = serve(spec, log_path, timeout_s=300)
    try:
        return [group[0] for group in asyncio.run(sample())]
    finally:
        stop_server(proc)


# bf16 on disk, served in float32: the file vLLM reads is fnrl's bf16 export, and both
# sides then compute in float32 on the same (rounded) weights.
# Qwen3-MoE in bfloat16 covers Qwen3's attention read from bfloat16 files too.
@pytest.mark.parametrize("family,dtype", [("qwen2", "float32"), ("qwen3", "float32"),
                                          ("llama", "float32"), ("qwen3_moe", "bfloat16")])
def test_vllm_greedy_tokens_and_logprobs_match_fnrl(tmp_path, tok_dir, family, dtype):
    # Sharded, weights large enough for peaked distributions, norms and biases perturbed
    # so vLLM must load every one of them right.
    model_dir = write_checkpoint(tmp_path / family, family, seed=0, tokenizer_dir=tok_dir,
                                 dtype=dtype, shard_bytes=60_000, init_std=0.1,
                                 perturb_std=0.3)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert all(p[-3] == tok.convert_tokens_to_ids("<|im_start|>") for p in prompts)
    completions = _serve_greedy(model_dir, prompts, tmp_path / "vllm.log")

    _, graphdef, params = load_pretrained(model_dir)
    run = jax.jit(forward, static_argnums=0)
    diffs, checked = [], 0
    for prompt, c in zip(prompts, completions):
        assert 0 < len(c.token_ids) <= MAX_TOKENS
        tokens = np.array(prompt + list(c.token_ids), np.int32)[None]
        logits_TxV = np.asarray(run(graphdef, params, tokens))[0, len(prompt) - 1:-1]
        logp_TxV = np.asarray(jax.nn.log_softmax(logits_TxV, axis=-1))
        top2 = np.sort(logits_TxV, axis=-1)[:, -2:]
        for t, token in enumerate(c.token_ids):
            diffs.append(abs(logp_TxV[t, token] - c.logprobs[t]))
            if top2[t, 1] - top2[t, 0] > 1e-3:  # a clear winner: greedy must agree
                assert int(np.argmax(logits_TxV[t])) == token, (family, t)
                checked += 1
    assert checked >= len(completions) * 4
    values = [lp for c in completions for lp in c.logprobs]
    print(f"{family}/{dtype}: {checked} greedy tokens agree; mean |Δlogp| = "
          f"{np.mean(diffs):.2e}, max {np.max(diffs):.2e}; logp mean {np.mean(values):.2f} "
          f"std {np.std(values):.2f}; e.g. {tok.decode(c.token_ids)!r}")
    # Neither certain nor uniform (log 1/V): a mis-loaded weight would move these.
    assert 0.9 * np.log(1 / len(tok)) < np.mean(values) < -0.05
    assert np.mean(diffs) < 1e-3 and np.max(diffs) < 1e-2
    assert IM_END in tok.convert_ids_to_tokens(prompts[0])
