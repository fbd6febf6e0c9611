"""The calculator evaluates arithmetic and refuses everything else, within bounds."""

import pytest

from fnrl.envs.calculator import CalcError, calculate, evaluate


@pytest.mark.parametrize("expr, value", [
    ("12*34", 408), ("4721*389", 1836469), ("(1+2)*3", 9), ("-7+2", -5), ("7/2", 3.5),
    ("7//2", 3), ("7%3", 1), ("2**10", 1024), (" 3 * ( 4 - 1 ) ", 9), ("1.5*2", 3.0),
])
def test_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, why", [
    ("__import__('os')", "not arithmetic"), ("x+1", "not arithmetic"),
    ("'a'*3", "not arithmetic"), ("1/0", "division by zero"), ("9**9**9", "exponent"),
    ("-" * 40 + "1", "deeper"), ("1+", "cannot parse"), ("1" * 300, "longer"),
    ("10**200", "digits"), ("[1][0]", "not arithmetic"),
])
def test_refuses(expr, why):
    with pytest.raises(CalcError, match=why):
        evaluate(expr)


def test_reply_text():
    assert calculate("12*34") == "408"
    assert calculate("6/3") == "2"          # an integral float is written as an integer
    assert calculate("1/3") == "0.333333333333"
    assert calculate("abs(1)").startswith("error: not arithmetic")
