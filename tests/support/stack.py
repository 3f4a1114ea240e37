"""A whole stack (embedded Redis, dev backend, prefork workers, gateway) for end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from broker.processes import free_port
from core.settings import Settings
from deploy.stack import DevBackendOptions, Stack, StackOptions

# Short limits so a killed worker's job is redelivered within the test's patience, and short
# liveness timers so a dead worker's stages are taken over in seconds (tests/e2e/test_recovery.py
# keeps the production timers, `PRODUCTION_TIMERS`).
FAST_LIMITS = {
    "heartbeat_interval": 1.0,
    "heartbeat_ttl": 8.0,
    "sweep_interval": 1.0,
    "init_soft_time_limit": 8.0,
    "init_time_limit": 10.0,
    "run_soft_time_limit": 8.0,
    "run_time_limit": 10.0,
    "eval_soft_time_limit": 8.0,
    "eval_time_limit": 10.0,
    "visibility_timeout": 12.0,
    "redelivery_check_interval": 1.0,
}


PRODUCTION_TIMERS = {
    name: Settings.model_fields[name].default
    for name in ("heartbeat_interval", "heartbeat_ttl", "sweep_interval")
}
"""The liveness timers as deployed (their defaults)."""


# Roomy limits for a stack that runs the tiny model itself (a slow turn is not a hung one).
ROOMY_LIMITS = {
    "init_soft_time_limit": 60.0,
    "init_time_limit": 70.0,
    "run_soft_time_limit": 60.0,
    "run_time_limit": 70.0,
    "eval_soft_time_limit": 60.0,
    "eval_time_limit": 70.0,
    "visibility_timeout": 90.0,
}


def start_stack(
    data_dir: Path,
    model_dir: Path,
    *,
    script: list[dict[str, Any]] | None = None,
    workers: dict[str, int] | None = None,
    run_jobs: int = 0,
    dev_args: list[str] | None = None,
    **settings: Any,
) -> Stack:
    """A started stack; with `run_jobs` > 0 its RUN worker holds that many jobs on one event
    loop (`rollserve worker run --jobs N`) instead of prefork processes. Without a `script`
    the development server samples from the tiny model itself; `dev_args` are more of its
    command-line options (`--max-model-len 1024`)."""
    script_path = None
    if script is not None:
        script_path = data_dir / "script.jsonl"
        data_dir.mkdir(parents=True, exist_ok=True)
        script_path.write_text("".join(json.dumps(entry) + "\n" for entry in script))
    # Boxes of its own unless the module names a directory: stacks of other modules run
    # beside it (another xdist worker, another Redis), and a reaper takes a box whose job its
    # own Redis does not know, in a directory both share, for an orphan.
    settings.setdefault("sandbox_dir", data_dir / "boxes")
    config = Settings(data_dir=data_dir, port=free_port(), **{**FAST_LIMITS, **settings})
    options = StackOptions(
        workers=workers or {"init": 1, "run": 2, "eval": 1},
        dev_backend=DevBackendOptions(
            model_dir=model_dir, script=script_path, extra_args=list(dev_args or [])
        ),
        run_jobs=run_jobs,
    )
    return Stack(config, options).start()
