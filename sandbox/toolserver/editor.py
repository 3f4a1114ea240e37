"""A file editor with the semantics of SWE-agent's and OpenHands' `str_replace_editor`.

Agents trained on those tools expect these commands and these messages:

- ``view``: a file with ``cat -n`` style line numbers (``view_range`` [start, end], -1 for
  the end), or a directory listed two levels deep without hidden entries;
- ``create``: a new file (never overwrites one);
- ``str_replace``: replace ``old_str``, which must occur exactly once, by ``new_str``;
- ``insert``: insert ``new_str`` after line ``insert_line`` (0 inserts at the top);
- ``undo_edit``: revert the last edit of a file (each file has its own history).

Paths must be absolute. Edits keep a file's bytes otherwise unchanged (no tab expansion, no
newline conversion) so that a diff of the workspace shows only what the agent changed.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

COMMANDS: Final = ("view", "create", "str_replace", "insert", "undo_edit")
SNIPPET_LINES: Final = 4
MAX_VIEW_CHARS: Final = 16_000
MAX_FILE_BYTES: Final = 10 * 1024 * 1024
HISTORY_DEPTH: Final = 10
CLIPPED_NOTE: Final = (
    "<response clipped><NOTE>To save on context only part of this file has been shown to "
    "you. You should retry this tool after you have searched inside the file with `grep -n` "
    "in order to find the line numbers of what you are looking for.</NOTE>"
)


class EditorError(Exception):
    """A command the editor refused; the message is meant for the agent."""


@dataclass(frozen=True)
class _Text:
    content: str
    encoding: str


@dataclass(frozen=True)
class _Snapshot:
    """A file's content before an edit; None content means the file did not exist."""

    content: str | None
    encoding: str


def _split_lines(text: str) -> tuple[list[str], bool]:
    """Lines as `cat -n` and `grep -n` count them, and whether the text ends with a newline."""
    if not text:
        return [], False
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
        return lines, True
    return lines, False


def _join_lines(lines: list[str], trailing_newline: bool) -> str:
    return "\n".join(lines) + ("\n" if trailing_newline and lines else "")


def numbered(lines: list[str], first: int, max_chars: int = MAX_VIEW_CHARS) -> str:
    """Lines numbered like `cat -n` from `first`, clipped with a note past `max_chars`."""
    out: list[str] = []
    used = 0
    for offset, line in enumerate(lines):
        row = f"{first + offset:6}\t{line.removesuffix(chr(13))}"
        used += len(row) + 1
        if used > max_chars and out:
            out.append(CLIPPED_NOTE)
            break
        out.append(row)
    return "\n".join(out)


def _cat_n(lines: list[str], description: str, first: int = 1) -> str:
    return f"Here's the result of running `cat -n` on {description}:\n{numbered(lines, first)}\n"


class Editor:
    """The `editor` tool: one instance per tool server, so undo history spans connections."""

    def __init__(self, workdir: Path, *, history_depth: int = HISTORY_DEPTH) -> None:
        self.workdir = workdir
        self.history_depth = history_depth
        self._history: defaultdict[str, list[_Snapshot]] = defaultdict(list)

    def run(self, args: dict[str, Any]) -> dict[str, Any]:
        """Carry out one command; returns ``{"output": str}`` or raises EditorError."""
        command = args.get("command")
        if command not in COMMANDS:
            allowed = ", ".join(f'"{name}"' for name in COMMANDS)
            raise EditorError(
                f"Unrecognized command {command}. The allowed commands for the "
                f"str_replace_editor tool are: {allowed}"
            )
        raw_path = args.get("path")
        if not isinstance(raw_path, str) or not raw_path:
            raise EditorError(f"Parameter `path` is required for command: {command}")
        path = self._validate_path(command, raw_path)
        if command == "view":
            output = self.view(path, args.get("view_range"))
        elif command == "create":
            output = self.create(path, _required_str(args, "file_text", command))
        elif command == "str_replace":
            new_str = args.get("new_str")
            if new_str is not None and not isinstance(new_str, str):
                raise EditorError("Parameter `new_str` must be a string")
            output = self.str_replace(path, _required_str(args, "old_str", command), new_str)
        elif command == "insert":
            insert_line = args.get("insert_line")
            if insert_line is None:
                raise EditorError("Parameter `insert_line` is required for command: insert")
            if not isinstance(insert_line, int) or isinstance(insert_line, bool):
                raise EditorError(
                    f"Invalid `insert_line` parameter: {insert_line}. It should be an integer."
                )
            output = self.insert(path, insert_line, _required_str(args, "new_str", command))
        else:
            output = self.undo_edit(path)
        return {"output": output}

    # Commands -----------------------------------------------------------------------------

    def view(self, path: Path, view_range: Any = None) -> str:
        if path.is_dir():
            if view_range:
                raise EditorError(
                    "The `view_range` parameter is not allowed when `path` points to a directory."
                )
            return self._view_directory(path)
        text = self._read(path)
        lines, _ = _split_lines(text.content)
        if not view_range:
            return _cat_n(lines, str(path))
        if (
            not isinstance(view_range, list)
            or len(view_range) != 2
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in view_range)
        ):
            raise EditorError("Invalid `view_range`. It should be a list of two integers.")
        start, end = view_range
        count = len(lines)
        if start < 1 or start > count:
            raise EditorError(
                f"Invalid `view_range`: {view_range}. Its first element `{start}` should be "
                f"within the range of lines of the file: {[1, count]}"
            )
        note = ""
        if end == -1:
            end = count
        elif end > count:
            note = (
                f"\nNOTE: We only show up to {count} since there's only {count} lines in "
                "this file.\n"
            )
            end = count
        elif end < start:
            raise EditorError(
                f"Invalid `view_range`: {view_range}. Its second element `{end}` should be "
                f"larger or equal than its first `{start}`"
            )
        return _cat_n(lines[start - 1 : end], str(path), start) + note

    def create(self, path: Path, file_text: str) -> str:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EditorError(f"Ran into {exc} while trying to create {path.parent}") from None
        self._write(path, _Text(file_text, "utf-8"))
        self._remember(path, _Snapshot(None, "utf-8"))
        return f"File created successfully at: {path}"

    def str_replace(self, path: Path, old_str: str, new_str: str | None) -> str:
        new_str = new_str or ""
        if not old_str:
            raise EditorError(
                "No replacement was performed, `old_str` is empty. It must be a non-empty "
                "string that appears exactly once in the file."
            )
        if old_str == new_str:
            raise EditorError(
                f"No replacement was performed, old_str `{old_str}` is the same as "
                f"new_str `{new_str}`."
            )
        text = self._read(path)
        content = text.content
        positions = _occurrences(content, old_str)
        if not positions:
            raise EditorError(
                f"No replacement was performed, old_str `{old_str}` did not appear verbatim "
                f"in {path}."
            )
        if len(positions) > 1:
            lines = sorted({content.count("\n", 0, position) + 1 for position in positions})
            raise EditorError(
                f"No replacement was performed. Multiple occurrences of old_str `{old_str}` "
                f"in lines {lines}. Please ensure it is unique."
            )
        position = positions[0]
        new_content = content[:position] + new_str + content[position + len(old_str) :]
        self._write(path, _Text(new_content, text.encoding))
        self._remember(path, _Snapshot(content, text.encoding))

        first_line = content.count("\n", 0, position) + 1
        new_lines, _ = _split_lines(new_content)
        start = max(1, first_line - SNIPPET_LINES)
        end = min(len(new_lines), first_line + new_str.count("\n") + SNIPPET_LINES)
        snippet = _cat_n(new_lines[start - 1 : end], f"a snippet of {path}", start)
        return (
            f"The file {path} has been edited. {snippet}"
            "Review the changes and make sure they are as expected. "
            "Edit the file again if necessary."
        )

    def insert(self, path: Path, insert_line: int, new_str: str) -> str:
        text = self._read(path)
        lines, trailing_newline = _split_lines(text.content)
        if insert_line < 0 or insert_line > len(lines):
            raise EditorError(
                f"Invalid `insert_line` parameter: {insert_line}. It should be within the "
                f"range of lines of the file: {[0, len(lines)]}"
            )
        inserted = new_str.split("\n")
        if len(inserted) > 1 and inserted[-1] == "":
            inserted.pop()  # a trailing newline ends the last inserted line, adds no line
        new_lines = lines[:insert_line] + inserted + lines[insert_line:]
        new_content = _join_lines(new_lines, trailing_newline or not lines)
        self._write(path, _Text(new_content, text.encoding))
        self._remember(path, _Snapshot(text.content, text.encoding))

        start = max(0, insert_line - SNIPPET_LINES)
        end = insert_line + len(inserted) + SNIPPET_LINES
        snippet = _cat_n(new_lines[start:end], "a snippet of the edited file", start + 1)
        return (
            f"The file {path} has been edited. {snippet}"
            "Review the changes and make sure they are as expected (correct indentation, "
            "no duplicate lines, etc). Edit the file again if necessary."
        )

    def undo_edit(self, path: Path) -> str:
        history = self._history.get(_key(path))
        if not history:
            raise EditorError(f"No edit history found for {path}.")
        snapshot = history.pop()
        if snapshot.content is None:
            try:
                path.unlink()
            except OSError as exc:
                raise EditorError(f"Ran into {exc} while trying to remove {path}") from None
            return (
                f"Last edit to {path} undone successfully. The file did not exist before it "
                "was created, so it has been removed."
            )
        self._write(path, _Text(snapshot.content, snapshot.encoding))
        lines, _ = _split_lines(snapshot.content)
        return f"Last edit to {path} undone successfully. {_cat_n(lines, str(path))}"

    # Helpers ------------------------------------------------------------------------------

    def _validate_path(self, command: str, raw_path: str) -> Path:
        path = Path(raw_path)
        if not path.is_absolute():
            suggestion = self.workdir / path
            raise EditorError(
                f"The path {path} is not an absolute path, it should start with `/`. "
                f"Maybe you meant {suggestion}?"
            )
        path = Path(os.path.normpath(path))
        exists = path.exists()
        if command == "create" and exists:
            raise EditorError(
                f"File already exists at: {path}. Cannot overwrite files using command `create`."
            )
        if command != "create" and not exists:
            raise EditorError(f"The path {path} does not exist. Please provide a valid path.")
        if command != "view" and path.is_dir():
            raise EditorError(
                f"The path {path} is a directory and only the `view` command can be used on "
                "directories"
            )
        return path

    def _view_directory(self, path: Path) -> str:
        entries: list[str] = []
        hidden = 0
        try:
            top = sorted(os.scandir(path), key=lambda entry: entry.name)
        except OSError as exc:
            raise EditorError(f"Ran into {exc} while trying to list {path}") from None
        for entry in top:
            if entry.name.startswith("."):
                hidden += 1
                continue
            is_dir = entry.is_dir()
            entries.append(entry.path + ("/" if is_dir else ""))
            if not is_dir:
                continue
            try:
                below = sorted(os.scandir(entry.path), key=lambda child: child.name)
            except OSError:
                continue
            for child in below:
                if not child.name.startswith("."):
                    entries.append(child.path + ("/" if child.is_dir() else ""))
        listing = "\n".join([f"{path}/".replace("//", "/"), *entries])
        if len(listing) > MAX_VIEW_CHARS:
            listing = listing[:MAX_VIEW_CHARS].rsplit("\n", 1)[0] + "\n<response clipped>"
        output = (
            f"Here's the files and directories up to 2 levels deep in {path}, "
            f"excluding hidden items:\n{listing}\n"
        )
        if hidden:
            output += (
                f"\n{hidden} hidden files/directories in this directory are excluded. "
                f"You can use 'ls -la {path}' to see them.\n"
            )
        return output

    def _read(self, path: Path) -> _Text:
        try:
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                raise EditorError(
                    f"File {path} is too large ({size / 1024 / 1024:.1f}MB). Maximum allowed "
                    f"size is {MAX_FILE_BYTES // 1024 // 1024}MB."
                )
            data = path.read_bytes()
        except OSError as exc:
            raise EditorError(f"Ran into {exc} while trying to read {path}") from None
        if b"\0" in data[:8192]:
            raise EditorError(
                f"The file {path} appears to be binary; this tool only views and edits text."
            )
        try:
            return _Text(data.decode("utf-8"), "utf-8")
        except UnicodeDecodeError:
            # latin-1 maps every byte to a character, so unedited bytes are written back as read.
            return _Text(data.decode("latin-1"), "latin-1")

    def _write(self, path: Path, text: _Text) -> None:
        try:
            with open(path, "w", encoding=text.encoding, newline="") as handle:
                handle.write(text.content)
        except (OSError, UnicodeEncodeError) as exc:
            raise EditorError(f"Ran into {exc} while trying to write to {path}") from None

    def _remember(self, path: Path, snapshot: _Snapshot) -> None:
        history = self._history[_key(path)]
        history.append(snapshot)
        del history[: -self.history_depth]


def _key(path: Path) -> str:
    return os.path.normpath(path)


def _required_str(args: dict[str, Any], name: str, command: str) -> str:
    value = args.get(name)
    if value is None:
        raise EditorError(f"Parameter `{name}` is required for command: {command}")
    if not isinstance(value, str):
        raise EditorError(f"Parameter `{name}` must be a string")
    return value


def _occurrences(content: str, needle: str) -> list[int]:
    """Start offsets of every occurrence, overlapping ones included (they are ambiguous too)."""
    positions = []
    start = content.find(needle)
    while start != -1:
        positions.append(start)
        start = content.find(needle, start + 1)
    return positions
