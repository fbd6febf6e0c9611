"""The warm start's packed supervised step and its greedy check, on a random tiny model."""

import jax.numpy as jnp
import numpy as np
import pytest

from fnrl.config import ModelConfig
from fnrl.data.arith import (BOS, EOS, PAD, PromptStream, build_tokenizer, eval_problems,
                             solution)
from fnrl.experiments.warm_start import (encode_prompt, greedy_solves, model_argmax,
                                         model_config, pack_rows)
from fnrl.models.decoder import init_model
from fnrl.trainer.step import pack_sequences, token_logprobs


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS, PAD)}
    cfg = model_config(ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=128), 112, ids)
    graphdef, params = init_model(cfg, seed=0)
    return tok, ids, graphdef, params


def _demos(tok, ids, n, shorter_than=80):
    problems = [p for p in PromptStream(0, 1, 3, held_out=frozenset()).take(200)
                if len(solution(p.prompt)) < shorter_than][:n]
    assert len(problems) == n
    return [(encode_prompt(tok, p.prompt),
             tok.encode(solution(p.prompt), add_special_tokens=False).ids + [ids[EOS]])
            for p in problems]


def test_packed_rows_score_each_demonstration_as_if_alone(tiny):
    tok, ids, graphdef, params = tiny
    demos = _demos(tok, ids, 7, shorter_than=50)
    packed, used = pack_rows(demos, rows=4, width=128, pad_id=ids[PAD])
    assert used == 7 and packed["segment_ids_BxT"].max() == 7
    assert len(set(packed["segment_ids_BxT"][0].tolist()) - {0}) >= 2   # rows are shared
    logp_packed = token_logprobs(graphdef, params, packed["input_BxT"], packed["target_BxT"],
                                 packed["positions_BxT"], packed["segment_ids_BxT"])
    alone = pack_sequences([tuple(p) for p, _ in demos], [tuple(r) for _, r in demos], 128,
                           ids[PAD])
    logp_alone = token_logprobs(graphdef, params, alone["input_BxT"], alone["target_BxT"])
    # Same response tokens, same log-probs: packing neither leaks across demonstrations
    # nor shifts positions.
    assert packed["mask_BxT"].sum() == alone["mask_BxT"].sum()
    np.testing.assert_allclose(np.sort(np.asarray(logp_packed)[packed["mask_BxT"] > 0]),
                               np.sort(np.asarray(logp_alone)[alone["mask_BxT"] > 0]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(jnp.sum(logp_packed * packed["mask_BxT"])),
                               float(jnp.sum(logp_alone * alone["mask_BxT"])), rtol=1e-5)


def test_packing_stops_at_full_rows_and_refuses_what_never_fits(tiny):
    tok, ids, *_ = tiny
    demos = _demos(tok, ids, 12)
    packed, used = pack_rows(demos, rows=1, width=128, pad_id=ids[PAD])
    assert 0 < used < 12
    assert sum(len(p) + len(r) - 1 for p, r in demos[:used]) <= 128
    assert sum(len(p) + len(r) - 1 for p, r in demos[:used + 1]) > 128
    with pytest.raises(ValueError, match="max_position_embeddings"):
        pack_rows([([ids[BOS]] * 100, [5] * 100)], rows=1, width=128, pad_id=ids[PAD])


def test_greedy_check_finds_where_greedy_leaves_the_solution(tiny):
    tok, ids, graphdef, params = tiny
    problems = [p for p in eval_problems(0, 200, 1, 3) if len(solution(p.prompt)) < 100][:40]
    assert len(problems) == 40   # two chunks of 32 rows
    seqs = [encode_prompt(tok, p.prompt)
            + tok.encode(solution(p.prompt), add_special_tokens=False).ids + [ids[EOS]]
            for p in problems]
    zero, seven = tok.token_to_id("0"), tok.token_to_id("7")

    def oracle(tokens_BxT):
        """Greedy that writes the gold next token, except: the teacher's slip ("0" for
        EOS) on problems 1 and 33, a wrong character mid-way on problem 2."""
        out = np.full(tokens_BxT.shape, ids[PAD], np.int32)
        for i, row in enumerate(tokens_BxT):
            k = next((k for k, seq in enumerate(seqs) if list(row[:len(seq) - 1]) == seq[:-1]),
                     None)
            if k is None:   # a padding row
                continue
            out[i, :len(seqs[k]) - 1] = seqs[k][1:]
            if k in (1, 33):
                out[i, len(seqs[k]) - 2] = zero
            if k == 2:
                out[i, len(seqs[k]) // 2] = seven if seqs[k][len(seqs[k]) // 2 + 1] != seven else zero
        return out

    solved, answered = greedy_solves(oracle, tok, problems, width=128)
    expected_solved = np.ones(40, bool)
    expected_solved[[1, 2, 33]] = False
    expected_answered = expected_solved.copy()
    expected_answered[[1, 33]] = True
    np.testing.assert_array_equal(solved, expected_solved)
    np.testing.assert_array_equal(answered, expected_answered)
    # The real model's argmax: a random model writes no worked solution.
    solved, _ = greedy_solves(model_argmax(graphdef, params), tok, problems[:4], width=128)
    assert not solved.any()


def test_tool_demonstrations_train_only_on_what_the_model_writes(tiny):
    """A tool demonstration's fed result is context: packed with mask 0 (the rest 1), and
    the greedy check does not ask the model to write it."""
    from fnrl.data.tool_arith import tool_eval_problems
    from fnrl.experiments.warm_start import tool_solution

    tok, ids, *_ = tiny
    problem = tool_eval_problems(0, 1)[0]
    response, mask = tool_solution(tok, problem)
    text = tok.decode(response, skip_special_tokens=False)
    fed = f"<result>{problem.answer}</result>"
    assert text.startswith(f"<calc>{problem.prompt.rstrip('=')}</calc>{fed}")
    start = text.index(fed)
    assert mask == [0.0 if start <= i < start + len(fed) else 1.0 for i in range(len(response))]
    prompt = encode_prompt(tok, problem.prompt)
    packed, used = pack_rows([(prompt, response, mask)], rows=1, width=128, pad_id=ids[PAD])
    assert used == 1
    assert packed["mask_BxT"][0, len(prompt) - 1:len(prompt) - 1 + len(response)].tolist() == mask
    assert packed["mask_BxT"].sum() == sum(mask)

    seq = prompt + response

    def writes_all_but_the_result(tokens_BxT):
        out = np.full(tokens_BxT.shape, ids[PAD], np.int32)
        out[0, :len(seq) - 1] = seq[1:]
        # Wrong wherever the result is fed: the check must not count it.
        for i, m in enumerate(mask):
            if m == 0:
                out[0, len(prompt) - 1 + i] = ids[PAD]
        return out

    solved, _ = greedy_solves(writes_all_but_the_result, tok, [problem], 128, tool_solution)
    assert solved.tolist() == [True]


def test_the_tool_task_has_a_warm_start_of_its_own_and_the_math_one_is_unchanged():
    import dataclasses

    from fnrl.config import RunConfig
    from fnrl.experiments.warm_start import default_model_dir

    cfg = RunConfig()
    math_dir = default_model_dir(cfg.model, cfg.task, cfg.warm_start)
    # The tool fields do not enter the math recipe (its cache is the one built before).
    other = dataclasses.replace(cfg.warm_start, tool_call_rate=0.9)
    assert default_model_dir(cfg.model, cfg.task, other) == math_dir
    tool_task = dataclasses.replace(cfg.task, env="tool_arith")
    tool_dir = default_model_dir(cfg.model, tool_task, cfg.warm_start)
    assert tool_dir != math_dir and tool_dir.name.startswith("tiny-qwen2-toolarith-")
    assert default_model_dir(cfg.model, tool_task, other) != tool_dir


def test_a_moe_default_has_a_recipe_of_its_own_and_the_dense_one_is_unchanged():
    import dataclasses

    from fnrl.config import RunConfig
    from fnrl.experiments.warm_start import default_model_dir, model_config

    cfg = RunConfig()
    dense = default_model_dir(cfg.model, cfg.task, cfg.warm_start)
    # The MoE fields enter the recipe only for a MoE model: the dense cache stays valid.
    assert dense == default_model_dir(dataclasses.replace(cfg.model, num_experts_per_tok=4),
                                      cfg.task, cfg.warm_start)
    moe_model = dataclasses.replace(cfg.model, num_experts=8)
    moe = default_model_dir(moe_model, cfg.task, cfg.warm_start)
    assert moe.name.startswith("tiny-qwen3moe-arith-") and moe != dense
    assert moe != default_model_dir(dataclasses.replace(moe_model, num_experts_per_tok=1),
                                    cfg.task, cfg.warm_start)
    arch = model_config(moe_model, 64, {PAD: 0, BOS: 1, EOS: 2})
    assert (arch.model_type, arch.num_experts, arch.num_experts_per_tok,
            arch.moe_intermediate_size, arch.norm_topk_prob) == ("qwen3_moe", 8, 2, 96, True)


@pytest.mark.parametrize("field,value,match", [
    ("num_experts", -1, "num_experts"),
    ("num_experts_per_tok", 9, "at most num_experts=8"),
    ("moe_intermediate_size", 0, "moe_intermediate_size"),
])
def test_moe_fields_of_the_embedded_model_are_checked(field, value, match):
    from fnrl.config import ModelConfig

    with pytest.raises(ValueError, match=match):
        ModelConfig(**{"num_experts": 8, field: value})


def test_the_tool_warm_start_builds_a_model_that_loads(tmp_path):
    """The whole tool-task warm start (demonstrations with fed results, packing, the
    greedy check over tool solutions) on a tiny model for a few steps."""
    import json

    from fnrl.config import TaskConfig, WarmStartConfig
    from fnrl.experiments.warm_start import ensure_default_model
    from fnrl.models.hf_io import load_pretrained

    model = ModelConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=64)
    out = ensure_default_model(model, TaskConfig(env="tool_arith", num_eval=8),
                               WarmStartConfig(steps=3, batch_size=2, cache_dir=str(tmp_path)))
    assert out.name.startswith("tiny-qwen2-toolarith-")
    info = json.loads((out / "warm_start.json").read_text())
    assert info["demonstrations"] > 0 and np.isfinite(info["sft_loss"])
    assert 0.0 <= info["heldout_greedy_accuracy"] <= 1.0
    cfg, _, params = load_pretrained(out)
    assert cfg.max_position_embeddings == 64 and params


def test_a_second_job_waits_for_the_first_to_build_the_cached_model(tmp_path, monkeypatch,
                                                                     capsys):
    """Two jobs on an empty cache: the one that finds the builder's lock taken waits,
    then uses what the builder made, and never builds (or replaces) it itself."""
    import fcntl
    import threading
    import time

    from fnrl.config import TaskConfig, WarmStartConfig
    from fnrl.experiments import warm_start

    warm = WarmStartConfig(cache_dir=str(tmp_path))
    out = warm_start.default_model_dir(ModelConfig(), TaskConfig(), warm)
    built = []
    monkeypatch.setattr(warm_start, "build_default_model", lambda *a: built.append(a))
    lock = open(tmp_path / f".{out.name}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)            # the first job, building
    result = []
    second = threading.Thread(target=lambda: result.append(
        warm_start.ensure_default_model(ModelConfig(), TaskConfig(), warm)))
    second.start()
    said = ""
    for _ in range(3000):                       # until it says it waits (a condition)
        said += capsys.readouterr().out
        if "another job is building" in said:
            break
        time.sleep(0.01)
    assert "another job is building" in said and second.is_alive() and not result
    out.mkdir(parents=True)
    (out / "warm_start.json").write_text("{}")  # the first job finishes...
    fcntl.flock(lock, fcntl.LOCK_UN)            # ...and lets go
    lock.close()
    second.join(timeout=30)
    assert result == [out] and built == []
