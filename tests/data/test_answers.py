"""Answer extraction: GSM8K's `####`, MATH's last `\\boxed{...}`, the last number; and the
gold answer of GSM8K- and MATH-style rows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fnrl.data.answers import extract_answer, gold_answer, last_boxed, last_number

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
MATH_SOLUTION = ("We have $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$. Check: "
                 "$\\boxed{\\frac{1}{2}}$ is in lowest terms, so the answer is "
                 "$\\boxed{\\dfrac{\\sqrt{4}}{4}}$.")


@pytest.mark.parametrize("response, answer, source", [
    ("#### 72\nLet me know if you need 5 more", "72", "gsm8k"),
    ("She sold 72 clips.\n#### 72", "72", "gsm8k"),
    ("#### 72 clips.", "72", "gsm8k"),
    ("#### $1,234.50.", "1234.50", "gsm8k"),
    ("#### -7", "-7", "gsm8k"),
    ("#### \\frac{1}{2}.", "\\frac{1}{2}", "gsm8k"),
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", "boxed"),
    ("\\boxed{1} first, then \\boxed{\\frac{\\sqrt{2}}{2}} at last", "\\frac{\\sqrt{2}}{2}",
     "boxed"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}", "boxed"),   # escaped braces neither open nor close
    ("\\boxed{{x}^{2}+1}", "{x}^{2}+1", "boxed"),
    ("\\boxed {5}", "5", "boxed"),
    ("\\fbox{7}", "7", "boxed"),
    # Both markers: the later one is the model's last word.
    ("\\boxed{72}\n#### 73", "73", "gsm8k"),
    ("#### 73 and finally \\boxed{72}", "72", "boxed"),
    # The last-number fallback: commas between digit groups go, signs and decimals stay.
    ("It costs $1,000 in total", "1000", "number"),
    ("The temperature fell to -3 degrees, then 12,345,678.", "12345678", "number"),
    ("x=2.5.", "2.5", "number"),
    ("3/4 of them", "3/4", "number"),
    ("5-3 is two", "3", "number"),        # a minus between numbers is no sign
    ("pick 1,2,3", "3", "number"),        # not a thousands separator
    ("\\boxed{never closed 41", "41", "number"),
])
def test_extract_answer(response, answer, source):
    found = extract_answer(response)
    assert (found.answer, found.source) == (answer, source)
    assert found.marked == (source != "number")


def test_no_answer_and_no_fallback():
    assert extract_answer("I do not know.") == extract_answer("")
    assert extract_answer("").answer is None and extract_answer("").source is None
    found = extract_answer("It is 42.", number_fallback=False)
    assert found.answer is None and not found.marked
    assert extract_answer("#### 42", number_fallback=False).answer == "42"


@given(st.integers(-10**9, 10**9))
def test_last_number_reads_any_integer_with_or_without_commas(n):
    assert last_number(f"so we get {n}.") == str(n)
    assert last_number(f"so we get {n:,}!") == str(n)
    assert last_boxed(f"\\boxed{{{n:,}}}") == f"{n:,}"


@pytest.mark.parametrize("text, fmt, gold", [
    (GSM8K_ANSWER, "auto", "72"),
    (GSM8K_ANSWER, "gsm8k", "72"),
    ("so 1,000 + 72 = 1,072\n#### 1,072", "auto", "1072"),
    (MATH_SOLUTION, "auto", "\\dfrac{\\sqrt{4}}{4}"),
    (MATH_SOLUTION, "boxed", "\\dfrac{\\sqrt{4}}{4}"),
    ("  72 \n", "auto", "72"),
    ("\\frac{1}{2}", "raw", "\\frac{1}{2}"),
    (GSM8K_ANSWER, "raw", GSM8K_ANSWER),
])
def test_gold_answer_of_gsm8k_and_math_rows(text, fmt, gold):
    assert gold_answer(text, fmt) == (gold, None)


@pytest.mark.parametrize("text, fmt, why", [
    ("72", "gsm8k", "answer has no '####' (answer_format='gsm8k')"),
    ("it is 72\n####  ", "auto", "answer has nothing after its last '####'"),
    ("72", "boxed", "answer has no \\boxed{...} (answer_format='boxed')"),
    ("\\boxed{}", "auto", "answer's last \\boxed{...} is empty or never closes"),
    ("\\boxed{72", "boxed", "answer's last \\boxed{...} is empty or never closes"),
])
def test_answer_fields_without_a_gold_answer(text, fmt, why):
    assert gold_answer(text, fmt) == (None, why)


def test_unknown_answer_format_is_refused():
    with pytest.raises(ValueError, match="answer_format='latex'"):
        gold_answer("72", "latex")
