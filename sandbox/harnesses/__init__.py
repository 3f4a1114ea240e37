"""Agent harnesses run unmodified inside a job's box, their model calls going to the job's
endpoint (`sandbox.endpointdir`) through the forwarder on the box's loopback
(`sandbox.llmforward`).

A harness runs from its own virtualenv, `.harness-venv/` beside the project (`make
harness-env`), which boxes see read-only at its host path (`harness_env_bind()`, a bind for
the job's `SandboxSpec`), so its scripts' shebangs hold; its base Python is the service's
own, which every box has (`sandbox.startup.service_paths`). The forwarder and the drivers in
this directory (`mini_swe_agent.py`) are reached in the box at their host paths too: the
`sandbox` package is part of every box. `sandbox.keeper.run_harness` runs one.
"""

from __future__ import annotations

import os
from pathlib import Path

from sandbox.base import Bind, SandboxError

HARNESS_VENV_ENV = "ROLLSERVE_HARNESS_VENV"
"""Environment variable naming the harnesses' virtualenv (default: `.harness-venv` beside
the `sandbox` package, where `make harness-env` makes it)."""
FORWARDER = Path(__file__).resolve().parent.parent / "llmforward.py"
"""The forwarder script, at the host path boxes see it at."""
MINI_SWE_AGENT = Path(__file__).resolve().parent / "mini_swe_agent.py"
"""The driver that runs mini-swe-agent on one task (run with the harnesses' Python)."""
ENDPOINT_URLS: dict[str, str] = {
    "OPENAI_BASE_URL": "http://127.0.0.1:{port}/v1",
    "ANTHROPIC_BASE_URL": "http://127.0.0.1:{port}",
}
"""The variables a harness finds its endpoint by, `{port}` being the forwarder's."""
KEY_VARIABLES = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")
"""The variables a harness finds the job's key in."""
STAMP = ".installed-stamp"
"""Written in the virtualenv by `make harness-env` once everything in it is installed."""


def harness_venv() -> Path:
    """The harnesses' virtualenv on this host (`ROLLSERVE_HARNESS_VENV`, else `.harness-venv`
    beside the `sandbox` package), made absolute but not resolved: its scripts' shebangs
    name it as `make harness-env` made it."""
    named = os.environ.get(HARNESS_VENV_ENV)
    venv = Path(named) if named else Path(__file__).resolve().parent.parent.parent / ".harness-venv"
    return venv.absolute()


def harness_python(venv: Path | None = None) -> Path:
    """The harnesses' interpreter, at the path boxes given `harness_env_bind` run it at."""
    return (venv or harness_venv()) / "bin" / "python"


def harness_env_ready(venv: Path | None = None) -> bool:
    """True once `make harness-env` has made the virtualenv whole."""
    return ((venv or harness_venv()) / STAMP).is_file()


def harness_env_bind(venv: Path | None = None) -> Bind:
    """A read-only bind of the harnesses' virtualenv at its own host path, for the spec of a
    box that runs a harness; SandboxError when it has not been made (`make harness-env`)."""
    venv = venv or harness_venv()
    if not harness_env_ready(venv):
        raise SandboxError(f"no harness environment at {venv}: run `make harness-env`")
    return Bind(host=venv, inside=str(venv), read_only=True)


def forwarder_argv(python: str, socket_path: str, command: list[str], port: int = 0) -> list[str]:
    """The command line that runs `command` under the forwarder: it listens on the box's
    127.0.0.1:`port` (0: a free one), relays to `socket_path` (as the box sees it), and gives
    `command` the `ENDPOINT_URLS` on that port."""
    urls = [f"--url={name}={template}" for name, template in ENDPOINT_URLS.items()]
    return [python, "-I", "-S", str(FORWARDER), "--socket", socket_path, "--port", str(port),
            *urls, "--", *command]  # fmt: skip


def key_env(api_key: str) -> dict[str, str]:
    """The job's key under every name a harness looks for it."""
    return dict.fromkeys(KEY_VARIABLES, api_key)
