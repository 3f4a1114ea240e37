"""What the test run trusts of the repository is the base commit's, whatever the patch did.

A patch is code under test, but some files are not code under test: they configure or hook
the test runner or the interpreter, and a patch that adds one can make failing tests report
as passed without fixing anything. Before the tests run, the grader puts each of them back
as `base_commit` has it, or removes it when `base_commit` has none:

- in the work tree, wherever they are: `conftest.py`, `pytest.ini`, `.pytest.ini`,
  `pytest.toml`, `.pytest.toml`, `tox.ini`, `setup.cfg`, `pyproject.toml`,
  `sitecustomize.py`, `usercustomize.py` and every `*.pth` (`RUNNER_NAMES`,
  `RUNNER_SUFFIXES`). `pyproject.toml`, `setup.cfg` and `tox.ini` are put back only when
  the sections pytest reads differ (`[tool.pytest]` and `[tool.pytest.ini_options]`;
  `[tool:pytest]`; `[pytest]`), and then as whole files: a fix may change a project's
  metadata, not how its tests run. A file the patch deleted is put back too.
- in the repository's git dir: everything but its objects and index (`config`, `hooks/`,
  `info/`, `HEAD`, refs, and any file the patch added, such as `commondir`), which only
  GNU patch, the harness's last resort, can write (git refuses paths in `.git`). Git run by
  the grader also runs no hook and no fsmonitor (`GRADER_GIT_ENV`).

What was put back or removed is listed in the grade's details as `restored`.

Not covered: the patch's own modules run inside the test process (they can still reach into
pytest when the tests import them), and files outside the work tree are the box's, not the
patch's.
"""

from __future__ import annotations

import base64
import binascii
import configparser
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandbox.base import ExecResult, Sandbox
from workers.handlers.gradingbox import GIT_RUNS_NOTHING

RUNNER_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
    }
)
"""File names that configure or hook pytest or the interpreter, wherever they are."""
RUNNER_SUFFIXES = (".pth",)
"""File name endings that do (a `.pth` runs its `import` lines in any site directory)."""

GRADER_GIT_ENV = GIT_RUNS_NOTHING
"""Git as the grader runs it: no system config, no hooks, no fsmonitor."""

GIT_DIR_SNAPSHOT = "tar -C .git --exclude=./objects --exclude=./index -cf - . | base64 -w0"
"""Bash printing the git dir, but its objects and index, as a base64 tar (a few kB)."""

_FIND = (
    "find . -path ./.git -prune -o \\( "
    + " -o ".join(f"-name '{name}'" for name in sorted(RUNNER_NAMES))
    + "".join(f" -o -name '*{suffix}'" for suffix in RUNNER_SUFFIXES)
    + " \\) -print0"
)

_SCAN = f"""\
set -o pipefail
base="$1"
{{
  {_FIND} | sed -z 's|^\\./||'
  git ls-tree -r -z --name-only "$base" | while IFS= read -r -d '' p; do
    n="${{p##*/}}"
    case "$n" in {"|".join(sorted(RUNNER_NAMES))}|*.pth) printf '%s\\0' "$p" ;; esac
  done
}} | sort -zu | while IFS= read -r -d '' p; do
  old="$(git rev-parse -q --verify "$base:$p" 2>/dev/null)" || old=-
  if [ -L "$p" ]; then now=link
  elif [ -f "$p" ]; then now="$(git hash-object --no-filters -- "$p")" || now=unreadable
  elif [ -e "$p" ]; then now=other
  else now=-
  fi
  [ "$old" = "$now" ] || printf '%s\\0%s\\0%s\\0' "$p" "$old" "$now"
done | base64 -w0
"""
"""Bash (`bash -c _SCAN _ BASE`) printing, as base64, `path NUL base-blob NUL now NUL` for
each runner file that differs from `base_commit`'s (`-` where there is none)."""

_RESTORE = """\
set -e
base="$1"
while IFS= read -r -d '' p; do
  rm -rf -- "$p"
  if git cat-file -e "$base:$p" 2>/dev/null; then git checkout -q "$base" -- "$p"; fi
done
"""
"""Bash (`bash -c _RESTORE _ BASE`, NUL-separated paths on stdin) putting each path back
as `base_commit` has it, or leaving it removed."""

_RESTORE_GIT_DIR = (
    "find .git -mindepth 1 -maxdepth 1 ! -name objects ! -name index -exec rm -rf -- {} + "
    "&& tar -C .git -xf -"
)


class RunnerFilesError(RuntimeError):
    """The runner files could not be checked or put back; the grade is 0 rather than trusting
    the patch's."""


@dataclass(frozen=True)
class Changed:
    """A runner file that differs from `base_commit`'s."""

    path: str
    in_base: bool
    present: bool


Exec = Callable[..., ExecResult]


def _pytest_of_pyproject(text: str) -> Any:
    return tomllib.loads(text).get("tool", {}).get("pytest")


def _ini_sections(*names: str) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        parser = configparser.RawConfigParser(strict=False)
        parser.read_string(text)
        return {name: dict(parser.items(name)) for name in names if parser.has_section(name)}

    return read


SECTIONED: dict[str, Callable[[str], Any]] = {
    "pyproject.toml": _pytest_of_pyproject,
    "setup.cfg": _ini_sections("tool:pytest", "pytest"),
    "tox.ini": _ini_sections("pytest"),
}
"""Files of which only the sections pytest reads count: what those read from a text."""


def snapshot_git_dir(box: Sandbox, timeout: float) -> bytes:
    """The git dir of the box's work tree but its objects and index, as a tar."""
    result = box.exec(["bash", "-c", GIT_DIR_SNAPSHOT], timeout=timeout)
    return _decoded(result, "cannot read the repository's git dir")


def restore_git_dir(box: Sandbox, snapshot: bytes, timeout: float) -> list[dict[str, str]]:
    """Put the git dir back as `snapshot` has it when anything in it differs; what differed."""
    now = snapshot_git_dir(box, timeout)
    if now == snapshot:
        return []
    import io
    import tarfile

    def members(data: bytes) -> dict[str, tuple[Any, ...]]:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            found: dict[str, tuple[Any, ...]] = {}
            for member in tar.getmembers():
                extracted = tar.extractfile(member) if member.isfile() else None
                body = extracted.read() if extracted is not None else member.linkname
                found[member.name.removeprefix("./")] = (member.type, member.mode, body)
            return found

    before, after = members(snapshot), members(now)
    entries = [
        {"path": f".git/{name}", "action": "restored" if name in before else "removed"}
        for name in sorted(set(before) | set(after))
        if name != "." and before.get(name) != after.get(name)
    ]
    result = box.exec(["bash", "-c", _RESTORE_GIT_DIR], input=snapshot, timeout=timeout)
    if result.returncode != 0:
        raise RunnerFilesError(f"cannot restore the git dir: {_tail(result)}")
    return entries


def changed_runner_files(box: Sandbox, base_commit: str, timeout: float) -> list[Changed]:
    """The runner files of the box's work tree that differ from `base_commit`'s."""
    result = box.exec(
        ["bash", "-c", _SCAN, "scan", base_commit], env=GRADER_GIT_ENV, timeout=timeout
    )
    fields = _decoded(result, "cannot list the runner files").split(b"\0")[:-1]
    changed = []
    for index in range(0, len(fields) - 2, 3):
        path, old, now = fields[index : index + 3]
        changed.append(
            Changed(
                path=path.decode("utf-8", errors="surrogateescape"),
                in_base=old != b"-",
                present=now != b"-",
            )
        )
    return changed


def _pytest_sections_differ(box: Sandbox, base_commit: str, entry: Changed, timeout: float) -> bool:
    """Whether the sections pytest reads of a `SECTIONED` file differ from the base's; true
    when either text cannot be read or parsed."""
    read = SECTIONED[entry.path.rsplit("/", 1)[-1]]
    old = box.exec(["git", "show", f"{base_commit}:{entry.path}"], env=GRADER_GIT_ENV,
                   timeout=timeout)  # fmt: skip
    now = box.exec(["cat", "--", entry.path], timeout=timeout)
    if old.returncode != 0 or now.returncode != 0:
        return True
    try:
        return bool(read(old.stdout) != read(now.stdout))
    except (tomllib.TOMLDecodeError, configparser.Error, UnicodeError):
        return True


def restore_runner_files(box: Sandbox, base_commit: str, timeout: float) -> list[dict[str, str]]:
    """Put every runner file of the box's work tree that differs from `base_commit`'s back
    (see the module docstring); what was restored or removed, by path."""
    entries: list[dict[str, str]] = []
    paths: list[str] = []
    for entry in changed_runner_files(box, base_commit, timeout):
        name = entry.path.rsplit("/", 1)[-1]
        if (
            name in SECTIONED
            and entry.in_base
            and entry.present
            and entry.path.isprintable()
            and not _pytest_sections_differ(box, base_commit, entry, timeout)
        ):
            continue
        paths.append(entry.path)
        entries.append({"path": entry.path, "action": "restored" if entry.in_base else "removed"})
    if paths:
        data = b"".join(p.encode("utf-8", errors="surrogateescape") + b"\0" for p in paths)
        result = box.exec(
            ["bash", "-c", _RESTORE, "restore", base_commit],
            input=data,
            env=GRADER_GIT_ENV,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RunnerFilesError(f"cannot restore the runner files: {_tail(result)}")
    return entries


def _decoded(result: ExecResult, what: str) -> bytes:
    if result.returncode != 0 or result.timed_out:
        raise RunnerFilesError(f"{what}: {_tail(result)}")
    try:
        return base64.b64decode("".join(result.stdout.split()), validate=True)
    except binascii.Error:
        raise RunnerFilesError(f"{what}: the listing is not base64") from None


def _tail(result: ExecResult) -> str:
    return (result.stdout + result.stderr).strip()[-500:]
