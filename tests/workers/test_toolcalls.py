"""Parsing the Qwen3/Hermes tool-call convention and formatting tool results."""

from __future__ import annotations

from workers.toolcalls import ToolCall, format_result, parse_tool_calls


def test_calls_are_read_in_order() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>{"name": "finish", "arguments": {}}</tool_call><|im_end|>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("bash", {"command": "ls"}), ToolCall("finish", {})]
    assert parsed.errors == []


def test_text_without_calls_has_none() -> None:
    parsed = parse_tool_calls("The answer is \\boxed{4}.")
    assert (parsed.calls, parsed.errors) == ([], [])


def test_json_encoded_arguments_are_accepted() -> None:
    parsed = parse_tool_calls(
        '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>'
    )
    assert parsed.calls == [ToolCall("bash", {"command": "pwd"})]


def test_missing_arguments_mean_none() -> None:
    assert parse_tool_calls('<tool_call>{"name": "finish"}</tool_call>').calls == [
        ToolCall("finish", {})
    ]


def test_each_kind_of_malformed_call_is_an_error_not_a_call() -> None:
    text = (
        "<tool_call>{not json}</tool_call>"
        '<tool_call>["bash"]</tool_call>'
        '<tool_call>{"name": "bash", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "bash", "arguments": {}}'
    )
    parsed = parse_tool_calls(text)
    assert parsed.calls == []
    assert len(parsed.errors) == 4
    assert "not valid JSON" in parsed.errors[0]
    assert 'string "name"' in parsed.errors[1]
    assert "must be a JSON object" in parsed.errors[2]
    assert "not closed" in parsed.errors[3]


def test_a_good_call_beside_a_bad_one_still_runs() -> None:
    parsed = parse_tool_calls(
        '<tool_call>oops</tool_call><tool_call>{"name": "finish"}</tool_call>'
    )
    assert parsed.calls == [ToolCall("finish", {})]
    assert len(parsed.errors) == 1


def test_bash_results_say_the_exit_code_and_timeouts() -> None:
    assert format_result("bash", {"output": "ok", "exit_code": 0}) == "ok"
    assert format_result("bash", {"output": "no", "exit_code": 2}) == "no\n[exit code 2]"
    timed = format_result("bash", {"output": "", "exit_code": None, "timed_out": True})
    assert "timed out" in timed
    reset = format_result(
        "bash", {"output": "", "exit_code": None, "timed_out": True, "reset": True}
    )
    assert "shell had to be restarted" in reset


def test_ipython_results_say_restarts_and_timeouts() -> None:
    text = format_result("ipython", {"output": "2", "status": "ok", "restarted": True})
    assert text.startswith("[the kernel had died and was restarted]")
    assert "timed out" in format_result("ipython", {"output": "", "status": "timeout"})
