"""Build the SWE-style example tasks: small Python repositories with a real bug each.

    .venv/bin/python examples/build_swe_tasks.py --out DIR

writes `DIR/repos/<name>` (a git repository per task, at its buggy base commit),
`DIR/swe_tasks.jsonl` (one SWE-bench instance record per task, `data_source: "swe"`, with
`environment.repo_path` naming the repository) and `DIR/swe_script.jsonl` (what the
development inference server answers in script mode: sample 0 fixes the bug as the gold
patch does, sample 1 makes a wrong change).

The sources of the repositories are the plain files under `examples/swe/<name>/`. The gold
patch and the test patch are computed here with git from the edits below, and every commit
has fixed names and dates, so `base_commit` and both patches are the same on every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCES = Path(__file__).resolve().parent / "swe"
"""One directory per example repository, holding its files at the base commit."""

# Commits made here must hash the same everywhere: fixed identity and dates, and none of
# the user's or the system's git configuration (hooks, signing, diff options).
GIT_ENV = {
    "GIT_AUTHOR_NAME": "rollserve examples",
    "GIT_AUTHOR_EMAIL": "examples@rollserve.invalid",
    "GIT_AUTHOR_DATE": "2024-05-01T12:00:00+00:00",
    "GIT_COMMITTER_NAME": "rollserve examples",
    "GIT_COMMITTER_EMAIL": "examples@rollserve.invalid",
    "GIT_COMMITTER_DATE": "2024-05-01T12:00:00+00:00",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "LC_ALL": "C",
}
CREATED_AT = "2024-05-01T12:00:00Z"
SEMVER_REPRODUCTION = (
    'python -c \'from semverlite import compare; print(compare("1.10.0", "1.9.0"))\''
)
VERSION = "0.1"


@dataclass(frozen=True)
class Edit:
    """Replace `old`, which occurs exactly once in `path`, with `new` (as the editor tool's
    `str_replace` does)."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Example:
    """One task: a repository, its issue, the fix, the tests that check it."""

    name: str
    """Directory under examples/swe/ and under DIR/repos/."""
    issue: str
    """The problem statement; its first line is distinctive enough to pick the script entry."""
    fix: tuple[Edit, ...]
    """The gold fix."""
    wrong: tuple[Edit, ...]
    """A plausible change that does not resolve the issue."""
    tests_added: dict[str, str]
    """Test file -> text appended to it (the file is created when it does not exist)."""
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    gold_by: str
    """How sample 0 applies the fix: `editor` (str_replace calls) or `git-apply` (bash)."""
    explore: str
    """The bash command sample 0 runs first to look at the code."""
    check: str = ""
    """A bash command sample 0 runs after the fix, if any."""

    @property
    def repo(self) -> str:
        return f"rollserve-examples/{self.name}"

    @property
    def instance_id(self) -> str:
        return f"rollserve-examples__{self.name}-1"


EXAMPLES: tuple[Example, ...] = (
    Example(
        name="textkit",
        issue=(
            "slugify() leaves a separator at the start or the end of the slug\n\n"
            "`slugify` keeps a dash where the text starts or ends with spaces or "
            "punctuation:\n\n"
            "```python\n"
            ">>> from textkit import slugify\n"
            '>>> slugify("  Hello, World!  ")\n'
            "'-hello-world-'\n"
            '>>> slugify("--Draft--")\n'
            "'-draft-'\n"
            "```\n\n"
            "A slug should never start or end with the separator: these should give "
            "`'hello-world'` and `'draft'`.\n"
        ),
        fix=(
            Edit(
                "textkit/slug.py",
                '    return re.sub(r"[\\s_-]+", separator, text)\n',
                '    words = re.split(r"[\\s_-]+", text)\n'
                "    return separator.join(word for word in words if word)\n",
            ),
        ),
        wrong=(
            Edit(
                "textkit/slug.py",
                '    text = re.sub(r"[^\\w\\s-]", "", text).lower()\n',
                '    text = re.sub(r"[^\\w\\s-]", "", text).strip().lower()\n',
            ),
        ),
        tests_added={
            "tests/test_slug.py": (
                "\n\ndef test_no_separator_at_either_end():\n"
                '    assert slugify("  Hello, World!  ") == "hello-world"\n'
                '    assert slugify("--Draft--") == "draft"\n'
            ),
        },
        fail_to_pass=("tests/test_slug.py::test_no_separator_at_either_end",),
        pass_to_pass=(
            "tests/test_slug.py::test_words_are_joined_with_dashes",
            "tests/test_slug.py::test_accents_are_dropped",
            "tests/test_slug.py::test_custom_separator",
            "tests/test_case.py::test_camel_to_snake",
            "tests/test_case.py::test_snake_to_camel",
        ),
        gold_by="editor",
        explore="grep -rn 'def slugify' -A 12 textkit/",
    ),
    Example(
        name="intervals",
        issue=(
            "merge() returns overlapping intervals when its input is not sorted\n\n"
            "`merge` promises disjoint intervals in ascending order, but it only joins an "
            "interval with the one just before it in the input:\n\n"
            "```python\n"
            ">>> from intervals import Interval, merge, total_length\n"
            ">>> merge([Interval(5, 8), Interval(1, 3), Interval(2, 6)])\n"
            "[Interval(start=5, end=8), Interval(start=1, end=6)]\n"
            ">>> total_length([Interval(5, 8), Interval(1, 3), Interval(2, 6)])\n"
            "8\n"
            "```\n\n"
            "The union is `[Interval(start=1, end=8)]`, of length 7.\n"
        ),
        fix=(
            Edit(
                "intervals/ops.py",
                "    for current in intervals:\n",
                "    for current in sorted(intervals):\n",
            ),
        ),
        wrong=(
            Edit(
                "intervals/ops.py",
                "            merged.append(current)\n    return merged\n",
                "            merged.append(current)\n    return sorted(merged)\n",
            ),
        ),
        tests_added={
            "tests/test_ops.py": (
                "\n\ndef test_merge_of_unsorted_intervals():\n"
                "    unsorted = [Interval(5, 8), Interval(1, 3), Interval(2, 6)]\n"
                "    assert merge(unsorted) == [Interval(1, 8)]\n"
                "\n\ndef test_total_length_of_unsorted_intervals():\n"
                "    assert total_length([Interval(5, 8), Interval(1, 3), Interval(2, 6)]) == 7\n"
            ),
        },
        fail_to_pass=(
            "tests/test_ops.py::test_merge_of_unsorted_intervals",
            "tests/test_ops.py::test_total_length_of_unsorted_intervals",
        ),
        pass_to_pass=(
            "tests/test_ops.py::test_merge_overlapping",
            "tests/test_ops.py::test_merge_keeps_disjoint_intervals",
            "tests/test_ops.py::test_merge_of_nothing",
            "tests/test_ops.py::test_total_length",
            "tests/test_ops.py::test_gaps",
        ),
        gold_by="git-apply",
        explore="cat intervals/ops.py",
    ),
    Example(
        name="calendarx",
        issue=(
            "days_in_month(1900, 2) says February 1900 had 29 days\n\n"
            "1900 was not a leap year: a year divisible by 100 is a leap year only when it "
            "is also divisible by 400. `is_leap` only checks divisibility by 4, so:\n\n"
            "```python\n"
            ">>> from calendarx import add_months, days_in_month, is_leap\n"
            ">>> is_leap(1900), days_in_month(1900, 2)\n"
            "(True, 29)\n"
            ">>> add_months(1900, 1, 31, 1)\n"
            "(1900, 2, 29)\n"
            "```\n\n"
            "and 1900-02-29 is not a date. The same goes for 1800, 2100 and 2200; 2000 "
            "and 2400 are leap years.\n"
        ),
        fix=(
            Edit(
                "calendarx/leap.py",
                "    return year % 4 == 0\n",
                "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
            ),
        ),
        wrong=(
            Edit(
                "calendarx/leap.py",
                "    return year % 4 == 0\n",
                "    return year % 4 == 0 and year % 100 != 0\n",
            ),
        ),
        tests_added={
            "tests/test_century.py": (
                "from calendarx import is_leap\n"
                "\n\ndef test_century_years_are_common():\n"
                "    assert not is_leap(1900)\n"
                "    assert not is_leap(2100)\n"
                "\n\ndef test_every_fourth_century_is_leap():\n"
                "    assert is_leap(2000)\n"
                "    assert is_leap(2400)\n"
            ),
            "tests/test_months.py": (
                "\n\ndef test_add_months_into_february_1900():\n"
                "    assert add_months(1900, 1, 31, 1) == (1900, 2, 28)\n"
            ),
        },
        fail_to_pass=(
            "tests/test_century.py::test_century_years_are_common",
            "tests/test_months.py::test_add_months_into_february_1900",
        ),
        pass_to_pass=(
            "tests/test_century.py::test_every_fourth_century_is_leap",
            "tests/test_months.py::test_days_in_month",
            "tests/test_months.py::test_february_of_a_leap_year",
            "tests/test_months.py::test_month_out_of_range",
            "tests/test_months.py::test_add_months_clamps_the_day",
            "tests/test_months.py::test_add_months_across_years",
            "tests/test_months.py::test_day_of_year",
            "tests/test_leap.py::test_every_fourth_year_is_leap",
            "tests/test_leap.py::test_other_years_are_common",
        ),
        gold_by="editor",
        explore="cat calendarx/leap.py",
        check="python -m pytest -q tests",
    ),
    Example(
        name="semverlite",
        issue=(
            "compare() orders 1.10.0 before 1.9.0\n\n"
            "Versions with a component of two digits or more are ordered as text:\n\n"
            "```python\n"
            ">>> from semverlite import compare, max_version\n"
            '>>> compare("1.10.0", "1.9.0")\n'
            "-1\n"
            '>>> max_version(["1.9.0", "1.10.0"])\n'
            "'1.9.0'\n"
            "```\n\n"
            "1.10.0 is the newer version; each of MAJOR, MINOR and PATCH should be "
            "compared as a number.\n"
        ),
        fix=(
            Edit(
                "semverlite/compare.py",
                "def _key(text: str) -> tuple[tuple[str, ...], bool, str]:\n",
                "def _key(text: str) -> tuple[tuple[int, ...], bool, str]:\n",
            ),
            Edit(
                "semverlite/compare.py",
                '    core = f"{version.major}.{version.minor}.{version.patch}"\n'
                '    return tuple(core.split(".")), version.prerelease == "", '
                "version.prerelease\n",
                "    core = (version.major, version.minor, version.patch)\n"
                '    return core, version.prerelease == "", version.prerelease\n',
            ),
        ),
        wrong=(
            Edit(
                "semverlite/compare.py",
                '    return tuple(core.split(".")), version.prerelease == "", version.prerelease\n',
                '    parts = tuple(part.zfill(2) for part in core.split("."))\n'
                '    return parts, version.prerelease == "", version.prerelease\n',
            ),
        ),
        tests_added={
            "tests/test_compare.py": (
                "\n\ndef test_components_compare_as_numbers():\n"
                '    assert compare("1.10.0", "1.9.0") == 1\n'
                '    assert compare("2.0.100", "2.0.99") == 1\n'
                "\n\ndef test_max_version_of_multi_digit_versions():\n"
                '    assert max_version(["1.9.0", "1.10.0", "1.2.0"]) == "1.10.0"\n'
            ),
        },
        fail_to_pass=(
            "tests/test_compare.py::test_components_compare_as_numbers",
            "tests/test_compare.py::test_max_version_of_multi_digit_versions",
        ),
        pass_to_pass=(
            "tests/test_compare.py::test_same_version",
            "tests/test_compare.py::test_patch_release_is_newer",
            "tests/test_compare.py::test_prerelease_sorts_before_its_release",
            "tests/test_compare.py::test_max_version",
            "tests/test_version.py::test_parse_release",
            "tests/test_version.py::test_parse_prerelease_with_v_prefix",
        ),
        gold_by="editor",
        explore=SEMVER_REPRODUCTION,
        check=SEMVER_REPRODUCTION,
    ),
)


# ----------------------------------------------------------------------------- git


def git(repo: Path, *args: str, input: str | None = None) -> str:
    """Run git in `repo` with the fixed environment; its stdout."""
    result = subprocess.run(
        ["git", *args],
        cwd=repo,
        env={**os.environ, **GIT_ENV},
        input=input,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {result.stderr.strip()}")
    return result.stdout


def apply_edits(repo: Path, edits: tuple[Edit, ...]) -> None:
    """Make each edit in the working tree; each `old` must occur exactly once."""
    for edit in edits:
        path = repo / edit.path
        text = path.read_text(encoding="utf-8")
        count = text.count(edit.old)
        if count != 1:
            raise ValueError(f"{edit.path}: the text to replace occurs {count} times, not once")
        path.write_text(text.replace(edit.old, edit.new), encoding="utf-8")


def staged_diff(repo: Path) -> str:
    """The working tree's changes against HEAD (new files included), then a clean tree."""
    git(repo, "add", "-A")
    diff = git(repo, "diff", "--cached", "--no-color", "--no-ext-diff", "HEAD")
    git(repo, "reset", "-q", "--hard", "HEAD")
    git(repo, "clean", "-fdq")
    return diff


def copy_sources(source: Path, target: Path) -> None:
    """Copy the example's files, none of them executable (git records the mode)."""
    if target.exists():
        shutil.rmtree(target)
    for path in sorted(source.rglob("*")):
        if "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        relative = path.relative_to(source)
        destination = target / relative
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
        else:
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(path.read_bytes())
            destination.chmod(0o644)


# ----------------------------------------------------------------------------- tasks


def build_repository(example: Example, repos: Path) -> tuple[Path, str, str, str]:
    """Create the example's repository under `repos`; (path, base commit, gold patch,
    test patch)."""
    repo = repos / example.name
    copy_sources(SOURCES / example.name, repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"Import {example.name} 0.1.0")
    base_commit = git(repo, "rev-parse", "HEAD").strip()

    apply_edits(repo, example.fix)
    patch = staged_diff(repo)
    for relative, added in example.tests_added.items():
        path = repo / relative
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        path.write_text(old + added, encoding="utf-8")
    test_patch = staged_diff(repo)
    make_readable(repo)
    return repo, base_commit, patch, test_patch


def make_readable(repo: Path) -> None:
    """Let every uid read the repository, git's own files included (sandboxes clone it
    under a uid of their own, whatever the umask was)."""
    for path in [repo, *repo.rglob("*")]:
        if not path.is_symlink():
            extra = 0o555 if path.is_dir() else 0o444
            path.chmod(path.stat().st_mode | extra)


def task_record(
    example: Example, repo: Path, base_commit: str, patch: str, test_patch: str
) -> dict[str, Any]:
    """The SWE-bench instance record of the example (lists of tests as JSON strings, as in
    the Hugging Face datasets), for the `swe` handler."""
    return {
        "data_source": "swe",
        "instance_id": example.instance_id,
        "repo": example.repo,
        "base_commit": base_commit,
        "environment_setup_commit": base_commit,
        "version": VERSION,
        "created_at": CREATED_AT,
        "problem_statement": example.issue,
        "hints_text": "",
        "patch": patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(list(example.fail_to_pass)),
        "PASS_TO_PASS": json.dumps(list(example.pass_to_pass)),
        "environment": {"repo_path": str(repo.resolve())},
    }


def tool_call(name: str, **arguments: Any) -> str:
    """An assistant turn holding one tool call, in the Qwen3/Hermes convention."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def edit_calls(edits: tuple[Edit, ...]) -> list[str]:
    return [
        tool_call(
            "editor",
            command="str_replace",
            path=f"/workspace/{edit.path}",
            old_str=edit.old,
            new_str=edit.new,
        )
        for edit in edits
    ]


def gold_sample(example: Example, patch: str) -> list[str]:
    """Look at the code, apply the gold fix with tools, check it if the example says how,
    then finish."""
    turns = [tool_call("bash", command=example.explore)]
    if example.gold_by == "git-apply":
        turns.append(tool_call("bash", command=f"git apply <<'EOF'\n{patch}EOF\ngit diff --stat"))
    else:
        turns += edit_calls(example.fix)
    if example.check:
        turns.append(tool_call("bash", command=example.check))
    turns.append(tool_call("finish", result="Fixed the issue."))
    return turns


def wrong_sample(example: Example) -> list[str]:
    """Make the plausible but wrong change, then finish."""
    return [*edit_calls(example.wrong), tool_call("finish", result="Fixed the issue.")]


def script_entry(example: Example, patch: str) -> dict[str, Any]:
    return {
        "match": example.issue.splitlines()[0],
        "samples": [gold_sample(example, patch), wrong_sample(example)],
    }


def build(out: Path) -> list[dict[str, Any]]:
    """Write the repositories, `swe_tasks.jsonl` and `swe_script.jsonl` under `out`; the
    task records, in order."""
    out = out.resolve()
    repos = out / "repos"
    repos.mkdir(parents=True, exist_ok=True)
    tasks: list[dict[str, Any]] = []
    script: list[dict[str, Any]] = []
    for example in EXAMPLES:
        repo, base_commit, patch, test_patch = build_repository(example, repos)
        tasks.append(task_record(example, repo, base_commit, patch, test_patch))
        script.append(script_entry(example, patch))
    write_jsonl(out / "swe_tasks.jsonl", tasks)
    write_jsonl(out / "swe_script.jsonl", script)
    return tasks


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write into")
    args = parser.parse_args(argv)
    tasks = build(args.out)
    repos_dir = args.out.resolve() / "repos"
    for task in tasks:
        print(f"{task['instance_id']}  {task['base_commit'][:12]}  {task['environment']}")
    print(f"wrote {len(tasks)} tasks to {args.out / 'swe_tasks.jsonl'}")
    print(f"the service takes their repositories with ROLLSERVE_SWE_REPO_ROOTS={repos_dir}")


if __name__ == "__main__":
    main()
