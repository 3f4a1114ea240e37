"""The README and the guides under `docs/` stay true to the code they document.

README.md is a front page (at most 300 lines) whose quick start is the two make targets, and it
links every guide. On every page, README.md and each `docs/*.md` alike: every relative link and
image points to a file that exists (and to a heading that exists, when it names one); every
`make` target, `rollserve` subcommand and option, and repository path a command or code span
names exists; every `ROLLSERVE_*` variable named is read somewhere in the code. Every setting is
in the settings table, and every row of it is a setting.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from core.settings import Settings
from deploy.autoscale.command import add_arguments as add_autoscale_arguments
from deploy.cli import build_parser
from routing.devserver.cli import _serve_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
SETTINGS_PAGE = ROOT / "docs" / "operating.md"
MAX_README_LINES = 300

# Top-level directories of the repository: a code span naming a path under one of them names a
# file of the checkout (`bench/dapo.py`, `deploy/systemd/`), which must exist.
TOP_DIRS = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
PATH_RE = re.compile(rf"(?<![\w./$<-])((?:{'|'.join(TOP_DIRS)})/[\w./@+-]*)")
FENCE_RE = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
SPAN_RE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING_RE = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
MAKE_RE = re.compile(r"(?:^|[\s;&|(])make\s+([a-z][\w-]*)")
ROLLSERVE_RE = re.compile(r"(?:^|[\s/])rollserve\s+([a-z][\w-]*)(.*)")
OPTION_RE = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
VARIABLE_RE = re.compile(r"\bROLLSERVE_[A-Z0-9_]*[A-Z0-9]\b(?!_?\*)")


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE_RE.sub("", text)


def code(text: str) -> list[str]:
    """Every command or code fragment of a page, one per entry: each line of a fenced block
    (continuation lines joined, shell comments dropped) and each inline code span."""
    fragments: list[str] = []
    for block in FENCE_RE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            fragments.append(re.split(r"\s#\s", line, maxsplit=1)[0])
    for span in SPAN_RE.findall(prose(text)):
        fragments.append(" ".join(span.replace("\\|", "|").split()))
    return fragments


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    for heading in HEADING_RE.findall(prose(page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_the_guides_are_there() -> None:
    assert {p.name for p in DOCS} >= {
        "running.md",
        "training.md",
        "operating.md",
        "security.md",
        "benchmarks.md",
        "api.md",
    }


def test_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_readme_links_every_guide_and_keeps_not_built_yet() -> None:
    text = README.read_text()
    linked = {target.split("#")[0] for target in LINK_RE.findall(prose(text))}
    assert [page_id(p) for p in DOCS if page_id(p) not in linked] == []
    assert "not-built-yet" in anchors(README)


def test_quick_start_is_the_two_make_targets() -> None:
    quick_start = README.read_text().split("## Quick start", 1)[1].split("##", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick_start.splitlines()]
    assert [c for c in commands if c.startswith("make")] == ["make demo", "make test"]


def settings_rows() -> list[str]:
    """The variables of the settings table."""
    text = SETTINGS_PAGE.read_text()
    table = text.split("\n## Settings\n", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\| `(ROLLSERVE_\w+)` \|", table, re.MULTILINE)


def test_every_setting_is_in_the_settings_table() -> None:
    rows = settings_rows()
    missing = [
        f"ROLLSERVE_{name.upper()}"
        for name in Settings.model_fields
        if f"ROLLSERVE_{name.upper()}" not in rows
    ]
    assert missing == []


def test_every_row_of_the_settings_table_is_a_setting() -> None:
    names = {f"ROLLSERVE_{name.upper()}" for name in Settings.model_fields}
    rows = settings_rows()
    assert [row for row in rows if row not in names] == []
    assert len(rows) == len(set(rows)), "a setting is in the table twice"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK_RE.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_repository_path_named_exists(page: Path) -> None:
    missing = set()
    for fragment in code(page.read_text()):
        for path in PATH_RE.findall(fragment):
            path = path.rstrip(".,:;")
            if not (ROOT / path).exists():
                missing.add(path)
    assert sorted(missing) == []


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.MULTILINE))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_make_target_named_exists(page: Path) -> None:
    targets = makefile_targets()
    named = {t for fragment in code(page.read_text()) for t in MAKE_RE.findall(fragment)}
    assert sorted(named - targets) == []


def subcommand_options() -> dict[str, set[str]]:
    """Each `rollserve` subcommand and the options it accepts."""
    subparsers = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    options = {
        name: set(parser._option_string_actions) for name, parser in subparsers.choices.items()
    }
    autoscale = argparse.ArgumentParser()
    add_autoscale_arguments(autoscale)
    options["autoscale"] |= set(autoscale._option_string_actions)
    options["dev-backend"] = set(_serve_parser()._option_string_actions)
    return options


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_rollserve_command_and_option_named_exists(page: Path) -> None:
    options = subcommand_options()
    wrong = set()
    for fragment in code(page.read_text()):
        for line in fragment.splitlines():
            for command, rest in ROLLSERVE_RE.findall(line):
                if command not in options:
                    wrong.add(f"rollserve {command}")
                    continue
                wrong |= {
                    f"rollserve {command} {option}"
                    for option in OPTION_RE.findall(rest)
                    if option not in options[command]
                }
    assert sorted(wrong) == []


def source_text() -> str:
    """Everything the project runs or ships, but its documentation (virtualenvs, caches and
    other hidden directories but `.ci` are not walked)."""
    parts = []
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = [
            d
            for d in subdirs
            if d not in {"docs", "results", "__pycache__"} and (d == ".ci" or not d.startswith("."))
        ]
        for name in files:
            path = Path(directory, name)
            if path.suffix in {".md", ".png", ".pyc", ".jsonl", ".json"}:
                continue
            if path.stat().st_size <= 2**20:
                parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


def test_every_rollserve_variable_named_is_read_somewhere() -> None:
    source = source_text()
    unknown = set()
    for page in PAGES:
        for name in VARIABLE_RE.findall(page.read_text()):
            if (
                not re.search(rf"\b{name}\b", source)
                and name.removeprefix("ROLLSERVE_").lower() not in Settings.model_fields
            ):
                unknown.add(f"{page_id(page)}: {name}")
    assert sorted(unknown) == []
