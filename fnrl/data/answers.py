"""Final answers in math text: the gold answer of a data row, and a model response's answer.

Grading a whole response is wrong as soon as a response says more than its answer:
math-verify on "#### 72\\nLet me know if you need 5 more" reads 5. So the answer is
extracted first, by the markers math data uses:

- GSM8K: the text after "####" on its line ("#### 72" -> "72");
- MATH: the contents of the last `\\boxed{...}` (or `\\fbox{...}`), braces nested;
- else, for responses, the last number in the text ("1,000" -> "1000", "-3", "2.5", "3/4").

When a response has both markers, the later one is its answer (the model's last word).
Everything here is pure string work; fnrl.data.reward grades what it returns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

ANSWER_FORMATS = ("auto", "gsm8k", "boxed", "raw")
GSM8K_MARKER = "####"
_BOX_COMMANDS = ("\\boxed", "\\fbox")

# A number as written in prose: optional sign and dollar, digit groups with commas, a
# decimal part or a fraction. Commas only between groups of three, so "1,2" stays two.
_NUMBER = re.compile(r"(?<![\w.])(-?)\$?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:/(\d+))?")


@dataclass(frozen=True)
class Extracted:
    """A response's answer and where it came from: "gsm8k" (`####`), "boxed", "number"
    (the last-number fallback) or None (no answer found: `answer` is None)."""

    answer: str | None
    source: Literal["gsm8k", "boxed", "number"] | None

    @property
    def marked(self) -> bool:
        """Whether the answer was stated with a marker, not guessed from a number."""
        return self.source in ("gsm8k", "boxed")


def _box_start(text: str) -> tuple[int, int] | None:
    """(start of the last box command, index just after its opening brace), or None."""
    best = None
    for command in _BOX_COMMANDS:
        pos = text.rfind(command)
        while pos >= 0:
            after = pos + len(command)
            rest = len(text[after:]) - len(text[after:].lstrip(" "))
            if after + rest < len(text) and text[after + rest] == "{":
                if best is None or pos > best[0]:
                    best = (pos, after + rest + 1)
                break
            pos = text.rfind(command, 0, pos)
    return best


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (nested braces kept whole), or None when
    there is none or its braces never close."""
    found = _box_start(text)
    if found is None:
        return None
    depth, start = 1, found[1]
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character (`\{`, `\}`) opens or closes nothing
            continue
        depth += 1 if ch == "{" else -1 if ch == "}" else 0
        if depth == 0:
            return text[start:i].strip()
        i += 1
    return None


def _number_text(match: re.Match) -> str:
    sign, whole, decimals, denominator = match.groups()
    text = sign + whole.replace(",", "") + (decimals or "")
    return f"{text}/{denominator}" if denominator else text


def last_number(text: str) -> str | None:
    """The last number in the text, commas dropped ("1,000" -> "1000"), or None."""
    matches = list(_NUMBER.finditer(text))
    return _number_text(matches[-1]) if matches else None


def after_marker(text: str) -> str | None:
    """What follows the last "####" on its line: its leading number when the line starts
    with one ("#### 72 apples." -> "72"), else the line stripped; None if no marker or
    nothing follows it."""
    pos = text.rfind(GSM8K_MARKER)
    if pos < 0:
        return None
    line = text[pos + len(GSM8K_MARKER):].split("\n", 1)[0].strip()
    first = _NUMBER.match(line)
    if first is not None and first.start() == 0:
        return _number_text(first)
    line = line.rstrip(".").strip()
    return line or None


def extract_answer(response: str, *, number_fallback: bool = True) -> Extracted:
    """The final answer of a model response: the later of its `####` and `\\boxed{}`
    answers, else (when `number_fallback`) its last number."""
    marker_at, box = response.rfind(GSM8K_MARKER), _box_start(response)
    marked = after_marker(response) if marker_at >= 0 else None
    boxed = last_boxed(response) if box is not None else None
    if marked is not None and (boxed is None or marker_at > box[0]):
        return Extracted(marked, "gsm8k")
    if boxed:
        return Extracted(boxed, "boxed")
    if marked is not None:
        return Extracted(marked, "gsm8k")
    number = last_number(response) if number_fallback else None
    return Extracted(number, "number" if number is not None else None)


def resolve_format(text: str, answer_format: str) -> str:
    """The concrete format `auto` stands for, given the answer field's text."""
    if answer_format != "auto":
        return answer_format
    if GSM8K_MARKER in text:
        return "gsm8k"
    return "boxed" if _box_start(text) is not None else "raw"


def gold_answer(text: str, answer_format: str = "auto") -> tuple[str | None, str | None]:
    """(gold answer, None) from a row's answer field, else (None, why it has none).

    gsm8k: after the last "####"; boxed: the last `\\boxed{...}`; raw: the field
    stripped; auto: gsm8k if the field has "####", else boxed if it has a box, else raw.
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format={answer_format!r}: must be one of {ANSWER_FORMATS}")
    fmt = resolve_format(text, answer_format)
    if fmt == "gsm8k":
        pos = text.rfind(GSM8K_MARKER)
        gold = text[pos + len(GSM8K_MARKER):].strip() if pos >= 0 else None
        if not gold:
            return None, ("answer has no '####' (answer_format='gsm8k')" if pos < 0
                          else "answer has nothing after its last '####'")
        return gold.replace(",", "") if _NUMBER.fullmatch(gold) else gold, None
    if fmt == "boxed":
        gold = last_boxed(text)
        if not gold:
            return None, ("answer has no \\boxed{...} (answer_format='boxed')"
                          if _box_start(text) is None else "answer's last \\boxed{...} is "
                          "empty or never closes")
        return gold, None
    return text.strip(), None
