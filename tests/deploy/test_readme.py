"""The README stays true to the code it documents."""

from __future__ import annotations

from pathlib import Path

from core.settings import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_readme_table() -> None:
    missing = [
        f"ROLLSERVE_{name.upper()}"
        for name in Settings.model_fields
        if f"| `ROLLSERVE_{name.upper()}` |" not in README
    ]
    assert missing == []


def test_quick_start_is_the_two_make_targets() -> None:
    quick_start = README.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick_start.splitlines()]
    assert [c for c in commands if c.startswith("make")] == ["make demo", "make test"]
