"""Tool calls in the model's text, and the observations that answer them: pure functions.

Two formats, registered by name in `TOOL_FORMATS`:
- "calc": `<calc>12*34</calc>`, answered by `<result>408</result>`. Short and regular
  enough for the embedded character-level model to learn from a few demonstrations; the
  call always means the calculator tool, its text the expression.
- "hermes": the Qwen / Hermes convention, `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, answered by `<tool_response>...</tool_response>`. A chat model also
  needs the turn markers of its template around the response; the renderer that owns
  the template adds them (the observation here is only the tool's part).

Generation stops at a format's closing tag (`stop`), so one sampled turn holds at most
one finished call at its end; parsing still accepts several. A call that is opened but
malformed (bad JSON, no name) is an error the model is told about, never a silent no-op.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One parsed call: the tool's registered name and its JSON-like arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ParsedAction:
    """What a sampled turn asks for: its tool calls, and the malformed ones' errors."""

    text: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.errors)


@dataclass(frozen=True, kw_only=True)
class ToolFormat:
    """How calls are written and answered in one convention."""

    name: str
    stop: tuple[str, ...]
    parse: Callable[[str], ParsedAction]
    render: Callable[[str], str]
    """A tool's reply text -> the observation text fed back to the model."""


_CALC = re.compile(r"<calc>(.*?)</calc>", re.S)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_calc(text: str) -> ParsedAction:
    """`<calc>expr</calc>` spans -> calculator calls. An empty expression is an error, and
    so is a `<calc>` never closed (a misspelt or missing `</calc>`): an attempted call
    that failed, which the model is told of and the success rate counts."""
    calls, errors = [], []
    for m in _CALC.finditer(text):
        expr = m.group(1).strip()
        if expr:
            calls.append(ToolCall(name="calculator", arguments={"expression": expr}))
        else:
            errors.append("empty <calc></calc>")
    return ParsedAction(text=text, calls=tuple(calls),
                        errors=(*errors, *_unclosed(text, _CALC, "<calc>", "</calc>")))


def _unclosed(text: str, spans: re.Pattern, opening: str, closing: str) -> list[str]:
    """An error for each `opening` after the last closed span: a call never closed."""
    end = max((m.end() for m in spans.finditer(text)), default=0)
    return [f"{opening} is never closed by {closing}"] * text.count(opening, end)


def _hermes_call(body: str) -> ToolCall | str:
    """One `<tool_call>` body -> a ToolCall, or the error text for the model."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"tool call is not JSON: {e.msg} at char {e.pos}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return 'tool call needs {"name": str, "arguments": object}'
    args = obj.get("arguments", {})
    if isinstance(args, str):   # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"arguments of {obj['name']} are not JSON"
    if not isinstance(args, dict):
        return f"arguments of {obj['name']} must be an object, got {type(args).__name__}"
    return ToolCall(name=obj["name"], arguments=args)


def parse_hermes(text: str) -> ParsedAction:
    """`<tool_call>{json}</tool_call>` spans -> calls; malformed or unclosed ones -> errors."""
    calls, errors = [], []
    for m in _HERMES.finditer(text):
        got = _hermes_call(m.group(1).strip())
        (calls if isinstance(got, ToolCall) else errors).append(got)
    errors += _unclosed(text, _HERMES, "<tool_call>", "</tool_call>")
    return ParsedAction(text=text, calls=tuple(calls), errors=tuple(errors))


TOOL_FORMATS: dict[str, ToolFormat] = {
    "calc": ToolFormat(name="calc", stop=("</calc>",), parse=parse_calc,
                       render=lambda reply: f"<result>{reply}</result>"),
    "hermes": ToolFormat(name="hermes", stop=("</tool_call>",), parse=parse_hermes,
                         render=lambda reply: f"<tool_response>\n{reply}\n</tool_response>"),
}


def tool_format(name: str) -> ToolFormat:
    """The registered format `name`; a ValueError lists the known ones."""
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]
