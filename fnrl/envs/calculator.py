"""A safe arithmetic evaluator: the calculator tool, with no `eval` of arbitrary code.

The expression is parsed with `ast` and only numbers, parentheses, unary +/- and the
binary operators + - * / // % ** are walked; anything else (names, calls, attributes,
subscripts, strings) is refused. Sizes are bounded so that a hostile expression cannot
hang the caller: the text length, the nesting depth, every intermediate integer's digits
and the exponent of `**`. It is a pure function, cheap enough to run on the event loop
(see fnrl.envs.base.InlineCalculator) or inside the sandbox (fnrl.sandbox).
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPR_CHARS = 200
MAX_DEPTH = 32
MAX_INT_DIGITS = 60
MAX_EXPONENT = 256

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """The expression is not plain arithmetic, or is out of the calculator's bounds."""


def _bounded(value: int | float) -> int | float:
    if isinstance(value, int) and abs(value) >= 10 ** MAX_INT_DIGITS:
        raise CalcError(f"result has more than {MAX_INT_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is not finite")
    return value


def _walk(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise CalcError(f"expression nests deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left, depth + 1), _walk(node.right, depth + 1)
        # 9**9**9 would run for minutes before any digit bound could be checked.
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent {right} is above {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("result overflows") from None
    raise CalcError(f"not arithmetic: {ast.dump(node)[:60]}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression ("12*34" -> 408); raises CalcError."""
    if len(expression) > MAX_EXPR_CHARS:
        raise CalcError(f"expression is longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        why = e.msg if isinstance(e, SyntaxError) else str(e)
        raise CalcError(f"cannot parse {expression!r}: {why}") from None
    return _walk(tree.body, 0)


def format_value(value: int | float) -> str:
    """How the calculator writes a value: integers in full, an integral float without
    ".0", other floats to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 10 ** 15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculate(expression: str) -> str:
    """The calculator tool's reply text: the formatted value, or "error: ..."."""
    try:
        return format_value(evaluate(expression))
    except CalcError as e:
        return f"error: {e}"
