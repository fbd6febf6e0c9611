"""The main job on a real-format model and data: a Qwen3-family checkpoint in sharded
safetensors with a byte-level BPE tokenizer, its ChatML chat template and a
generation_config.json, and GSM8K-format JSONL rows, through real vLLM, relay and trainer.

The checkpoint is first taught (a few hundred supervised steps, here) to answer every row
in GSM8K's format and to end with `<|im_end|>`, followed by a sentence with another
number: so stop tokens, the chat template and answer extraction all show in the run.
"""

from __future__ import annotations

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fnrl.config import TaskConfig
from fnrl.control.metrics import read_jsonl
from fnrl.control.metrics import read_jsonl
from fnrl.data.tokenizer import ChatTokenizer
from fnrl.experiments.math_grpo import main
from fnrl.models.decoder import DecoderConfig, abstract_model
from fnrl.models.hf_io import load_pretrained, save_pretrained
from fnrl.models.synthetic import IM_END, build_bpe_tokenizer, write_checkpoint
from fnrl.trainer.step import init_state, pack_sequences, sft_step

pytestmark = pytest.mark.slow

ROWS, EVAL = 24, 8
MAX_NEW = 48


def gsm8k_rows(n: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, b = rng.randint(10, 60), rng.randint(10, 39)
        rows.append({"question": f"Tina has {a} apples and buys {b} more. How many apples "
                                 f"does she have now? (case {i})",
                     "answer": f"She has {a} + {b} = {a + b} apples.\n#### {a + b}"})
    return rows


def response_text(row: dict) -> str:
    # A trailing number after the marked answer: graded on the whole text, it would be wrong.
    return row["answer"] + "\nAsk me about 5 more."


def teach(model_dir, rows, tok: ChatTokenizer, steps: int = 300):
    """Supervised steps until the model says each row's answer, then `<|im_end|>`."""
    cfg, graphdef, params = load_pretrained(model_dir)
    im_end = tok.hf.convert_tokens_to_ids(IM_END)
    prompts = [tok.encode_prompt(r["question"]) for r in rows]
    responses = [tuple(tok.check_text(response_text(r))) + (im_end,) for r in rows]
    seq_len = max(len(p) + len(r) for p, r in zip(prompts, responses))
    batch = pack_sequences(prompts, responses, seq_len, tok.pad_id)
    optimizer = optax.adam(3e-3)
    state = init_state(jax.tree.map(jnp.asarray, params), optimizer)
    step = jax.jit(lambda s, b: sft_step(s, b, graphdef=graphdef, optimizer=optimizer))
    for _ in range(steps):
        state, metrics = step(state, batch)
    assert float(metrics["loss"]) < 0.05, float(metrics["loss"])
    return cfg, jax.device_get(state.params)


@pytest.fixture(scope="module")
def taught_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    tok_dir = build_bpe_tokenizer(root / "tok")
    raw = write_checkpoint(root / "raw", "qwen3", seed=0, tokenizer_dir=tok_dir)
    rows = gsm8k_rows(ROWS)
    data = root / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = TaskConfig(dataset=str(data), prompt_key="question", answer_key="answer")
    tok = ChatTokenizer.for_task(raw, task)
    cfg, params = teach(raw, rows, tok)
    generation = json.loads((raw / "generation_config.json").read_text())
    model = save_pretrained(root / "model", cfg, params, tokenizer_dir=tok_dir,
                            max_shard_bytes=200_000, generation_config=generation)
    return model, data, rows


def test_a_gsm8k_run_on_a_sharded_chat_model(tmp_path, taught_model):
    model_dir, data, rows = taught_model
    assert (model_dir / "model.safetensors.index.json").exists()
    assert not (model_dir / "model.safetensors").exists()
    run_dir = tmp_path / "run"
    assert main(["--preset", "laminar", "--steps", "2", "--eval.every", "2",
                 "--run-dir", str(run_dir), "--model.model-dir", str(model_dir),
                 "--task.dataset", str(data), "--task.prompt-key", "question",
                 "--task.answer-key", "answer", "--task.num-eval", str(EVAL),
                 "--algo.group-size", "4", "--algo.groups-per-step", "2",
                 "--rollout.queued-groups", "2", "--algo.max-new-tokens", str(MAX_NEW)]) == 0

    cfg = json.loads((run_dir / "config.json").read_text())
    tok = ChatTokenizer.for_task(model_dir, TaskConfig(**{
        k: v for k, v in cfg["task"].items() if k != "reward"}))
    # generation_config.json's eos ids (<|im_end|>, <|endoftext|>) are stop ids.
    assert {tok.hf.convert_tokens_to_ids(IM_END), tok.pad_id} <= set(tok.stop_ids)
    # Prompts went out through the chat template: exactly the ids recorded per trajectory.
    questions = {f"train-row{i + 1}": r["question"] for i, r in enumerate(rows)}
    consumed = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(consumed) == 4
    for record in consumed:
        question = questions[record["group"].split("@")[0]]
        expected = list(tok.encode_prompt(question))
        assert expected[0] == tok.hf.convert_tokens_to_ids("<|im_start|>")
        assert all(t["prompt_ids"] == expected for t in record["trajectories"])

    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    # Responses stopped at <|im_end|>: far shorter than the token limit.
    assert all(r["response_len_mean"] < MAX_NEW * 0.75 for r in train), train
    # The taught answers end "#### N\nAsk me about 5 more.": graded right only when the
    # marked answer is extracted (the last number would be 5).
    assert evals[0]["step"] == 0 and evals[0]["accuracy"] >= 0.75, evals[0]


def test_evaluate_any_model_directory_on_a_jsonl_and_a_parquet_file(tmp_path, taught_model,
                                                                    capsys):
    """`python -m fnrl.experiments.evaluate --model.model-dir D --task.dataset F`: the
    held-out rows of either file format scored on a fresh server with the run's grading
    (greedy and pass@k), a JSON report and a plot; the same rows give the same scores."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fnrl.experiments.evaluate import main as evaluate

    model_dir, data, rows = taught_model
    parquet = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    reports = []
    for path in (data, parquet):
        out = tmp_path / path.suffix.lstrip(".")
        assert evaluate(["--model.model-dir", str(model_dir), "--task.dataset", str(path),
                         "--task.prompt-key", "question", "--task.answer-key", "answer",
                         "--task.num-eval", str(EVAL), "--eval.samples", "2",
                         "--algo.max-new-tokens", str(MAX_NEW), "--run-dir", str(out)]) == 0
        report = json.loads((out / "evaluation.json").read_text())
        assert (out / "evaluation.png").stat().st_size > 0
        assert report["model_dir"] == str(model_dir) and report["dataset"] == str(path)
        reports.append(report["scores"])
    printed = capsys.readouterr().out
    assert f"evaluated {EVAL * 3}/{EVAL * 3} responses" in printed and "greedy accuracy" in printed
    jsonl, par = reports
    assert jsonl["num_problems"] == par["num_problems"] == EVAL
    assert jsonl["samples_per_problem"] == 2 and {"pass@1", "pass@2", "mean@2"} <= set(jsonl)
    # The taught model answers its rows (as the run's own eval record says, >= 75 %).
    assert jsonl["accuracy"] >= 0.75 and par["accuracy"] == jsonl["accuracy"]
    assert evaluate(["--task.dataset", str(data)]) == 2   # no model named
