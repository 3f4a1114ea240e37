"""The editor tool: `str_replace_editor` commands and messages, on real files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sandbox.toolserver.editor import CLIPPED_NOTE, Editor, EditorError

FIVE_LINES = "one\ntwo\nthree\nfour\nfive\n"


@pytest.fixture
def editor(tmp_path: Path) -> Editor:
    return Editor(tmp_path)


@pytest.fixture
def five(tmp_path: Path) -> Path:
    path = tmp_path / "five.txt"
    path.write_text(FIVE_LINES)
    return path


def run(editor: Editor, **args: Any) -> str:
    return str(editor.run(args)["output"])


def refused(editor: Editor, **args: Any) -> str:
    with pytest.raises(EditorError) as info:
        editor.run(args)
    return str(info.value)


# view ---------------------------------------------------------------------------------


def test_view_numbers_lines_like_cat_n(editor: Editor, five: Path) -> None:
    assert run(editor, command="view", path=str(five)) == (
        f"Here's the result of running `cat -n` on {five}:\n"
        "     1\tone\n     2\ttwo\n     3\tthree\n     4\tfour\n     5\tfive\n"
    )


def test_view_range_shows_only_those_lines(editor: Editor, five: Path) -> None:
    output = run(editor, command="view", path=str(five), view_range=[2, 3])
    assert output.endswith("     2\ttwo\n     3\tthree\n")
    assert "one" not in output


def test_view_range_minus_one_runs_to_the_end(editor: Editor, five: Path) -> None:
    output = run(editor, command="view", path=str(five), view_range=[4, -1])
    assert output.endswith("     4\tfour\n     5\tfive\n")


def test_view_range_past_the_end_is_clamped_with_a_note(editor: Editor, five: Path) -> None:
    output = run(editor, command="view", path=str(five), view_range=[4, 99])
    assert "     5\tfive\n" in output
    assert "We only show up to 5 since there's only 5 lines in this file" in output


def test_view_range_start_outside_the_file_is_refused(editor: Editor, five: Path) -> None:
    message = refused(editor, command="view", path=str(five), view_range=[9, 10])
    assert message == (
        "Invalid `view_range`: [9, 10]. Its first element `9` should be within the range of "
        "lines of the file: [1, 5]"
    )


def test_view_range_ending_before_it_starts_is_refused(editor: Editor, five: Path) -> None:
    message = refused(editor, command="view", path=str(five), view_range=[3, 2])
    assert "Its second element `2` should be larger or equal than its first `3`" in message


def test_view_range_must_be_two_integers(editor: Editor, five: Path) -> None:
    message = refused(editor, command="view", path=str(five), view_range=[1])
    assert message == "Invalid `view_range`. It should be a list of two integers."


def test_view_of_a_large_file_is_clipped_with_a_note(editor: Editor, tmp_path: Path) -> None:
    path = tmp_path / "large.txt"
    path.write_text("".join(f"line {i}\n" for i in range(5000)))
    output = run(editor, command="view", path=str(path))
    assert output.rstrip("\n").endswith(CLIPPED_NOTE)
    assert len(output) < 17_000


def test_view_of_a_directory_lists_two_levels_without_hidden(
    editor: Editor, tmp_path: Path
) -> None:
    (tmp_path / "pkg" / "deep" / "deeper").mkdir(parents=True)
    (tmp_path / "pkg" / "mod.py").write_text("")
    (tmp_path / "pkg" / "deep" / "too_deep.py").write_text("")
    (tmp_path / "top.txt").write_text("")
    (tmp_path / ".git").mkdir()
    (tmp_path / "pkg" / ".cache").write_text("")
    output = run(editor, command="view", path=str(tmp_path))
    assert output.startswith(
        f"Here's the files and directories up to 2 levels deep in {tmp_path}, "
        "excluding hidden items:\n"
    )
    listed = output.splitlines()[1:5]
    assert listed == [
        f"{tmp_path}/",
        f"{tmp_path}/pkg/",
        f"{tmp_path}/pkg/deep/",
        f"{tmp_path}/pkg/mod.py",
    ]
    listing, note = output.split("\n\n")
    assert f"{tmp_path}/top.txt" in listing
    for hidden_or_too_deep in ("too_deep", ".cache", ".git"):
        assert hidden_or_too_deep not in listing
    assert "1 hidden files/directories in this directory are excluded" in note


def test_view_range_on_a_directory_is_refused(editor: Editor, tmp_path: Path) -> None:
    message = refused(editor, command="view", path=str(tmp_path), view_range=[1, 2])
    assert message == "The `view_range` parameter is not allowed when `path` points to a directory."


# create -------------------------------------------------------------------------------


def test_create_writes_a_new_file(editor: Editor, tmp_path: Path) -> None:
    path = tmp_path / "new" / "nested" / "file.py"
    output = run(editor, command="create", path=str(path), file_text="print('hi')\n")
    assert output == f"File created successfully at: {path}"
    assert path.read_text() == "print('hi')\n"


def test_create_refuses_to_overwrite(editor: Editor, five: Path) -> None:
    message = refused(editor, command="create", path=str(five), file_text="new")
    assert message == (
        f"File already exists at: {five}. Cannot overwrite files using command `create`."
    )
    assert five.read_text() == FIVE_LINES


def test_create_needs_file_text(editor: Editor, tmp_path: Path) -> None:
    message = refused(editor, command="create", path=str(tmp_path / "x.txt"))
    assert message == "Parameter `file_text` is required for command: create"


# str_replace ---------------------------------------------------------------------------


def test_str_replace_edits_and_shows_a_numbered_snippet(editor: Editor, five: Path) -> None:
    output = run(editor, command="str_replace", path=str(five), old_str="three", new_str="3\n3b")
    assert five.read_text() == "one\ntwo\n3\n3b\nfour\nfive\n"
    assert output == (
        f"The file {five} has been edited. "
        f"Here's the result of running `cat -n` on a snippet of {five}:\n"
        "     1\tone\n     2\ttwo\n     3\t3\n     4\t3b\n     5\tfour\n     6\tfive\n"
        "Review the changes and make sure they are as expected. "
        "Edit the file again if necessary."
    )


def test_str_replace_without_new_str_deletes(editor: Editor, five: Path) -> None:
    run(editor, command="str_replace", path=str(five), old_str="two\n")
    assert five.read_text() == "one\nthree\nfour\nfive\n"


def test_str_replace_with_no_match_is_refused(editor: Editor, five: Path) -> None:
    message = refused(editor, command="str_replace", path=str(five), old_str="six", new_str="6")
    assert message == (
        f"No replacement was performed, old_str `six` did not appear verbatim in {five}."
    )


def test_str_replace_with_several_matches_names_their_lines(editor: Editor, tmp_path: Path) -> None:
    path = tmp_path / "dup.py"
    path.write_text("x = 1\ny = 2\nx = 1\n")
    message = refused(editor, command="str_replace", path=str(path), old_str="x = 1", new_str="")
    assert message == (
        "No replacement was performed. Multiple occurrences of old_str `x = 1` in lines "
        "[1, 3]. Please ensure it is unique."
    )
    assert path.read_text() == "x = 1\ny = 2\nx = 1\n"


def test_str_replace_counts_overlapping_matches(editor: Editor, tmp_path: Path) -> None:
    path = tmp_path / "aaa.txt"
    path.write_text("aaa\n")
    message = refused(editor, command="str_replace", path=str(path), old_str="aa", new_str="b")
    assert "Multiple occurrences of old_str `aa` in lines [1]" in message


def test_str_replace_with_identical_strings_is_refused(editor: Editor, five: Path) -> None:
    message = refused(editor, command="str_replace", path=str(five), old_str="two", new_str="two")
    assert message == ("No replacement was performed, old_str `two` is the same as new_str `two`.")


def test_str_replace_needs_old_str(editor: Editor, five: Path) -> None:
    message = refused(editor, command="str_replace", path=str(five), new_str="x")
    assert message == "Parameter `old_str` is required for command: str_replace"


def test_str_replace_keeps_tabs_and_crlf(editor: Editor, tmp_path: Path) -> None:
    path = tmp_path / "Makefile"
    path.write_bytes(b"all:\r\n\techo one\r\n\techo two\r\n")
    run(editor, command="str_replace", path=str(path), old_str="echo two", new_str="echo 2")
    assert path.read_bytes() == b"all:\r\n\techo one\r\n\techo 2\r\n"


def test_str_replace_keeps_bytes_of_a_latin1_file(editor: Editor, tmp_path: Path) -> None:
    path = tmp_path / "legacy.txt"
    path.write_bytes(b"caf\xe9\nname = old\n")
    run(editor, command="str_replace", path=str(path), old_str="old", new_str="new")
    assert path.read_bytes() == b"caf\xe9\nname = new\n"


# insert -------------------------------------------------------------------------------


def test_insert_after_a_line(editor: Editor, five: Path) -> None:
    output = run(editor, command="insert", path=str(five), insert_line=2, new_str="2.5")
    assert five.read_text() == "one\ntwo\n2.5\nthree\nfour\nfive\n"
    assert output.startswith(
        f"The file {five} has been edited. "
        "Here's the result of running `cat -n` on a snippet of the edited file:\n"
        "     1\tone\n     2\ttwo\n     3\t2.5\n     4\tthree\n"
    )
    assert output.endswith(
        "Review the changes and make sure they are as expected (correct indentation, "
        "no duplicate lines, etc). Edit the file again if necessary."
    )


def test_insert_at_zero_goes_to_the_top(editor: Editor, five: Path) -> None:
    run(editor, command="insert", path=str(five), insert_line=0, new_str="zero\n")
    assert five.read_text() == "zero\n" + FIVE_LINES


def test_insert_after_the_last_line_appends(editor: Editor, tmp_path: Path) -> None:
    path = tmp_path / "no_newline.txt"
    path.write_text("a\nb")
    run(editor, command="insert", path=str(path), insert_line=2, new_str="c")
    assert path.read_text() == "a\nb\nc"


def test_insert_outside_the_file_is_refused(editor: Editor, five: Path) -> None:
    message = refused(editor, command="insert", path=str(five), insert_line=6, new_str="x")
    assert message == (
        "Invalid `insert_line` parameter: 6. It should be within the range of lines of the "
        "file: [0, 5]"
    )


def test_insert_needs_its_parameters(editor: Editor, five: Path) -> None:
    assert refused(editor, command="insert", path=str(five), new_str="x") == (
        "Parameter `insert_line` is required for command: insert"
    )
    assert refused(editor, command="insert", path=str(five), insert_line=1) == (
        "Parameter `new_str` is required for command: insert"
    )


# undo_edit ----------------------------------------------------------------------------


def test_undo_edit_reverts_edits_one_at_a_time(editor: Editor, five: Path) -> None:
    run(editor, command="str_replace", path=str(five), old_str="one", new_str="1")
    run(editor, command="insert", path=str(five), insert_line=0, new_str="top")
    output = run(editor, command="undo_edit", path=str(five))
    assert output.startswith(f"Last edit to {five} undone successfully. ")
    assert five.read_text() == "1\ntwo\nthree\nfour\nfive\n"
    run(editor, command="undo_edit", path=str(five))
    assert five.read_text() == FIVE_LINES


def test_undo_edit_without_history_is_refused(editor: Editor, five: Path) -> None:
    assert refused(editor, command="undo_edit", path=str(five)) == (
        f"No edit history found for {five}."
    )


def test_undo_of_create_removes_the_file(editor: Editor, tmp_path: Path) -> None:
    path = tmp_path / "created.txt"
    run(editor, command="create", path=str(path), file_text="x")
    assert "has been removed" in run(editor, command="undo_edit", path=str(path))
    assert not path.exists()


def test_history_is_per_file(editor: Editor, five: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.txt"
    other.write_text("alpha\n")
    run(editor, command="str_replace", path=str(five), old_str="one", new_str="1")
    assert refused(editor, command="undo_edit", path=str(other)).startswith("No edit history")


# paths and commands -------------------------------------------------------------------


def test_relative_path_is_refused_with_a_suggestion(editor: Editor, tmp_path: Path) -> None:
    assert refused(editor, command="view", path="five.txt") == (
        "The path five.txt is not an absolute path, it should start with `/`. "
        f"Maybe you meant {tmp_path / 'five.txt'}?"
    )


def test_missing_path_is_refused(editor: Editor, tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    assert refused(editor, command="view", path=str(missing)) == (
        f"The path {missing} does not exist. Please provide a valid path."
    )


def test_only_view_works_on_a_directory(editor: Editor, tmp_path: Path) -> None:
    message = refused(editor, command="str_replace", path=str(tmp_path), old_str="a")
    assert message == (
        f"The path {tmp_path} is a directory and only the `view` command can be used on directories"
    )


def test_unknown_command_lists_the_allowed_ones(editor: Editor, five: Path) -> None:
    assert refused(editor, command="delete", path=str(five)) == (
        "Unrecognized command delete. The allowed commands for the str_replace_editor tool "
        'are: "view", "create", "str_replace", "insert", "undo_edit"'
    )


def test_binary_file_is_refused(editor: Editor, tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\x00\x01\x02binary")
    assert "appears to be binary" in refused(editor, command="view", path=str(path))
