"""Real vLLM servers for the benchmarks: started from `make vllm`'s virtualenv, stopped by
process group, their temporary files removed.

A benchmark that cannot start one (vLLM not installed, or it will not serve) records why in
its JSON rather than failing: `EngineUnavailable` carries the reason.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.processes import free_port, spawn, stop_group
from deploy.engine import log_tail, usable_vllm, vllm_argv, vllm_env, wait_served

READY_TIMEOUT = 900.0
"""Seconds a server may take to serve; several starting together on two cores take longer."""


class EngineUnavailable(RuntimeError):
    """No real vLLM could be started here; the message says why."""


@dataclass
class Engine:
    name: str
    url: str
    model: str
    proc: Any
    log: Path
    tmp: Path
    ready_s: float = 0.0

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log, lines)


def start_engines(
    model_dir: Path,
    work: Path,
    names: list[str],
    extra_args: list[str] | None = None,
    max_model_len: int = 2048,
) -> list[Engine]:
    """One vLLM server per name, started together, each serving `model_dir` under its own
    directory of `work`; returns once all serve. Raises `EngineUnavailable` when vLLM is not
    installed or a server does not come up (the others are stopped)."""
    try:
        status = usable_vllm()
    except RuntimeError as exc:
        raise EngineUnavailable(str(exc)) from None
    started, engines = time.monotonic(), []
    try:
        for name in names:
            port, scratch = free_port(), work / name
            env = vllm_env(scratch)
            argv = vllm_argv(status, model_dir, port, model_dir.name, max_model_len, extra_args)
            log = work / f"{name}.log"
            proc = spawn(argv, env=env, log_path=str(log))
            url = f"http://127.0.0.1:{port}"
            engines.append(Engine(name, url, model_dir.name, proc, log, Path(env["TMPDIR"])))
        for engine in engines:
            wait_served(engine.url, engine.proc, engine.log, READY_TIMEOUT)
            engine.ready_s = time.monotonic() - started
    except (RuntimeError, TimeoutError) as exc:
        stop_engines(engines)
        raise EngineUnavailable(f"vLLM did not serve: {exc}") from None
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: list[Engine]) -> None:
    for engine in engines:
        stop_group(engine.proc, timeout=30)
        if str(engine.tmp).startswith("/tmp/rollserve-vllm-"):
            shutil.rmtree(engine.tmp, ignore_errors=True)
