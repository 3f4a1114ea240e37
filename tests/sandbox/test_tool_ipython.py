"""The ipython tool: a persistent kernel driven through jupyter_client, via a real server."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from sandbox.toolclient import ToolClient

if TYPE_CHECKING:
    from tests.support.toolserver import ToolServerProcess


def cell(client: ToolClient, code: str, timeout: float = 30.0) -> dict[str, Any]:
    return client.call("ipython", code=code, timeout=timeout)


def test_state_persists_between_cells(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    first = cell(client, "import math\nradius = 2")
    assert (first["status"], first["restarted"]) == ("ok", False)
    assert cell(client, "round(math.pi * radius**2, 3)")["output"] == "12.566\n"


def test_stdout_stderr_and_result_come_back_as_text(toolserver: ToolServerProcess) -> None:
    code = "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n6 * 7"
    result = cell(toolserver.client(), code)
    assert result == {
        "output": "to stdout\nto stderr\n42\n",
        "status": "ok",
        "restarted": False,
        "truncated": False,
    }


def test_error_returns_the_traceback_without_colour(toolserver: ToolServerProcess) -> None:
    result = cell(toolserver.client(), "def f():\n    return 1 / 0\nf()")
    assert result["status"] == "error"
    assert "ZeroDivisionError" in result["output"]
    assert "return 1 / 0" in result["output"]
    assert "\x1b" not in result["output"]


def test_kernel_starts_in_the_working_directory(toolserver: ToolServerProcess) -> None:
    output = cell(toolserver.client(), "import os; print(os.getcwd())")["output"]
    assert output == f"{toolserver.workdir}\n"


def test_input_fails_instead_of_waiting(toolserver: ToolServerProcess) -> None:
    started = time.monotonic()
    result = cell(toolserver.client(), "input('name? ')", timeout=20)
    assert time.monotonic() - started < 10
    assert result["status"] == "error"
    assert "StdinNotImplementedError" in result["output"]


def test_timeout_interrupts_and_the_kernel_stays_usable(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    cell(client, "kept = 'still here'")
    started = time.monotonic()
    result = cell(client, "while True: pass", timeout=1.0)
    assert time.monotonic() - started < 8
    assert result["status"] == "timeout"
    assert result["restarted"] is False
    assert "KeyboardInterrupt" in result["output"]
    assert cell(client, "kept")["output"] == "'still here'\n"


def test_dead_kernel_is_restarted_on_the_next_call(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    cell(client, "lost = 1")
    started = time.monotonic()
    died = cell(client, "import os; os._exit(1)")
    assert time.monotonic() - started < 10
    assert died["status"] == "error"
    assert "kernel died" in died["output"]
    after = cell(client, "print('fresh'); 'lost' in globals()")
    assert after == {
        "output": "fresh\nFalse\n",
        "status": "ok",
        "restarted": True,
        "truncated": False,
    }


def test_kernel_ignoring_the_interrupt_is_restarted(toolserver: ToolServerProcess) -> None:
    client = toolserver.client()
    code = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass"
    result = cell(client, code, timeout=0.5)
    assert (result["status"], result["restarted"]) == ("timeout", True)
    assert cell(client, "1 + 1")["output"] == "2\n"


def test_huge_output_is_truncated_with_a_marker(toolserver: ToolServerProcess) -> None:
    result = cell(toolserver.client(), "for i in range(30000): print(f'{i:09d}')")
    assert result["truncated"] is True
    assert result["output"].startswith("000000000\n000000001\n")
    assert result["output"].endswith("000029999\n")
    assert "[... output truncated: 200000 of 300000 bytes cut;" in result["output"]
