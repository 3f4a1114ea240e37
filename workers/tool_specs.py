"""The tools offered to agents, as OpenAI-style function schemas for the chat template."""

from __future__ import annotations

from typing import Any


def _function(
    name: str, description: str, properties: dict[str, Any], required: list[str]
) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


BASH = _function(
    "bash",
    "Run a command in a persistent bash shell (cwd and environment persist between calls).",
    {
        "command": {"type": "string", "description": "The command to run."},
        "timeout": {"type": "number", "description": "Seconds before it is interrupted."},
    },
    ["command"],
)

EDITOR = _function(
    "editor",
    "View, create and edit files. `view` shows a file with line numbers or lists a directory; "
    "`create` writes a new file; `str_replace` replaces `old_str`, which must occur exactly "
    "once, with `new_str`; `insert` adds `new_str` after line `insert_line`; `undo_edit` "
    "reverts the last edit of `path`. Paths are absolute.",
    {
        "command": {
            "type": "string",
            "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
        },
        "path": {"type": "string"},
        "file_text": {"type": "string"},
        "old_str": {"type": "string"},
        "new_str": {"type": "string"},
        "insert_line": {"type": "integer"},
        "view_range": {"type": "array", "items": {"type": "integer"}},
    },
    ["command", "path"],
)

IPYTHON = _function(
    "ipython",
    "Run Python code in a persistent IPython kernel; variables persist between calls.",
    {
        "code": {"type": "string"},
        "timeout": {"type": "number", "description": "Seconds before it is interrupted."},
    },
    ["code"],
)

FINISH = _function(
    "finish",
    "Say that the task is done. Nothing after this call runs.",
    {"result": {"type": "string", "description": "A short summary of what was done."}},
    [],
)

ALL_TOOLS = [BASH, EDITOR, IPYTHON, FINISH]
