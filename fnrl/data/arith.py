"""A synthetic, verifiable reasoning task: column arithmetic worked digit by digit.

A problem is an addition, subtraction or multiplication by one digit of numbers of
one to nine digits ("4721+389="). Its worked solution, what the warm start's teacher
demonstrates and the policy learns to write, takes one line per column, from the units
up; each line restates what is left of the operands, does one single-digit step with
its carry (or borrow), and keeps the digits of the result so far, and a last line
gives the answer:

    4721+389 c0: 1+9+0=10, r=0
    472+38 c1: 2+8+1=11, r=10
    47+3 c1: 7+3+1=11, r=110
    4+0 c1: 4+0+1=5, r=5110
    #### 5110

Every step is local (copy the previous line's operands less their last digit, one
single-digit fact, prepend one digit), so a tiny model can learn it; the solution's
length grows with the square of the operands' length, and that length is drawn from a
skewed distribution (most problems one or two digits, a few nine), so the natural
response lengths are long-tailed: a median of about 50 tokens, a p99 above 250.
Levels: 1 = addition, 2 = subtraction (never below zero), 3 = multiplication by a
single digit.

The tokenizer is character level over printable ASCII and newline, built with
`tokenizers`, and saved as a `tokenizer.json` that both fnrl and vLLM load.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from fnrl.types import Problem

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
SPECIAL = (PAD, EOS, BOS)
# Printable ASCII (space included) and newline: any short English prompt is representable.
ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
LEVELS = {1: "+", 2: "-", 3: "*"}
MAX_DIGITS = 9
# P(the longer operand has n digits) ∝ 2^-n + 1.5%: one or two digits typically, nine
# now and then, which makes the response lengths long-tailed.
SIZE_WEIGHTS = tuple(0.5 ** n + 0.015 for n in range(1, MAX_DIGITS + 1))
# Held-out problems have at least two digits: single-digit problems are so few (a few
# hundred) that holding some out would take a third of the short ones from training.
EVAL_MIN_DIGITS = 2


def build_tokenizer() -> Tokenizer:
    """Character-level tokenizer: one id per character, special tokens first."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + tuple(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    # Every character, the newline included ("." would skip it).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins characters back without inserted spaces, so decode(encode(s)) == s.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL))
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """Writes tokenizer.json plus the HF side files that vLLM/transformers expect."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": PAD}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
         "clean_up_tokenization_spaces": False, **special}, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def _digits(rng: random.Random, n: int) -> int:
    """A number of exactly n digits (0-9 for n = 1)."""
    return rng.randint(0, 9) if n == 1 else rng.randint(10 ** (n - 1), 10 ** n - 1)


def _operands(rng: random.Random, level: int, min_digits: int) -> tuple[int, int]:
    sizes = range(min_digits, MAX_DIGITS + 1)
    n = rng.choices(sizes, weights=SIZE_WEIGHTS[min_digits - 1:])[0]
    if level == 3:
        return _digits(rng, n), rng.randint(2, 9)
    a, b = _digits(rng, n), _digits(rng, rng.randint(1, n))
    return (max(a, b), min(a, b)) if level == 2 else (a, b)


def make_problem(rng: random.Random, level: int, uid: str, *, min_digits: int = 1) -> Problem:
    """One problem of the given level (1 = a+b, 2 = a-b with a >= b, 3 = a*d), its
    longer operand of `min_digits` digits or more."""
    a, b = _operands(rng, level, min_digits)
    op = LEVELS[level]
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Problem(uid=uid, prompt=f"{a}{op}{b}=", answer=str(value), level=level)


def _parse(prompt: str) -> tuple[str, str, str]:
    for op in "+-*":
        left, sep, right = prompt.rstrip("=").partition(op)
        if sep and left.isdigit() and right.isdigit():
            return left, op, right
    raise ValueError(f"not a problem of this task: {prompt!r}")


def worked_steps(prompt: str) -> tuple[list[str], str]:
    """The column-by-column lines of a problem's solution and its final answer."""
    a, op, b = _parse(prompt)
    lines, result, carry = [], "", 0
    # One line per column; a carry left after the last column takes one more.
    while a or (b and op != "*") or carry:
        x = int(a[-1]) if a else 0
        y = int(b) if op == "*" else int(b[-1]) if b else 0
        if op == "-":   # a borrow writes the column as 1x: every step stays non-negative
            nxt = int(x - y - carry < 0)
            x += 10 * nxt
            digit = x - y - carry
            step = f"{x}-{y}-{carry}={digit}"
        else:
            s = x * y + carry if op == "*" else x + y + carry
            step, digit, nxt = f"{x}{op}{y}+{carry}={s}", s % 10, s // 10
        result = f"{digit}{result}"
        lines.append(f"{a or 0}{op}{b if op == '*' else b or 0} c{carry}: {step}, r={result}")
        a, carry = a[:-1], nxt
        if op != "*":
            b = b[:-1]
    return lines, str(int(result))   # int(): a difference loses its leading zeros


def solution(prompt: str, *, slip: bool = False) -> str:
    """The worked solution ending in "#### answer". `slip`: the imperfect teacher's
    habit, an answer line with a stray trailing zero (a place-value slip)."""
    lines, answer = worked_steps(prompt)
    return "\n".join(lines + [f"#### {answer}{'0' if slip else ''}"])


# The longest worked solution (nine-digit operands, a carry out of every column):
# algo.max_new_tokens must leave room for it and its EOS.
MAX_RESPONSE_CHARS = len(solution(f"{'9' * MAX_DIGITS}+{'9' * MAX_DIGITS}="))

# The eval split is a prefix of a fixed pool, so changing num_eval never changes its items.
_EVAL_POOL = 1024


def eval_problems(seed: int, count: int, min_level: int, max_level: int) -> list[Problem]:
    """The held-out split: a reproducible list of distinct problems of two digits or
    more, cycling through the levels."""
    if not 0 < count <= _EVAL_POOL:
        raise ValueError(f"num_eval={count} must be in 1..{_EVAL_POOL}")
    rng = random.Random(f"{seed}:eval")
    span = max_level - min_level + 1
    pool: dict[str, Problem] = {}
    while len(pool) < count:   # distinct prompts: short problems would recur
        i = len(pool)
        p = make_problem(rng, min_level + i % span, uid=f"eval-{i}", min_digits=EVAL_MIN_DIGITS)
        pool.setdefault(p.prompt, p)
    return list(pool.values())


class PromptStream:
    """An endless, seeded stream of training problems with a resumable cursor."""

    def __init__(self, seed: int, min_level: int, max_level: int, *, held_out: frozenset[str],
                 cursor: int = 0, stream: str = "train"):
        self._seed, self._levels, self._stream = seed, (min_level, max_level), stream
        # Eval prompts are never trained on, so held-out accuracy means what it says.
        self._held_out = held_out
        self.cursor = cursor

    def take(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            # One RNG per cursor position makes the stream random-access (resume = set cursor).
            rng = random.Random(f"{self._seed}:{self._stream}:{self.cursor}")
            lo, hi = self._levels
            p = make_problem(rng, lo + self.cursor % (hi - lo + 1), uid=f"{self._stream}-{self.cursor}")
            self.cursor += 1
            if p.prompt not in self._held_out:
                out.append(p)
        return out

    def skip(self, n: int) -> None:
        """Moves on as if `take(n)` had been called (a restarted controller catching up)."""
        self.take(n)
