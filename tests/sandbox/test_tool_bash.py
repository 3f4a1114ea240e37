"""The bash tool: a persistent shell behind a pty, reached through a real tool server."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox.toolclient import ToolClient
from tests.support.wait import wait_until

if TYPE_CHECKING:
    from tests.support.toolserver import StartToolServer, ToolServerProcess


def bash(client: ToolClient, command: str, timeout: float = 10.0) -> dict[str, Any]:
    return client.call("bash", command=command, timeout=timeout)


def test_working_directory_persists_between_calls(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    (toolserver.workdir / "sub").mkdir()
    bash(client, "cd sub")
    assert bash(client, "pwd")["output"] == f"{toolserver.workdir / 'sub'}\n"


def test_environment_persists_between_calls(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    bash(client, "export GREETING=hello; UNEXPORTED=there")
    assert bash(client, 'echo "$GREETING $UNEXPORTED"')["output"] == "hello there\n"


def test_exit_code_of_the_last_command_comes_back(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    assert bash(client, "true")["exit_code"] == 0
    assert bash(client, "false")["exit_code"] == 1
    assert bash(client, "(exit 42)")["exit_code"] == 42


def test_failing_command_returns_its_stderr(toolserver: ToolServerProcess) -> None:
    result = bash(toolserver.client(), "ls /definitely/not/here")
    assert result["exit_code"] == 2
    assert "No such file or directory" in result["output"]


def test_output_is_exactly_what_the_command_printed(toolserver: ToolServerProcess) -> None:
    # No echo of the typed command, no prompt, no carriage returns.
    result = bash(toolserver.client(), "echo hello")
    assert result == {
        "output": "hello\n",
        "exit_code": 0,
        "timed_out": False,
        "truncated": False,
        "reset": False,
    }


def test_output_without_a_final_newline_is_kept(toolserver: ToolServerProcess) -> None:
    assert bash(toolserver.client(), "printf 'no newline'")["output"] == "no newline"


def test_ansi_escape_sequences_are_removed(toolserver: ToolServerProcess) -> None:
    output = bash(toolserver.client(), r"printf '\033[1;31mred\033[0m \033]0;title\007plain\n'")
    assert output["output"] == "red plain\n"


def test_multi_line_command_runs_every_line(toolserver: ToolServerProcess) -> None:
    result = bash(toolserver.client(), "echo one\necho two\nfor i in 1 2; do\n  echo $i\ndone")
    assert result["output"] == "one\ntwo\n1\n2\n"


def test_heredoc_is_passed_through_verbatim(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    command = (
        "cat > notes.txt <<'EOF'\nquote ' and \\ backslash\n  indented $HOME\nEOF\ncat notes.txt"
    )
    assert bash(client, command)["output"] == "quote ' and \\ backslash\n  indented $HOME\n"


def test_command_longer_than_a_terminal_line_runs(toolserver: ToolServerProcess) -> None:
    body = "".join(f"line {i:05d} {'x' * 60}\n" for i in range(300))  # ~21 kB
    command = f"cat > big.txt <<'EOF'\n{body}EOF\nwc -l < big.txt"
    result = bash(toolserver.client(), command)
    assert result["output"].strip() == "300"
    assert (toolserver.workdir / "big.txt").read_text() == body


def test_syntax_error_returns_at_once(toolserver: ToolServerProcess) -> None:
    started = time.monotonic()
    result = bash(toolserver.client(), "if then fi", timeout=30)
    assert time.monotonic() - started < 5
    assert result["exit_code"] == 2
    assert "syntax error" in result["output"]


def test_timeout_interrupts_and_keeps_the_session(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    bash(client, "cd /tmp && export KEPT=yes")
    started = time.monotonic()
    result = bash(client, "sleep 100", timeout=0.5)
    assert time.monotonic() - started < 5
    assert result["timed_out"] is True
    assert result["exit_code"] is None
    assert result["reset"] is False
    assert bash(client, 'pwd; echo "$KEPT"')["output"] == "/tmp\nyes\n"


def test_cat_waiting_for_input_times_out_and_recovers(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    result = bash(client, "cat", timeout=0.5)
    assert result["timed_out"] is True
    assert result["reset"] is False
    assert bash(client, "echo still here")["output"] == "still here\n"


def test_interactive_python_times_out_and_recovers(toolserver: ToolServerProcess) -> None:
    # The REPL survives Ctrl-C, so its process group is killed; the shell itself is kept.
    client = toolserver.client()
    bash(client, "cd /tmp")
    result = bash(client, "python3", timeout=0.5)
    assert result["timed_out"] is True
    assert result["reset"] is False
    assert bash(client, "pwd")["output"] == "/tmp\n"


def test_background_job_returns_promptly(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    result = bash(client, "sleep 100 &", timeout=30)
    assert result["timed_out"] is False and result["exit_code"] == 0
    assert bash(client, "jobs")["output"].count("sleep 100") == 1


def test_shell_ignoring_interrupt_is_replaced(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    bash(client, "cd /tmp")
    result = bash(client, "trap '' INT; while :; do :; done", timeout=0.3)
    assert result["timed_out"] is True
    assert result["reset"] is True
    assert bash(client, "pwd")["output"] == f"{toolserver.workdir}\n"


def test_exit_reports_its_code_and_starts_a_new_shell(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    bash(client, "cd /tmp")
    result = bash(client, "exit 3")
    assert (result["exit_code"], result["reset"]) == (3, True)
    assert bash(client, "pwd")["output"] == f"{toolserver.workdir}\n"


def test_redirecting_the_shell_output_does_not_hang(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    result = bash(client, "exec >/dev/null; echo hidden", timeout=5)
    assert (result["output"], result["exit_code"], result["timed_out"]) == ("", 0, False)
    assert bash(client, "echo to-stderr >&2", timeout=5)["output"] == "to-stderr\n"


def test_huge_output_is_truncated_with_a_marker(toolserver: ToolServerProcess) -> None:
    result = bash(toolserver.client(), "yes 0123456789 | head -c 3000000", timeout=30)
    assert result["truncated"] is True
    assert result["exit_code"] == 0
    output = result["output"]
    assert len(output) < 101_000
    assert "[... output truncated: 2900000 of 3000000 bytes cut;" in output
    assert output.startswith("0123456789\n")
    assert "Broken pipe" not in output  # SIGPIPE is not left ignored in the shell


def test_output_limit_is_configurable(start_toolserver: StartToolServer) -> None:
    server = start_toolserver(args=["--output-limit", "1000"])
    result = bash(server.client(), "seq 1 10000")
    assert result["truncated"] is True
    assert result["output"].startswith("1\n2\n3\n")
    assert result["output"].endswith("9999\n10000\n")
    assert len(result["output"]) < 1200


def test_jobs_of_an_exited_shell_are_killed(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    pid = int(bash(client, "sleep 100 >/dev/null 2>&1 & echo $!")["output"].split()[-1])
    assert bash(client, "exit")["reset"] is True
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), 5, f"the shell's job {pid} to end")


def test_endless_output_is_capped_and_interrupted(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    result = bash(client, "yes", timeout=0.5)
    assert (result["timed_out"], result["truncated"], result["reset"]) == (True, True, False)
    assert len(result["output"]) < 101_000
    assert bash(client, "echo done")["output"] == "done\n"


def test_turning_echo_on_does_not_leak_into_output(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    bash(client, "stty echo")
    assert bash(client, "echo quiet")["output"] == "quiet\n"
