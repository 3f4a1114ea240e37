"""Fixtures that run the development inference server as a real subprocess.

The root conftest.py loads them as a plugin, so every test can ask for them.

- `devserver_script`: a server in script mode answering from `SCRIPT` (scored by the tiny model).
- `devserver_model`: a server running the tiny model itself (real sampling).
- `devservers`: both of the above, started side by side.
- `devserver_factory`: start another server, `factory(name, script=[...], args=[...])`.

Every server runs in its own process group, tied to the test process's life, and is stopped by
its pid's group at the end of the session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.processes import free_port, spawn, stop_group
from routing.vllm import VLLMClient

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 120.0

SCRIPT: list[dict[str, Any]] = [
    {"match": "capital of France", "samples": [["Paris.", "Still Paris."], ["Lyon?"]]},
    {"match": "France", "samples": [["A country in Europe."]]},
    {"match": "Think first", "samples": [["<think>\nhmm\n</think>\n\nParis."]]},
    {
        "match": "Count with tools",
        "samples": [
            [
                '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                "The sum is 3.",
            ]
        ],
    },
    {"match": "Spell it", "samples": [["alpha STOP beta gamma"]]},
    {"match": "Round robin", "samples": [["first"], ["second"], ["third"]]},
    {"match": "Be slow", "samples": [["finally"]], "delay": 1.0},
    {"match": "Flaky twice", "samples": [["recovered"]], "errors": [503, 503]},
    {"match": "Broken for a while", "samples": [["healed"]], "errors": [502, 502]},
    {"match": "Refuse once", "samples": [["accepted"]], "errors": [400]},
    {"match": "Hold the line", "samples": [["too late"]], "delay": 60.0},
    {"match": "Flaky once via completions", "samples": [["back"]], "errors": [503]},
    {"match": "Flaky once via generate", "samples": [["back"]], "errors": [503]},
    {"match": "Flaky once via sglang", "samples": [["back"]], "errors": [503]},
]
"""The script of `devserver_script`: each test uses entries of its own (errors are consumed)."""

Spec = tuple[list[dict[str, Any]] | None, list[str]]
"""How to start a server: its script (None: model mode) and extra command-line arguments."""

SCRIPT_SPEC: Spec = (SCRIPT, [])
"""The `devserver_script` server (max_model_len 4096)."""
MODEL_SPEC: Spec = (None, ["--max-model-len", "2048"])
"""The `devserver_model` server (max_model_len 2048)."""


@dataclass
class DevBackend:
    """A running development server."""

    name: str
    url: str
    model: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def client(self, **kwargs: Any) -> VLLMClient:
        """A VLLMClient for this server (close it with `aclose`)."""
        return VLLMClient(self.url, self.model, **kwargs)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's output, for failure messages."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """`GET /metrics` as {series with labels: value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                out[series] = float(value)
        return out

    def metric(self, name: str) -> float:
        """Sum of every series of metric `name` (e.g. `vllm:prefix_cache_hits_total`)."""
        return sum(v for k, v in self.metrics().items() if k.split("{", 1)[0] == name)


def server_env(tmp: Path) -> dict[str, str]:
    """Environment of a server subprocess: caches under `tmp`, offline, repo importable."""
    env = dict(os.environ)
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    env.update(
        TMPDIR=str(tmp / "tmp"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
        TIKTOKEN_CACHE_DIR="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp / "hf"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    return env


class _Registry:
    """The servers this session started, by name."""

    def __init__(self) -> None:
        self.servers: dict[str, DevBackend] = {}
        self.cleanup_registered = False

    def ensure_cleanup(self, config: pytest.Config) -> None:
        if not self.cleanup_registered:
            config.add_cleanup(self.stop_all)
            self.cleanup_registered = True

    def stop_all(self) -> None:
        for backend in self.servers.values():
            stop_group(backend.proc)
        self.servers.clear()
        self.cleanup_registered = False


_registry = _Registry()


def _spawn(
    name: str,
    model_dir: Path,
    workdir: Path,
    *,
    script: list[dict[str, Any]] | None,
    args: list[str],
) -> DevBackend:
    home = workdir / name
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "routing.devserver",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        name,
    ]
    if script is not None:
        path = home / "script.jsonl"
        path.write_text("".join(json.dumps(entry) + "\n" for entry in script))
        argv += ["--script", str(path)]
    argv += args
    log_path = home / "server.log"
    proc = spawn(argv, env=server_env(home), cwd=str(REPO), log_path=str(log_path))
    return DevBackend(name, f"http://127.0.0.1:{port}", name, proc, log_path)


def _wait_ready(backends: list[DevBackend]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    pending = list(backends)
    while pending:
        backend = pending[0]
        if backend.proc.poll() is not None:
            raise RuntimeError(
                f"dev server {backend.name} exited with {backend.proc.returncode}:\n"
                f"{backend.log_tail()}"
            )
        try:
            if httpx.get(f"{backend.url}/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"dev server {backend.name} not up:\n{backend.log_tail()}")
        time.sleep(0.1)


def start_devservers(
    config: pytest.Config,
    model_dir: Path,
    workdir: Path,
    specs: dict[str, Spec],
) -> dict[str, DevBackend]:
    """Start the servers of `specs` (name → (script or None for model mode, extra args)) that
    are not running yet, all at once, and wait until every one answers `/health`."""
    _registry.ensure_cleanup(config)
    fresh = []
    for name, (script, args) in specs.items():
        if name not in _registry.servers:
            backend = _spawn(name, model_dir, workdir, script=script, args=args)
            _registry.servers[name] = backend
            fresh.append(backend)
    try:
        _wait_ready(fresh)
    except Exception:
        for backend in fresh:
            stop_group(backend.proc)
            _registry.servers.pop(backend.name, None)
        raise
    return {name: _registry.servers[name] for name in specs}


@pytest.fixture(scope="session", autouse=True)
def torch_caches_in_session_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Importing torch's compiler creates `$TMPDIR/torchinductor_$USER` unless told otherwise:
    keep it in this session's temporary directory."""
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "torchinductor")
    )


@pytest.fixture(scope="session")
def devserver_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the servers keep their logs, scripts and caches."""
    return tmp_path_factory.getbasetemp() / "devservers"


@pytest.fixture(scope="session")
def devservers(
    request: pytest.FixtureRequest, tiny_model_dir: Path, devserver_workdir: Path
) -> dict[str, DevBackend]:
    """The scripted (`"script"`) and the model (`"model"`) servers, started side by side."""
    return start_devservers(
        request.config,
        tiny_model_dir,
        devserver_workdir,
        {"script": SCRIPT_SPEC, "model": MODEL_SPEC},
    )


@pytest.fixture(scope="session")
def devserver_script(
    request: pytest.FixtureRequest, tiny_model_dir: Path, devserver_workdir: Path
) -> DevBackend:
    """A server in script mode answering from `SCRIPT`; max_model_len 4096."""
    started = start_devservers(
        request.config, tiny_model_dir, devserver_workdir, {"script": SCRIPT_SPEC}
    )
    return started["script"]


@pytest.fixture(scope="session")
def devserver_model(
    request: pytest.FixtureRequest, tiny_model_dir: Path, devserver_workdir: Path
) -> DevBackend:
    """A server sampling from the tiny model itself; max_model_len 2048."""
    started = start_devservers(
        request.config, tiny_model_dir, devserver_workdir, {"model": MODEL_SPEC}
    )
    return started["model"]


@pytest.fixture(scope="session")
def devserver_factory(
    request: pytest.FixtureRequest, tiny_model_dir: Path, devserver_workdir: Path
) -> Callable[..., DevBackend]:
    """`factory(name, script=None, args=())` starts (once per name) another server."""

    def factory(
        name: str, script: list[dict[str, Any]] | None = None, args: list[str] | None = None
    ) -> DevBackend:
        started = start_devservers(
            request.config,
            tiny_model_dir,
            devserver_workdir,
            {name: (script, list(args or []))},
        )
        return started[name]

    return factory
