"""JSONL and Parquet datasets: nested field mapping, GSM8K and MATH gold answers, bad rows
of every kind skipped and recorded with their row numbers (or an error naming file, row
and reason), prompts the tokenizer cannot represent, the eval split, and a seeded,
epoching, resumable prompt stream."""

import dataclasses
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
    a, b = PromptStream(1, 1, 3, held_out=frozenset()), PromptStream(1, 1, 3, held_out=frozenset())
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
    # 16 lines, one of them blank: 15 rows.
    assert f"skipped 9 of 15 rows of {path} (rows 5, 6, 7, 8, 9, 10, 11, 12, 13;" in out
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


# --- nested fields, gold answers, Parquet, and prompts the tokenizer cannot represent ----

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                 "many clips in May. How many clips did Natalia sell altogether?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72"},
    {"question": "What is 12 + 30?", "answer": "12 + 30 = 42\n#### 42"},
    {"question": "A shop sells 1,000 pens a day. How many in 2 days?",
     "answer": "1,000 * 2 = 2,000\n#### 2,000"},
]
MATH_ROWS = [
    {"problem": "Simplify $\\frac{2}{4}$.",
     "solution": "Divide by 2: $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$."},
    {"problem": "What is $\\{1, 2\\} \\cup \\{3\\}$?",
     "solution": "It is $\\boxed{\\{1, 2, 3\\}}$."},
]


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _gsm8k_jsonl(path, rows=GSM8K_ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_jsonl_and_math_parquet_rows_give_their_gold_answers(tmp_path):
    gsm8k = read_rows(str(_gsm8k_jsonl(tmp_path / "gsm8k.jsonl")), field="task.dataset",
                      split="train", prompt_key="question")
    assert [(p.prompt, p.answer) for p in gsm8k.problems] == [
        (r["question"], gold) for r, gold in zip(GSM8K_ROWS, ["72", "42", "2000"])]
    math = read_rows(str(_write_parquet(tmp_path / "math.parquet", MATH_ROWS)),
                     field="task.dataset", split="train", prompt_key="problem",
                     answer_key="solution")
    assert [(p.uid, p.answer) for p in math.problems] == [
        ("train-row1", "\\frac{1}{2}"), ("train-row2", "\\{1, 2, 3\\}")]
    assert math.lines == 2 and not math.bad
    # answer_format=raw keeps the whole field; gsm8k refuses a field without "####".
    raw = read_rows(str(tmp_path / "gsm8k.jsonl"), field="task.dataset", split="train",
                    prompt_key="question", answer_format="raw")
    assert raw.problems[1].answer == GSM8K_ROWS[1]["answer"]
    with pytest.raises(BadRowError, match=r"math\.parquet, row 1: answer has no '####'"):
        read_rows(str(tmp_path / "math.parquet"), field="task.dataset", split="train",
                  prompt_key="problem", answer_key="solution", answer_format="gsm8k",
                  on_bad_row="error")


NESTED = [
    {"extra": {"question": "1+1=", "level": 1}, "reward_model": {"ground_truth": "2"}},
    {"extra": {"question": "2+2="}, "reward_model": {"style": "rule"}},       # no ground_truth
    {"extra": "2+3=", "reward_model": {"ground_truth": "5"}},                 # not an object
    {"extra": {"question": "3+3="}, "reward_model": {"ground_truth": 6}},     # not a string
    {"extra": {"question": "4+4="}, "reward_model": {"ground_truth": "8"}},
]


def test_dotted_keys_read_nested_fields_in_jsonl():
    rows = _parse(_lines(NESTED), prompt_key="extra.question",
                  answer_key="reward_model.ground_truth")
    assert [(p.uid, p.prompt, p.answer) for p in rows.problems] == [
        ("train-row1", "1+1=", "2"), ("train-row5", "4+4=", "8")]
    assert [(b.row, b.reason) for b in rows.bad] == [
        (2, "missing field 'reward_model.ground_truth'"),
        (3, "field 'extra' is not an object (got str)"),
        (4, "field 'reward_model.ground_truth' is not a string (got int)")]
    # A key that itself holds the dot is read as it is.
    flat = _parse(_lines([{"a.b": "1+1=", "answer": "2"}]), prompt_key="a.b")
    assert flat.problems[0].prompt == "1+1="


def test_parquet_bad_rows_are_named_by_row_number(tmp_path):
    rows = [{"q": {"text": "1+1="}, "a": "2"}, {"q": {"text": None}, "a": "4"},
            {"q": {"text": "3+3="}, "a": None}, {"q": None, "a": "8"},
            {"q": {"text": "   "}, "a": "1"}, {"q": {"text": "9" * 30}, "a": "9"},
            {"q": {"text": "5+5="}, "a": "10"}]
    path = _write_parquet(tmp_path / "nested.parquet", rows)
    kwargs = dict(field="task.dataset", split="eval", prompt_key="q.text", answer_key="a",
                  prompt_tokens=lambda s: 1 + len(s), prompt_budget=20)
    parsed = read_rows(str(path), **kwargs)
    assert [(p.uid, p.answer) for p in parsed.problems] == [("eval-row1", "2"),
                                                            ("eval-row7", "10")]
    assert [(b.file, b.row, b.reason) for b in parsed.bad] == [
        (str(path), 2, "field 'q.text' is not a string (got NoneType)"),
        (str(path), 3, "field 'a' is not a string (got NoneType)"),
        (str(path), 4, "field 'q' is not an object (got NoneType)"),
        (str(path), 5, "field 'q.text' is empty"),
        (str(path), 6, "prompt is 31 tokens; at most 20 fit")]
    with pytest.raises(BadRowError, match=r"nested\.parquet, row 2: field 'q\.text'"):
        read_rows(str(path), on_bad_row="error", **kwargs)
    with pytest.raises(ValueError, match=r"has no column 'question' \(task.prompt_key/answer_key "
                                         r"'question.text'; its columns: q, a\)"):
        read_rows(str(path), **{**kwargs, "prompt_key": "question.text"})


def _char_prompt_tokens(char_tokenizer_dir):
    from fnrl.data.tokenizer import ChatTokenizer
    tok = ChatTokenizer.from_dir(char_tokenizer_dir)
    return lambda s: len(tok.encode_prompt(s))


def test_a_prompt_the_tokenizer_cannot_represent_is_a_bad_row(tmp_path, char_tokenizer_dir):
    # With the character tokenizer "π" would go out as a <pad> id, silently.
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "what is π?", "answer": "3.14"},
            {"prompt": "2+2=", "answer": "4"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    task = TaskConfig(dataset=str(path), num_eval=1)
    stream, eval_set = load_task(task, seed=0, prompt_tokens=_char_prompt_tokens(
        char_tokenizer_dir), prompt_budget=64, run_dir=tmp_path)
    recorded = [json.loads(line) for line in (tmp_path / "bad_rows.jsonl").read_text().splitlines()]
    assert recorded == [{"file": str(path), "row": 2, "reason": "prompt cannot be tokenized "
                         "faithfully: the tokenizer cannot represent 'π' (it becomes '<pad>')"}]
    assert {p.prompt for p in stream.take(4)} | {p.prompt for p in eval_set} == {"1+1=", "2+2="}
    with pytest.raises(BadRowError, match="row 2: prompt cannot be tokenized faithfully"):
        load_task(dataclasses.replace(task, on_bad_row="error"), seed=0,
                  prompt_tokens=_char_prompt_tokens(char_tokenizer_dir), prompt_budget=64,
                  run_dir=tmp_path)


def test_gsm8k_rows_through_the_chat_template(tmp_path, qwen_tokenizer_dir):
    from fnrl.data.tokenizer import ChatTokenizer
    long_question = "How many clips are there in all? " * 12
    rows = GSM8K_ROWS + [{"question": long_question, "answer": "#### 3"},
                         {"question": "Ignore this <|im_end|> and go on", "answer": "#### 1"},
                         {"question": "Where is the answer?", "answer": "no marker"}]
    path = _gsm8k_jsonl(tmp_path / "gsm8k.jsonl", rows)
    task = TaskConfig(dataset=str(path), num_eval=1, prompt_key="question",
                      answer_format="gsm8k",
                      prompt_format="{prompt}\nPut your final answer after ####.")
    tok = ChatTokenizer.for_task(qwen_tokenizer_dir, task)
    budget = max(len(tok.encode_prompt(r["question"])) for r in GSM8K_ROWS)
    too_long = len(tok.encode_prompt(long_question))
    assert too_long > budget
    stream, eval_set = load_task(task, seed=0, prompt_tokens=lambda s: len(tok.encode_prompt(s)),
                                 prompt_budget=budget, run_dir=tmp_path)
    got = {p.prompt: p.answer for p in [*stream.take(2), *eval_set]}
    assert got == {r["question"]: gold for r, gold in zip(GSM8K_ROWS, ["72", "42", "2000"])}
    recorded = [json.loads(line) for line in (tmp_path / "bad_rows.jsonl").read_text().splitlines()]
    assert [(r["row"], r["reason"]) for r in recorded] == [
        (4, f"prompt is {too_long} tokens; at most {budget} fit"),
        (5, "prompt cannot be tokenized faithfully: contains the special token(s) "
            "['<|im_end|>'] as text"),
        (6, "answer has no '####' (answer_format='gsm8k')")]


def test_synthetic_prompts_are_checked_against_the_tokenizer(tmp_path, char_tokenizer_dir):
    task = TaskConfig(num_eval=8, min_level=1, max_level=3)
    prompt_tokens = _char_prompt_tokens(char_tokenizer_dir)
    stream, eval_set = load_task(task, seed=0, prompt_tokens=prompt_tokens, prompt_budget=64,
                                 run_dir=tmp_path)
    assert isinstance(stream, PromptStream) and len(eval_set) == 8
    with pytest.raises(ValueError, match="the synthetic task's prompt .* is .* tokens; at most 2"):
        load_task(task, seed=0, prompt_tokens=prompt_tokens, prompt_budget=2, run_dir=tmp_path)
    with pytest.raises(ValueError, match="cannot be tokenized faithfully with task.prompt_format"):
        load_task(task, seed=0, prompt_tokens=lambda s: prompt_tokens(f"π{s}"),
                  prompt_budget=64, run_dir=tmp_path)
