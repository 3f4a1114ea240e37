"""bench/proxy.py, the harness endpoint against a direct engine call, on a small real run: its
JSON carries every figure it promises, and the token record matches the engine's answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.full

ROOT = Path(__file__).resolve().parents[2]
HARNESS_READY = (ROOT / ".harness-venv" / ".installed-stamp").is_file()


def run_small(tmp_path: Path, model_dir: Path) -> dict[str, Any]:
    """`--quick` with two small levels (1 and 4 jobs in flight): the last line's JSON."""
    figure = tmp_path / "proxy.png"
    options = ["--quick", "--levels", "1,4", "--model", str(model_dir), "--figure", str(figure)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "proxy.py"), *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, Any] = json.loads(run.stdout.rstrip("\n").splitlines()[-1])
    assert result["figure"] == str(figure) and figure.stat().st_size > 0
    return result


def test_quick_prints_every_figure_and_records_the_engines_ids(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    result = run_small(tmp_path, tiny_model_dir)
    assert result["bench"] == "proxy" and result["quick"] is True
    assert set(result["proxy_overhead_by_concurrency"]) == {"1", "4"}
    for entry in result["proxy_overhead_by_concurrency"].values():
        assert {"p50_ms", "p99_ms", "ratio_p50", "ratio_p99"} <= set(entry)
        assert {"p50_ms", "p99_ms"} <= set(entry["openai_sdk"])
        assert entry["direct"]["calls"] == entry["endpoint_aiohttp"]["calls"] > 0
        assert entry["requests_differing_from_direct"] == 0
    assert result["conditions"]["headline_level"] == 4
    assert isinstance(result["proxy_overhead_p50_ms"], float)
    assert isinstance(result["cpu_ms_per_call"], float)
    assert result["generated_ids_checked"] > 0 and result["differing_ids"] == 0
    assert result["saturated"]["endpoint_calls_per_s"] > 0
    if HARNESS_READY:
        runs = result["mini_swe_agent"]
        assert [r["actions"] for r in runs] == ["toolcall", "text"]
        assert all(r["exit_status"] == "Submitted" and r["check_passed"] for r in runs), runs
        assert result["segments_per_job_p50"] >= 1
        assert sum(result["segment_reasons"].values()) == sum(r["segments"] for r in runs)
    else:  # no made-up figures: null, and the notes say why
        assert result["segments_per_job_p50"] is None and result["segment_reasons"] is None
        assert any("harness" in note for note in result["notes"])
