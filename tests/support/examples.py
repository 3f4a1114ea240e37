"""The shipped examples (`examples/`) as the tests read them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def read_jsonl(name: str) -> list[dict[str, Any]]:
    lines = (EXAMPLES / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def expected_rewards() -> dict[str, list[float]]:
    """The README's table of expected demo rewards: instance_id → reward per sample."""
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Expected demo rewards", 1)[1]
    table: dict[str, list[float]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if (
            len(cells) == 8
            and re.fullmatch(r"[A-Za-z][\w-]*", cells[0])
            and cells[0] != "instance_id"
        ):
            table[cells[0]] = [float(cell.split()[0]) for cell in cells[3:7]]
    return table
