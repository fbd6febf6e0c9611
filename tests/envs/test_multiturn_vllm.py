"""A multi-turn episode against a real vLLM server: the trainer's ids are the ids vLLM
was given and sampled, fed tokens masked, and the trainer's log-probs of the sampled
tokens, computed over the whole multi-turn sequence, match vLLM's within 1e-3.

Fed tokens sit between sampled turns, so a context that differed from the trainer's
sequence by one id would show in the later turns' log-probs.
"""

import asyncio

import aiohttp
import numpy as np
import pytest

from fnrl.data.arith import build_tokenizer
from fnrl.envs.base import Step
from fnrl.envs.episode import run_episode
from fnrl.envs.turns import FedTurn, SampledTurn, context_ids, flatten_turns, is_extension
from fnrl.models.hf_io import load_pretrained
from fnrl.serving.client import RolloutClient
from fnrl.serving.server import ServerSpec, serve, stop_server
from fnrl.shell.net import free_port
from fnrl.trainer.step import token_logprobs
from fnrl.types import Problem

pytestmark = pytest.mark.slow
TOK = build_tokenizer()
TURNS, TURN_TOKENS = 3, 4


def encode(text):
    return TOK.encode(text, add_special_tokens=False).ids


class EchoEnv:
    """Feeds "<r>" after each of the first TURNS-1 turns, then ends with reward 1."""

    tools, stop = (), ()

    async def reset(self, problem):
        self.turns = 0
        return problem.prompt

    async def step(self, action, *, num_tokens=0):
        self.turns += 1
        done = self.turns >= TURNS
        return Step(observation="" if done else "<r>", reward=1.0 if done else None, done=done)

    async def close(self):
        pass


@pytest.fixture(scope="module")
def episodes(peaked_model_dir, tmp_path_factory):
    spec = ServerSpec(model_dir=str(peaked_model_dir), port=free_port(), max_model_len=32,
                      max_num_seqs=8)
    spec, proc = serve(spec, tmp_path_factory.mktemp("vllm") / "vllm.log", timeout_s=300)
    sent = []

    async def run_all():
        async with aiohttp.ClientSession() as session:
            client = RolloutClient(spec.base_url, session)

            async def generate(context, stop):
                sent.append(context)
                c, = await client.generate(context, n=1, max_tokens=TURN_TOKENS, temperature=1.0,
                                           seed=len(sent))
                return SampledTurn(version=0, token_ids=c.token_ids, logprobs=c.logprobs)
            out = []
            for i, prompt in enumerate(["12*34=", "7+5=", "903-18="]):
                out.append(await run_episode(
                    EchoEnv(), Problem(uid=str(i), prompt=prompt, answer="", level=1),
                    generate=generate, encode_prompt=encode, encode=encode,
                    decode=lambda ids: TOK.decode(list(ids)), max_context=32))
            return out
    try:
        return asyncio.run(run_all()), sent
    finally:
        stop_server(proc)


def test_trainer_ids_are_the_ids_vllm_saw_and_sampled(episodes):
    eps, sent = episodes
    contexts = iter(sent)
    for ep in eps:
        full = context_ids(ep.prompt_ids, ep.turns)
        kinds = [type(t) for t in ep.turns]
        assert kinds == [SampledTurn, FedTurn] * (TURNS - 1) + [SampledTurn]
        # Every request vLLM got is the trainer's sequence up to that turn, id for id.
        for k in range(TURNS):
            ctx = next(contexts)
            assert ctx == context_ids(ep.prompt_ids, ep.turns[:2 * k])
            assert is_extension(ctx, full)
        seq = flatten_turns(ep.turns)
        assert seq.token_ids_T.tolist() == list(full[len(ep.prompt_ids):])
        fed = [t for t in ep.turns if isinstance(t, FedTurn)]
        assert seq.loss_mask_T.sum() == len(seq.token_ids_T) - sum(len(t.token_ids) for t in fed)


def test_trainer_logprobs_over_turns_match_vllm_within_1e3(peaked_model_dir, episodes):
    eps, _ = episodes
    _, graphdef, params = load_pretrained(peaked_model_dir)
    diffs, values = [], []
    for ep in eps:
        tokens = np.array(context_ids(ep.prompt_ids, ep.turns), np.int32)[None]
        logp = np.asarray(token_logprobs(graphdef, params, tokens[:, :-1], tokens[:, 1:],
                                         temperature=1.0))[0]
        seq = flatten_turns(ep.turns)
        ours = logp[len(ep.prompt_ids) - 1:]
        mask = seq.loss_mask_T.astype(bool)
        diffs.extend(np.abs(ours[mask] - seq.logprobs_T[mask]))
        values.extend(seq.logprobs_T[mask])
    assert len(diffs) >= 2 * TURNS * TURN_TOKENS
    assert np.std(values) > 0.3, "near-uniform log-probs would make this test vacuous"
    print(f"mean |Δlogp| = {np.mean(diffs):.2e}, max = {np.max(diffs):.2e}, n = {len(diffs)}")
    assert np.mean(diffs) < 1e-3
