"""Prompts from JSONL files: `--task.dataset train.jsonl [--task.eval-dataset eval.jsonl]`.

Each line is one row, `{"prompt": "...", "answer": "..."}` (field names set by
`task.prompt_key` / `task.answer_key`). A malformed row (bad JSON or UTF-8, not an
object, a field missing, empty or not a string, a prompt longer than the model can
take) is skipped and recorded with its line number, or, with `task.on_bad_row=error`,
stops the job naming the file, line and reason. A file with no valid row is an error.

Without an eval file, `task.num_eval` rows drawn by the seed are held out of the
training file; with one, its first `task.num_eval` rows are the eval set. Training
never sees a prompt of the eval set.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from fnrl.config import TaskConfig
from fnrl.data.arith import PromptStream, eval_problems
from fnrl.types import Problem


@dataclass(frozen=True)
class BadRow:
    """A skipped row: its file, its 1-based line number and why."""

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


def _field(obj: dict, key: str) -> tuple[str | None, str | None]:
    """(value, None) for a non-empty string field, else (None, why not)."""
    if key not in obj:
        return None, f"missing field {key!r}"
    value = obj[key]
    if not isinstance(value, str):
        return None, f"field {key!r} is not a string (got {type(value).__name__})"
    if not value.strip():
        return None, f"field {key!r} is empty"
    return value, None


def parse_row(line: bytes, *, prompt_key: str, answer_key: str,
              prompt_tokens: Callable[[str], int] | None = None,
              prompt_budget: int | None = None) -> tuple[tuple[str, str] | None, str | None]:
    """((prompt, answer), None) for a valid row, else (None, the reason it is bad)."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 ({err.reason} at byte {err.start})"
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err.msg} at column {err.colno})"
    if not isinstance(obj, dict):
        return None, f"not a JSON object (got {type(obj).__name__})"
    prompt, why = _field(obj, prompt_key)
    if why is None:
        answer, why = _field(obj, answer_key)
    if why is not None:
        return None, why
    if prompt_tokens is not None and prompt_budget is not None:
        n = prompt_tokens(prompt)
        if n > prompt_budget:
            return None, f"prompt is {n} tokens; at most {prompt_budget} fit"
    return (prompt, answer), None


def parse_rows(lines: Iterable[bytes], *, file: str, split: str, prompt_key: str = "prompt",
               answer_key: str = "answer", prompt_tokens: Callable[[str], int] | None = None,
               prompt_budget: int | None = None, on_bad_row: str = "skip") -> Rows:
    """Problems from JSONL lines (uids `{split}-row{N}`); blank lines are not rows."""
    problems, bad, count = [], [], 0
    for count, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        # Without its newline a truncated row's JSON error points into the row.
        parsed, why = parse_row(line.rstrip(b"\r\n"), prompt_key=prompt_key, answer_key=answer_key,
                                prompt_tokens=prompt_tokens, prompt_budget=prompt_budget)
        if why is not None:
            if on_bad_row == "error":
                raise BadRowError(f"{file}, row {count}: {why} (task.on_bad_row='error'; "
                                  f"'skip' skips bad rows and records them)")
            bad.append(BadRow(file, count, why))
            continue
        prompt, answer = parsed
        problems.append(Problem(uid=f"{split}-row{count}", prompt=prompt, answer=answer, level=0))
    if not problems:
        raise ValueError(f"{file} has no valid row ({count} lines, {len(bad)} bad"
                         + (f"; row {bad[0].row}: {bad[0].reason}" if bad else "") + ")")
    return Rows(file, tuple(problems), tuple(bad), count)


def read_rows(path: str, *, field: str, **kwargs) -> Rows:
    """`parse_rows` over a file; a missing file is named by its config field."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{field}={path!r} is not a file")
    with open(file, "rb") as f:
        return parse_rows(f, file=str(file), **kwargs)


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


def load_task(task: TaskConfig, *, seed: int, prompt_tokens: Callable[[str], int],
              prompt_budget: int, run_dir: Path) -> tuple[DatasetStream | PromptStream,
                                                          list[Problem]]:
    """The training stream and eval set the config names: the synthetic arithmetic task,
    or JSONL files. Skipped rows go to run_dir/bad_rows.jsonl and are summarised once."""
    if not task.dataset:
        eval_set = eval_problems(task.seed, task.num_eval, task.min_level, task.max_level)
        return PromptStream(task.seed + seed, task.min_level, task.max_level,
                            held_out=frozenset(p.prompt for p in eval_set)), eval_set
    kwargs = dict(prompt_key=task.prompt_key, answer_key=task.answer_key,
                  prompt_tokens=prompt_tokens, prompt_budget=prompt_budget,
                  on_bad_row=task.on_bad_row)
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
                print(f"fnrl: skipped {len(rows.bad)} of {rows.lines} rows of {rows.file} "
                      f"(rows {shown}{more}; first: {rows.bad[0].reason}); see {path}",
                      flush=True)
