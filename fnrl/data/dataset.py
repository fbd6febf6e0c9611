"""Prompts from data files: `--task.dataset train.jsonl [--task.eval-dataset eval.parquet]`.

Two formats, each read the way that keeps bad rows reportable:
- JSON Lines (any name but *.parquet): one JSON object per line, read line by line with
  the standard library, so a row that is not valid JSON or not UTF-8 is reported with
  its line number and the rest of the file is still read. (`datasets` and pyarrow's JSON
  reader stop at the first malformed line: rows could not be skipped one by one.)
- Parquet (*.parquet, as Hugging Face publishes GSM8K and MATH): read with pyarrow, a
  record batch at a time and only the columns the task reads; a bad row is named by its
  1-based row number. pyarrow is the Parquet reference implementation, and a direct
  dependency is far lighter than `datasets` (which reads Parquet through it anyway).
Nothing is ever fetched from a hub.

Field names come from `task.prompt_key` / `task.answer_key`, a dotted path reading into
nested objects ("reward_model.ground_truth"; a key that itself contains the dot wins).
The gold answer is read from the answer field by `task.answer_format`
(fnrl.data.answers.gold_answer: GSM8K's text after "####", MATH's last \\boxed{...}).

A malformed row (bad JSON or UTF-8, not an object, a field missing, empty or not a
string, no gold answer in the answer field, a prompt the tokenizer cannot represent
faithfully, a prompt longer than the model can take) is skipped and recorded with its
row number, or, with `task.on_bad_row=error`, stops the job naming the file, row and
reason. A file with no valid row is an error. `load_task` reads and checks everything
before the job starts any role.

Without an eval file, `task.num_eval` rows drawn by the seed are held out of the
training file; with one, its first `task.num_eval` rows are the eval set. Training
never sees a prompt of the eval set.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from fnrl.config import TaskConfig
from fnrl.data.answers import gold_answer
from fnrl.data.arith import PromptStream, eval_problems
from fnrl.data.tokenizer import UnrepresentablePrompt
from fnrl.types import Problem

# Rows converted to Python objects at a time when reading Parquet.
_PARQUET_BATCH_ROWS = 4096


@dataclass(frozen=True)
class BadRow:
    """A skipped row: its file, its 1-based row (line) number and why."""

    file: str
    row: int
    reason: str


class BadRowError(ValueError):
    """A malformed row under `task.on_bad_row=error`."""


@dataclass(frozen=True)
class Rows:
    """The valid rows of one file as problems, plus the rows that were skipped."""

    file: str
    problems: tuple[Problem, ...]
    bad: tuple[BadRow, ...]
    lines: int


@dataclass(frozen=True, kw_only=True)
class RowSpec:
    """What makes a row valid: its fields, the gold format and the prompt's token budget.
    `prompt_tokens` may raise UnrepresentablePrompt (the row is bad)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    answer_format: str = "auto"
    prompt_tokens: Callable[[str], int] | None = None
    prompt_budget: int | None = None


def field_value(obj: dict, key: str) -> tuple[Any, str | None]:
    """(value, None) for the field `key` names (dotted: nested objects), else (None, why)."""
    if key in obj:
        return obj[key], None
    head, _, rest = key.partition(".")
    if not rest or head not in obj:
        return None, f"missing field {key!r}"
    inner = obj[head]
    if not isinstance(inner, dict):
        return None, f"field {head!r} is not an object (got {type(inner).__name__})"
    value, why = field_value(inner, rest)
    if why is not None and why.startswith("missing field"):
        return None, f"missing field {key!r}"
    if why is not None:  # name the failing field by its full path
        return None, why.replace("field '", f"field '{head}.", 1)
    return value, None


def _text_field(obj: dict, key: str) -> tuple[str | None, str | None]:
    """(value, None) for a non-empty string field, else (None, why not)."""
    value, why = field_value(obj, key)
    if why is not None:
        return None, why
    if not isinstance(value, str):
        return None, f"field {key!r} is not a string (got {type(value).__name__})"
    if not value.strip():
        return None, f"field {key!r} is empty"
    return value, None


def check_row(obj: Any, spec: RowSpec) -> tuple[tuple[str, str] | None, str | None]:
    """((prompt, gold answer), None) for a valid decoded row, else (None, why it is bad)."""
    if not isinstance(obj, dict):
        return None, f"not a JSON object (got {type(obj).__name__})"
    prompt, why = _text_field(obj, spec.prompt_key)
    if why is None:
        answer, why = _text_field(obj, spec.answer_key)
    if why is not None:
        return None, why
    gold, why = gold_answer(answer, spec.answer_format)
    if why is not None:
        return None, why
    if spec.prompt_tokens is not None:
        try:
            n = spec.prompt_tokens(prompt)
        except UnrepresentablePrompt as err:
            return None, f"prompt cannot be tokenized faithfully: {err}"
        if spec.prompt_budget is not None and n > spec.prompt_budget:
            return None, f"prompt is {n} tokens; at most {spec.prompt_budget} fit"
    return (prompt, gold), None


def parse_row(line: bytes, spec: RowSpec) -> tuple[tuple[str, str] | None, str | None]:
    """((prompt, gold answer), None) for a valid JSONL line, else (None, why it is bad)."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 ({err.reason} at byte {err.start})"
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err.msg} at column {err.colno})"
    return check_row(obj, spec)


def _jsonl_rows(lines: Iterable[bytes], spec: RowSpec) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, (prompt, gold) or None, why) per non-blank line."""
    for number, line in enumerate(lines, start=1):
        if line.strip():
            # Without its newline a truncated row's JSON error points into the row.
            yield (number, *parse_row(line.rstrip(b"\r\n"), spec))
        else:
            yield number, None, None   # blank: counted as a line, not a row


def collect_rows(checked: Iterable[tuple[int, Any, str | None]], *, file: str, split: str,
                 on_bad_row: str = "skip") -> Rows:
    """Problems (uids `{split}-row{N}`) from (row number, (prompt, gold) | None, why)
    triples; a triple with neither is a blank line."""
    problems, bad, count = [], [], 0
    for count, parsed, why in checked:
        if why is not None:
            if on_bad_row == "error":
                raise BadRowError(f"{file}, row {count}: {why} (task.on_bad_row='error'; "
                                  f"'skip' skips bad rows and records them)")
            bad.append(BadRow(file, count, why))
        elif parsed is not None:
            prompt, answer = parsed
            problems.append(Problem(uid=f"{split}-row{count}", prompt=prompt, answer=answer,
                                    level=0))
    if not problems:
        raise ValueError(f"{file} has no valid row ({count} lines, {len(bad)} bad"
                         + (f"; row {bad[0].row}: {bad[0].reason}" if bad else "") + ")")
    return Rows(file, tuple(problems), tuple(bad), count)


def parse_rows(lines: Iterable[bytes], *, file: str, split: str, on_bad_row: str = "skip",
               **spec: Any) -> Rows:
    """Problems from JSONL lines (uids `{split}-row{N}`); blank lines are not rows.
    `spec` holds RowSpec's fields (prompt_key, answer_key, answer_format, ...)."""
    return collect_rows(_jsonl_rows(lines, RowSpec(**spec)), file=file, split=split,
                        on_bad_row=on_bad_row)


def _parquet_rows(path: Path, spec: RowSpec) -> Iterator[tuple[int, Any, str | None]]:
    """(row number, (prompt, gold) or None, why) per Parquet row."""
    import pyarrow.parquet as pq  # only a job with a Parquet file pays for the import

    source = pq.ParquetFile(path)
    names = source.schema_arrow.names
    # Only the top-level columns the keys start from are read (a wide file stays cheap).
    columns = []
    for key in (spec.prompt_key, spec.answer_key):
        column = key if key in names else key.partition(".")[0]
        if column not in names:
            raise ValueError(f"{path} has no column {column!r} (task.prompt_key/answer_key "
                             f"{key!r}; its columns: {', '.join(names)})")
        columns.append(column)
    number = 0
    for batch in source.iter_batches(batch_size=_PARQUET_BATCH_ROWS,
                                     columns=list(dict.fromkeys(columns))):
        for obj in batch.to_pylist():
            number += 1
            yield (number, *check_row(obj, spec))


def read_rows(path: str, *, field: str, split: str, on_bad_row: str = "skip",
              **spec: Any) -> Rows:
    """The rows of a .parquet or JSONL file; a missing file is named by its config field."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{field}={path!r} is not a file")
    if file.suffix == ".parquet":
        return collect_rows(_parquet_rows(file, RowSpec(**spec)), file=str(file), split=split,
                            on_bad_row=on_bad_row)
    with open(file, "rb") as f:
        return parse_rows(f, file=str(file), split=split, on_bad_row=on_bad_row, **spec)


class DatasetStream:
    """An endless stream over a fixed list of problems: one seeded shuffle per epoch.

    Position k of the stream is row perm_e[k mod n] of epoch e = k div n, so the
    stream is random-access: `cursor` (or `skip`) resumes it exactly where it was.
    """

    def __init__(self, problems: Sequence[Problem], seed: int, *, cursor: int = 0,
                 stream: str = "train"):
        if not problems:
            raise ValueError("a dataset stream needs at least one problem")
        self._problems, self._seed, self._stream = tuple(problems), seed, stream
        self.cursor = cursor
        self._epoch, self._order = -1, ()

    def _at(self, position: int) -> Problem:
        n = len(self._problems)
        epoch, i = divmod(position, n)
        if epoch != self._epoch:
            order = list(range(n))
            random.Random(f"{self._seed}:{self._stream}:epoch{epoch}").shuffle(order)
            self._epoch, self._order = epoch, tuple(order)
        p = self._problems[self._order[i]]
        # A row recurs every epoch; the cursor keeps each draw's uid unique.
        return Problem(uid=f"{p.uid}@{position}", prompt=p.prompt, answer=p.answer,
                       level=p.level)

    def take(self, n: int) -> list[Problem]:
        out = [self._at(self.cursor + k) for k in range(n)]
        self.cursor += n
        return out

    def skip(self, n: int) -> None:
        """Moves on as if `take(n)` had been called (a restarted controller catching up)."""
        self.cursor += n


def held_out_split(problems: Sequence[Problem], count: int, seed: int
                   ) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): `count` problems drawn by the seed for eval; training keeps the rest,
    minus any row whose prompt is an eval prompt."""
    chosen = sorted(random.Random(f"{seed}:eval").sample(range(len(problems)), count))
    eval_set = [problems[i] for i in chosen]
    prompts = {p.prompt for p in eval_set}
    return [p for p in problems if p.prompt not in prompts], eval_set


def split_task(train: Rows, eval_rows: Rows | None, *, num_eval: int, seed: int
               ) -> tuple[list[Problem], list[Problem]]:
    """(train problems, eval set) for a dataset task; an empty side is an error."""
    if eval_rows is None:
        if len(train.problems) <= num_eval:
            raise ValueError(f"{train.file} has {len(train.problems)} valid rows; holding out "
                             f"task.num_eval={num_eval} for evaluation leaves none to train on "
                             "(lower --task.num-eval or pass --task.eval-dataset)")
        return held_out_split(train.problems, num_eval, seed)
    eval_set = list(eval_rows.problems[:num_eval])
    prompts = {p.prompt for p in eval_set}
    problems = [p for p in train.problems if p.prompt not in prompts]
    if not problems:
        raise ValueError(f"every valid row of {train.file} is also in the eval set "
                         f"{eval_rows.file}")
    return problems, eval_set


def check_synthetic_prompts(problems: Sequence[Problem], prompt_tokens: Callable[[str], int],
                            prompt_budget: int) -> None:
    """The synthetic task's prompts are generated, not read, so a bad one is a bad setting
    (task.prompt_format, system_prompt, the context), named here, not a skipped row."""
    for p in problems:
        try:
            n = prompt_tokens(p.prompt)
        except UnrepresentablePrompt as err:
            raise ValueError(f"the synthetic task's prompt {p.prompt!r} cannot be tokenized "
                             f"faithfully with task.prompt_format: {err}") from None
        if n > prompt_budget:
            raise ValueError(f"the synthetic task's prompt {p.prompt!r} is {n} tokens; at "
                             f"most {prompt_budget} fit (the context less max_new_tokens)")


def load_task(task: TaskConfig, *, seed: int, prompt_tokens: Callable[[str], int],
              prompt_budget: int, run_dir: Path) -> tuple[DatasetStream | PromptStream,
                                                          list[Problem]]:
    """The training stream and eval set the config names: the synthetic task, or data
    files, every row read and checked (`prompt_tokens`: the length of a prompt as the
    model sees it; it may raise UnrepresentablePrompt). Skipped rows go to
    run_dir/bad_rows.jsonl and are summarised once. Call it before starting any role."""
    if not task.dataset:
        eval_set = eval_problems(task.seed, task.num_eval, task.min_level, task.max_level)
        check_synthetic_prompts(eval_set, prompt_tokens, prompt_budget)
        return PromptStream(task.seed + seed, task.min_level, task.max_level,
                            held_out=frozenset(p.prompt for p in eval_set)), eval_set
    kwargs = dict(prompt_key=task.prompt_key, answer_key=task.answer_key,
                  answer_format=task.answer_format, prompt_tokens=prompt_tokens,
                  prompt_budget=prompt_budget, on_bad_row=task.on_bad_row)
    train = read_rows(task.dataset, field="task.dataset", split="train", **kwargs)
    eval_rows = (read_rows(task.eval_dataset, field="task.eval_dataset", split="eval", **kwargs)
                 if task.eval_dataset else None)
    report_bad_rows([r for r in (train, eval_rows) if r is not None], run_dir / "bad_rows.jsonl")
    problems, eval_set = split_task(train, eval_rows, num_eval=task.num_eval, seed=task.seed)
    return DatasetStream(problems, task.seed + seed), eval_set


def report_bad_rows(files: Sequence[Rows], path: Path) -> None:
    """One line per file with skipped rows; every skipped row, with its reason, to `path`."""
    with open(path, "w") as out:
        for rows in files:
            for bad in rows.bad:
                out.write(json.dumps(asdict(bad)) + "\n")
            if rows.bad:
                shown = ", ".join(str(b.row) for b in rows.bad[:10])
                more = f" and {len(rows.bad) - 10} more" if len(rows.bad) > 10 else ""
                # Rows, not lines: a blank line is neither good nor bad.
                total = len(rows.problems) + len(rows.bad)
                print(f"fnrl: skipped {len(rows.bad)} of {total} rows of {rows.file} "
                      f"(rows {shown}{more}; first: {rows.bad[0].reason}); see {path}",
                      flush=True)
