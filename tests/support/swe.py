"""The SWE examples' task builder and whether bubblewrap can make boxes here."""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from sandbox.bwrap import BubblewrapBackend

ROOT = Path(__file__).resolve().parents[2]


def load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "build_swe_tasks", ROOT / "examples" / "build_swe_tasks.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


BUILDER = load_builder()


def bwrap_problem() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    ok, why = BubblewrapBackend().available()
    return None if ok else f"bubblewrap cannot make boxes here: {why}"


def mini_swe_agent_entries(patches: dict[str, str]) -> list[dict[str, Any]]:
    """Development-server script entries answering mini-swe-agent (tool-call mode: its one
    `bash` tool) on every example: the gold sample applies the gold patch, the wrong one
    makes the plausible wrong edit; both then submit as mini-swe-agent asks
    (`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` on the first line of a command's output).
    `patches` maps each example's instance id to its gold patch."""
    submit = BUILDER.tool_call("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
    entries = []
    for example in BUILDER.EXAMPLES:
        patch = patches[example.instance_id]
        gold = BUILDER.tool_call("bash", command=f"git apply <<'EOF'\n{patch}EOF\n")
        wrong = [
            BUILDER.tool_call("bash", command=_replace_command(edit)) for edit in example.wrong
        ]
        entries.append(
            {
                "match": example.issue.splitlines()[0],
                "samples": [[gold, submit], [*wrong, submit]],
            }
        )
    return entries


def _replace_command(edit: Any) -> str:
    """A shell command making `edit` (replace `old` once in `path`) with Python."""
    program = (
        "import json, pathlib, sys\n"
        "path, old, new = json.load(sys.stdin)\n"
        "p = pathlib.Path(path)\n"
        "p.write_text(p.read_text().replace(old, new, 1))\n"
    )
    data = json.dumps([f"/workspace/{edit.path}", edit.old, edit.new])
    return f"python3 -c {shlex.quote(program)} <<'EOF'\n{data}\nEOF\n"
