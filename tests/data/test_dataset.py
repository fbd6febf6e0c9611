"""JSONL datasets: bad rows skipped and recorded (or an error naming file, row and
reason), the eval split, and a seeded, epoching, resumable prompt stream."""

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fnrl.config import TaskConfig
from fnrl.data.arith import PromptStream
from fnrl.data.dataset import (BadRowError, DatasetStream, load_task, parse_rows, read_rows,
                               split_task)

GOOD = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
# (line, reason) pairs; each line is a row of its own.
BAD = [
    (b'{"prompt": "1+1=", "answer": "2"', "not valid JSON (Expecting ',' delimiter at column 33)"),
    (b'["1+1=", "2"]', "not a JSON object (got list)"),
    (b'{"answer": "2"}', "missing field 'prompt'"),
    (b'{"prompt": "1+1="}', "missing field 'answer'"),
    (b'{"prompt": "   ", "answer": "2"}', "field 'prompt' is empty"),
    (b'{"prompt": "1+1=", "answer": 2}', "field 'answer' is not a string (got int)"),
    (b'{"prompt": null, "answer": "2"}', "field 'prompt' is not a string (got NoneType)"),
    (b'{"prompt": "\xff1+1=", "answer": "2"}', "not UTF-8 (invalid start byte at byte 12)"),
    (b'{"prompt": "' + b"9" * 30 + b'", "answer": "9"}', "prompt is 31 tokens; at most 20 fit"),
]


def _lines(rows) -> list[bytes]:
    return [json.dumps(r).encode() if isinstance(r, dict) else r for r in rows]


def _mixed() -> list[bytes]:
    """GOOD rows with every BAD row and a blank line in between."""
    lines = _lines(GOOD[:3])
    lines += [b""] + [line for line, _ in BAD] + _lines(GOOD[3:])
    return lines


def _parse(lines, **kwargs):
    return parse_rows(lines, file="d.jsonl", split="train", prompt_tokens=lambda s: 1 + len(s),
                      prompt_budget=20, **kwargs)


def test_every_bad_row_is_skipped_and_recorded_with_its_line_number():
    rows = _parse(_mixed())
    assert [p.prompt for p in rows.problems] == [r["prompt"] for r in GOOD]
    assert [p.uid for p in rows.problems] == ["train-row1", "train-row2", "train-row3",
                                             "train-row14", "train-row15", "train-row16"]
    # Line 4 is blank: not a row, not bad. The bad rows are lines 5..13, in order.
    assert [(b.row, b.reason) for b in rows.bad] == [(5 + i, why) for i, (_, why) in
                                                      enumerate(BAD)]
    assert rows.lines == 16 and {b.file for b in rows.bad} == {"d.jsonl"}


def test_on_bad_row_error_names_file_row_and_reason():
    with pytest.raises(BadRowError, match=r"d\.jsonl, row 5: not valid JSON"):
        _parse(_mixed(), on_bad_row="error")
    assert len(_parse(_lines(GOOD), on_bad_row="error").problems) == len(GOOD)


def test_field_names_are_configurable():
    lines = _lines([{"question": "1+1=", "solution": "2", "prompt": 3}])
    rows = _parse(lines, prompt_key="question", answer_key="solution")
    assert [(p.prompt, p.answer) for p in rows.problems] == [("1+1=", "2")]


def test_a_file_without_a_valid_row_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"d\.jsonl has no valid row \(2 lines, 2 bad; row 1: "
                                         r"missing field 'prompt'\)"):
        _parse([b'{"answer": "1"}', b"[]"])
    with pytest.raises(ValueError, match="has no valid row"):
        _parse([])
    with pytest.raises(FileNotFoundError, match="task.dataset='nope.jsonl' is not a file"):
        read_rows("nope.jsonl", field="task.dataset", split="train")


def test_eval_split_is_held_out_of_training():
    rows = _parse(_lines(GOOD * 2))   # every prompt twice
    train, eval_set = split_task(rows, None, num_eval=2, seed=0)
    assert len(eval_set) == 2 and train
    assert not {p.prompt for p in eval_set} & {p.prompt for p in train}
    assert split_task(rows, None, num_eval=2, seed=0) == (train, eval_set)
    with pytest.raises(ValueError, match="holding out task.num_eval=12"):
        split_task(rows, None, num_eval=12, seed=0)
    eval_rows = parse_rows(_lines(GOOD[:2]), file="e.jsonl", split="eval")
    train, eval_set = split_task(rows, eval_rows, num_eval=1, seed=0)
    assert [p.uid for p in eval_set] == ["eval-row1"] and len(train) == 10
    with pytest.raises(ValueError, match="also in the eval set"):
        split_task(_parse(_lines(GOOD[:1])), eval_rows, num_eval=2, seed=0)


def _problems(n):
    return _parse(_lines([{"prompt": f"p{i}", "answer": "a"} for i in range(n)])).problems


def test_stream_epochs_through_every_row_once_per_epoch_and_reshuffles():
    stream = DatasetStream(_problems(7), seed=3)
    epochs = [[p.prompt for p in stream.take(7)] for _ in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    other_seed = DatasetStream(_problems(7), seed=4).take(7)
    assert [p.prompt for p in other_seed] != epochs[0]
    uids = [p.uid for p in DatasetStream(_problems(7), seed=3).take(21)]
    assert len(set(uids)) == 21 and uids[0].endswith("@0")


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), seed=st.integers(0, 5),
       takes=st.lists(st.integers(0, 12), min_size=1, max_size=6))
def test_stream_resumes_exactly_by_skip_or_cursor(n, seed, takes):
    problems = _problems(n)
    taken = sum(takes)
    whole = DatasetStream(problems, seed).take(taken + n + 5)
    by_skip = DatasetStream(problems, seed)
    by_skip.skip(taken)
    by_cursor = DatasetStream(problems, seed, cursor=taken)
    for stream in (by_skip, by_cursor):
        assert stream.cursor == taken and stream.take(5) == whole[taken:taken + 5]
    chunks = DatasetStream(problems, seed)
    assert [p for k in takes for p in chunks.take(k)] == whole[:taken]
    assert Counter(p.prompt for p in whole[:n]) == Counter(p.prompt for p in problems)


def test_prompt_stream_skip_equals_take():
    a, b = PromptStream(1, 1, 4, held_out=frozenset()), PromptStream(1, 1, 4, held_out=frozenset())
    a.take(37)
    b.skip(37)
    assert a.cursor == b.cursor and a.take(5) == b.take(5)


def test_load_task_reports_bad_rows_once_and_keeps_the_synthetic_default(tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\n".join(_mixed()) + b"\n")
    task = TaskConfig(dataset=str(path), num_eval=2)
    stream, eval_set = load_task(task, seed=0, prompt_tokens=lambda s: 1 + len(s),
                                 prompt_budget=20, run_dir=tmp_path)
    assert isinstance(stream, DatasetStream) and len(eval_set) == 2
    recorded = [json.loads(line) for line in (tmp_path / "bad_rows.jsonl").read_text().splitlines()]
    assert [(r["file"], r["row"], r["reason"]) for r in recorded] == [
        (str(path), 5 + i, why) for i, (_, why) in enumerate(BAD)]
    out = capsys.readouterr().out
    assert out.count("fnrl: skipped") == 1
    assert f"skipped 9 of 16 rows of {path} (rows 5, 6, 7, 8, 9, 10, 11, 12, 13;" in out
    with pytest.raises(BadRowError, match=r"train\.jsonl, row 5"):
        load_task(TaskConfig(dataset=str(path), on_bad_row="error"), seed=0,
                  prompt_tokens=len, prompt_budget=20, run_dir=tmp_path)
    stream, eval_set = load_task(TaskConfig(), seed=0, prompt_tokens=len, prompt_budget=20,
                                 run_dir=tmp_path)
    assert isinstance(stream, PromptStream) and len(eval_set) == TaskConfig().num_eval


def test_task_config_flags_and_validation():
    from fnrl.experiments.math_grpo import parse_config
    cfg = parse_config(["--task.dataset", "t.jsonl", "--task.eval-dataset", "e.jsonl",
                        "--task.prompt-key", "q", "--task.answer-key", "a",
                        "--task.on-bad-row", "error"])
    assert (cfg.task.dataset, cfg.task.eval_dataset, cfg.task.prompt_key, cfg.task.answer_key,
            cfg.task.on_bad_row) == ("t.jsonl", "e.jsonl", "q", "a", "error")
    for kwargs, match in [({"on_bad_row": "warn"}, "TaskConfig.on_bad_row='warn'"),
                          ({"eval_dataset": "e.jsonl"}, "TaskConfig.eval_dataset='e.jsonl'"),
                          ({"prompt_key": ""}, "TaskConfig.prompt_key=''"),
                          ({"answer_key": "prompt"}, "TaskConfig.answer_key='prompt'")]:
        with pytest.raises(ValueError, match=match):
            TaskConfig(**kwargs)


def test_dataset_fields_leave_the_warm_start_model_alone():
    from fnrl.config import ModelConfig, WarmStartConfig
    from fnrl.experiments.warm_start import default_model_dir
    dirs = {default_model_dir(ModelConfig(), task, WarmStartConfig()) for task in (
        TaskConfig(), TaskConfig(dataset="t.jsonl", prompt_key="q", on_bad_row="error"))}
    assert len(dirs) == 1
    assert len({default_model_dir(ModelConfig(), TaskConfig(seed=s), WarmStartConfig())
                for s in (1, 2)}) == 2
