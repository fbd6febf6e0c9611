"""Exact token bookkeeping over turns: concatenation, loss mask, versions, log-probs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnrl.envs.turns import (FED_VERSION, FedTurn, SampledTurn, context_ids, flatten_turns,
                             is_extension, oldest_version)

ids = st.lists(st.integers(0, 50_000), max_size=12)


@st.composite
def turn(draw):
    tokens = draw(ids)
    if draw(st.booleans()):
        lps = draw(st.lists(st.floats(-20, 0, width=32), min_size=len(tokens), max_size=len(tokens)))
        return SampledTurn(version=draw(st.integers(0, 9)), token_ids=tokens, logprobs=lps)
    return FedTurn(token_ids=tokens, source=draw(st.sampled_from(["tool", "env"])))


@settings(max_examples=200, deadline=None)
@given(st.lists(turn(), max_size=8), ids)
def test_flatten_is_the_turns_verbatim(turns, prompt):
    seq = flatten_turns(turns)
    flat = [t for tr in turns for t in tr.token_ids]
    assert seq.token_ids_T.tolist() == flat
    assert context_ids(prompt, turns) == tuple(prompt) + tuple(flat)
    sampled = [isinstance(tr, SampledTurn) for tr in turns for _ in tr.token_ids]
    # The mask is 1 exactly on sampled tokens; their log-probs and versions are kept.
    assert seq.loss_mask_T.tolist() == [1.0 if s else 0.0 for s in sampled]
    want_lp = [lp if isinstance(tr, SampledTurn) else 0.0 for tr in turns
               for lp in (tr.logprobs if isinstance(tr, SampledTurn) else [0.0] * len(tr.token_ids))]
    np.testing.assert_array_equal(seq.logprobs_T, np.asarray(want_lp, np.float32))
    want_v = [tr.version if isinstance(tr, SampledTurn) else FED_VERSION
              for tr in turns for _ in tr.token_ids]
    assert seq.versions_T.tolist() == want_v
    # Turn boundaries split the sequence back into the turns.
    ends = seq.turn_starts[1:] + (len(flat),)
    assert [seq.token_ids_T[a:b].tolist() for a, b in zip(seq.turn_starts, ends)] == \
        [list(tr.token_ids) for tr in turns]


@settings(max_examples=100, deadline=None)
@given(st.lists(turn(), min_size=1, max_size=8), ids)
def test_each_context_extends_the_previous(turns, prompt):
    contexts = [context_ids(prompt, turns[:k]) for k in range(len(turns) + 1)]
    assert all(is_extension(a, b) for a, b in zip(contexts, contexts[1:]))


def test_oldest_version_ignores_fed_tokens():
    turns = [SampledTurn(version=5, token_ids=[1], logprobs=[-0.1]), FedTurn(token_ids=[2, 3]),
             SampledTurn(version=3, token_ids=[4], logprobs=[-0.2]),
             SampledTurn(version=1, token_ids=[], logprobs=[])]   # an empty turn sampled nothing
    assert oldest_version(turns) == 3
    with pytest.raises(ValueError, match="no sampled tokens"):
        oldest_version([FedTurn(token_ids=[1])])


def test_bad_turns_are_refused():
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        SampledTurn(version=0, token_ids=[1, 2], logprobs=[-1.0])
    with pytest.raises(ValueError, match="version=-1"):
        SampledTurn(version=-1, token_ids=[1], logprobs=[-1.0])
    with pytest.raises(TypeError, match="SampledTurn or a FedTurn"):
        flatten_turns([(1, 2)])
    assert not is_extension([1, 2], [1, 3, 4]) and not is_extension([1, 2], [1])
