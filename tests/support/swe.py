"""The SWE examples' task builder and whether bubblewrap can make boxes here."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

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
