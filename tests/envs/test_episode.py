"""The episode driver keeps every turn's ids verbatim: the trainer trains on what the
engine saw, tool results masked out."""

import asyncio

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fnrl.data.arith import build_tokenizer
from fnrl.envs.episode import run_episode
from fnrl.envs.registry import make_env
from fnrl.envs.turns import FedTurn, SampledTurn, context_ids, flatten_turns
from fnrl.types import Problem

PROBLEM = Problem(uid="p0", prompt="4721*389=", answer="1836469", level=4)
TOK = build_tokenizer()
PAD = TOK.token_to_id("<pad>")


def encode(text):
    return TOK.encode(text, add_special_tokens=False).ids


def decode(ids):
    return TOK.decode(list(ids), skip_special_tokens=True)


class ScriptedPolicy:
    """A fake engine: replies from a script, recording every context it was given."""

    def __init__(self, replies):
        self.replies, self.contexts, self.stops = list(replies), [], []

    async def __call__(self, context, stop):
        self.contexts.append(context)
        self.stops.append(stop)
        ids = self.replies.pop(0)
        return SampledTurn(version=len(self.contexts), token_ids=ids,
                           logprobs=[-0.5 - i for i in range(len(ids))])


def episode(policy, max_context=256, **env_kw):
    return asyncio.run(run_episode(make_env("tool_arith", **env_kw), PROBLEM, generate=policy,
                                   encode_prompt=encode, encode=encode, decode=decode,
                                   max_context=max_context))


def test_contexts_are_verbatim_extensions_and_tool_tokens_are_masked():
    # A pad id inside the first turn vanishes when decoded: a driver that re-encoded
    # earlier turns from text would drop it from the next context.
    first = [PAD] + encode("<calc>4721*389</calc>")
    policy = ScriptedPolicy([first, encode("\n#### 1836469")])
    ep = episode(policy)
    fed = encode("<result>1836469</result>")
    assert ep.reward == 1.0 and ep.finish_reason == "done" and ep.num_sampled_turns == 2
    assert policy.contexts[0] == tuple(encode("4721*389="))
    assert policy.contexts[1] == policy.contexts[0] + tuple(first) + tuple(fed)
    assert policy.stops == [("</calc>",)] * 2
    assert [type(t) for t in ep.turns] == [SampledTurn, FedTurn, SampledTurn]
    seq = flatten_turns(ep.turns)
    assert context_ids(ep.prompt_ids, ep.turns) == policy.contexts[1] + tuple(encode("\n#### 1836469"))
    n1 = len(first)
    np.testing.assert_array_equal(seq.loss_mask_T[:n1], 1.0)
    np.testing.assert_array_equal(seq.loss_mask_T[n1:n1 + len(fed)], 0.0)
    np.testing.assert_array_equal(seq.loss_mask_T[n1 + len(fed):], 1.0)
    assert seq.versions_T.tolist() == [1] * n1 + [-1] * len(fed) + [2] * (len(seq.versions_T) - n1 - len(fed))


def test_single_turn_without_a_call():
    ep = episode(ScriptedPolicy([encode("#### 1836469")]))
    assert (ep.reward, len(ep.turns), ep.info["tool_calls"]) == (1.0, 1, 0)


def test_context_budget_ends_the_episode_as_a_counted_failure():
    policy = ScriptedPolicy([encode("<calc>4721*389</calc>")] * 3)
    ep = episode(policy, max_context=30)
    assert (ep.finish_reason, ep.reward, len(ep.turns)) == ("max_tokens", 0.0, 1)


ACTIONS = ["<calc>4721*389</calc>", "<calc>x</calc>", "<calc></calc>", "#### 1836469", "#### 7",
           "<calc>1+1</cal>", "<tool_call>{}</tool_call>", "", "\n"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(ACTIONS), min_size=4, max_size=4), st.integers(1, 4),
       st.integers(20, 200))
def test_any_script_keeps_the_bookkeeping_exact(script, max_turns, max_context):
    policy = ScriptedPolicy([encode(a) for a in script])
    ep = episode(policy, max_context=max_context, max_turns=max_turns)
    sampled = [t for t in ep.turns if isinstance(t, SampledTurn)]
    fed = [t for t in ep.turns if isinstance(t, FedTurn)]
    # Turns alternate sampled, fed, sampled, ...; the engine saw each context verbatim.
    assert all(isinstance(t, SampledTurn if i % 2 == 0 else FedTurn) for i, t in enumerate(ep.turns))
    assert len(policy.contexts) == len(sampled) <= max_turns
    for k, ctx in enumerate(policy.contexts):
        assert ctx == context_ids(ep.prompt_ids, ep.turns[:2 * k])
    seq = flatten_turns(ep.turns)
    assert seq.loss_mask_T.sum() == sum(len(t.token_ids) for t in sampled)
    assert all(decode(t.token_ids).startswith("<result>") for t in fed)
    assert ep.reward in (0.0, 1.0)
    if ep.finish_reason == "done":
        assert len(fed) == len(sampled) - 1
        assert ep.reward == float(decode(sampled[-1].token_ids).strip() == "#### 1836469")
