"""Parsing tool calls from the model's text, and rendering their observations."""

import pytest

from fnrl.envs.tool_calls import TOOL_FORMATS, ToolCall, parse_calc, parse_hermes, tool_format


def test_calc_call():
    got = parse_calc("let me see <calc>4721*389</calc>")
    assert got.calls == (ToolCall(name="calculator", arguments={"expression": "4721*389"}),)
    assert got.errors == () and got.wants_tools


def test_calc_no_call_unclosed_and_empty():
    assert not parse_calc("#### 42").wants_tools
    unclosed = ("<calc> is never closed by </calc>",)
    misspelt = parse_calc("<calc>12*3</cal> #### 36")    # an attempted call that failed
    assert misspelt.calls == () and misspelt.errors == unclosed and misspelt.wants_tools
    assert parse_calc("<calc>12*3").errors == unclosed   # cut off
    after = parse_calc("<calc>1+1</calc> then <calc>2*")
    assert len(after.calls) == 1 and after.errors == unclosed
    empty = parse_calc("<calc> </calc>")
    assert empty.calls == () and empty.errors == ("empty <calc></calc>",) and empty.wants_tools


def test_calc_several_calls_in_order():
    got = parse_calc("<calc>1+1</calc> and <calc>\n2*3\n</calc>")
    assert [c.arguments["expression"] for c in got.calls] == ["1+1", "2*3"]


def test_hermes_call():
    text = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    assert parse_hermes(text).calls == (ToolCall(name="python", arguments={"code": "print(1)"}),)


def test_hermes_arguments_as_json_string():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*2\\"}"}</tool_call>'
    assert parse_hermes(text).calls[0].arguments == {"expression": "2*2"}


@pytest.mark.parametrize("body, error", [
    ("{not json}", "not JSON"), ('{"arguments": {}}', "needs"), ('["python"]', "needs"),
    ('{"name": "python", "arguments": [1]}', "must be an object"),
    ('{"name": "python", "arguments": "{bad"}', "are not JSON"),
])
def test_hermes_malformed_is_an_error_not_a_no_op(body, error):
    got = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert got.calls == () and len(got.errors) == 1 and error in got.errors[0]
    assert got.wants_tools


def test_render_and_stop():
    assert TOOL_FORMATS["calc"].render("408") == "<result>408</result>"
    assert TOOL_FORMATS["hermes"].render("ok") == "<tool_response>\nok\n</tool_response>"
    assert tool_format("calc").stop == ("</calc>",)
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        tool_format("xml")


def test_hermes_unclosed_call_is_an_error():
    got = parse_hermes('<tool_call>{"name": "python", "arguments": {}}</tool_call> <tool_call>{"na')
    assert len(got.calls) == 1 and got.errors == ("<tool_call> is never closed by </tool_call>",)
