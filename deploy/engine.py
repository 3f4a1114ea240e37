"""A real vLLM server as a managed child of the stack (`rollserve up --engine vllm`).

The server runs from the CPU build's own virtualenv (`make vllm`, `deploy.vllm_env`) with the
flags that hold on a CPU machine: float32 weights (vLLM otherwise runs them as bf16 without a
word), eager mode (ready in about a minute and a half instead of two and a half), prefix
caching, and scale-out, which enables `/inference/v1/generate` (403 otherwise). Its caches and
temporary files stay in the stack's data directory.

Weight updates (`routing.weights`) need vLLM's development mode (`VLLM_SERVER_DEV_MODE=1`, set by
`vllm_env`) and rollserve's worker extension (`deploy/vllm_plugins/rollserve_vllm_worker.py`,
on the server's `PYTHONPATH` by `vllm_env`, named by `vllm_argv`). Development mode also
serves endpoints that run methods on the workers, reset caches, pause the engine and report its
whole configuration and environment (`/collective_rpc`, `/pause`, `/server_info`, ...), with no
authentication: a server started this way must not face an untrusted network (rollserve binds
it to 127.0.0.1).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from deploy.vllm_env import VllmStatus, find_vllm, vllm_process_env
from routing.vllm import bearer

PLUGINS = Path(__file__).resolve().parent / "vllm_plugins"
"""Modules vLLM imports from its own virtualenv (this directory goes on its `PYTHONPATH`)."""
WORKER_EXTENSION = "rollserve_vllm_worker.RollserveWorker"
GUARD_MIDDLEWARE = "rollserve_vllm_guard.GuardEveryRoute"
"""The ASGI middleware asking for the API key on every route (`routing.devserver.guard`)."""
"""The worker extension whose `rollserve_load_weights` loads new weights (`routing.weights`)."""

MAX_NUM_SEQS = 16
"""Requests a server runs at once. Its step budget is this many whole contexts, so no prompt
is ever prefilled in pieces: vLLM 0.32's CPU build kills its engine when a request with a
`seed` is (`RuntimeError: CPU Generator does not use offset`, in `_bookkeeping_sync`, which
rewinds the seeded generator of a partly prefilled request; CPU generators cannot rewind)."""

ENGINES = ("dev", "vllm")
"""What `rollserve up --engine` starts: the development server, or a real vLLM."""

READY_TIMEOUT = 600.0
"""Seconds a vLLM server may take to answer `/health` (64 to 93 s on an idle 2-core machine)."""


@dataclass
class VllmOptions:
    """A vLLM server the stack starts, waits for and registers."""

    model_dir: Path | None = None
    """The model to serve (None: the tiny model, built when missing)."""
    port: int | None = None
    max_model_len: int = 2048
    venv: Path | None = None
    """The vLLM virtualenv (None: `deploy.vllm_env.default_venv()`)."""
    extra_args: list[str] = field(default_factory=list)
    ready_timeout: float = READY_TIMEOUT


def usable_vllm(venv: Path | None = None) -> VllmStatus:
    """The vLLM install, raising `RuntimeError` saying what to do when it cannot serve."""
    status = find_vllm(venv)
    if not status.usable:
        raise RuntimeError(f"cannot start vLLM: {status.reason}")
    return status


def vllm_argv(
    status: VllmStatus,
    model_dir: Path,
    port: int,
    served_name: str,
    max_model_len: int = 2048,
    extra_args: list[str] | None = None,
    *,
    guarded: bool = False,
) -> list[str]:
    """The command serving `model_dir` on loopback `port` as `served_name`, with rollserve's
    worker extension (which needs `vllm_env`'s `PYTHONPATH`). `guarded`: every route but the
    liveness probes asks for the key `vllm_env(..., api_key=)` sets (`--middleware
    rollserve_vllm_guard.GuardEveryRoute`; vLLM's own `--api-key` covers only `/v1` and a few
    other prefixes, not its development routes)."""
    guard = ["--middleware", GUARD_MIDDLEWARE] if guarded else []
    return [
        str(status.executable), "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", served_name,
        "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching",
        "--max-model-len", str(max_model_len), "--enable-scale-out",
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(MAX_NUM_SEQS * max_model_len),
        "--worker-extension-cls", WORKER_EXTENSION,
        *guard,
        *(extra_args or []),
    ]  # fmt: skip


IPC_DIR_MAX = 64
"""Longest temporary directory vLLM gets: it binds ZeroMQ sockets there under 37 more
characters, and a Unix socket's path holds at most 107."""


def vllm_env(scratch: Path, api_key: str | None = None) -> dict[str, str]:
    """The server's whole environment (not the project's venv), its files under `scratch`.

    When `scratch` is too deep for vLLM's sockets (`IPC_DIR_MAX`), its temporary files go to
    a private directory of `/tmp` instead (`TMPDIR` in the result; the caller removes it).

    Development mode is on (`VLLM_SERVER_DEV_MODE=1`, for weight updates) and `PYTHONPATH`
    holds `PLUGINS` (add to it, do not replace it): such a server must not face an untrusted
    network (see the module's docstring)."""
    scratch.mkdir(parents=True, exist_ok=True)
    env = vllm_process_env(scratch)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONPATH"] = str(PLUGINS)
    if api_key:
        env["VLLM_API_KEY"] = api_key  # in the environment, never on the command line
    if len(str(scratch.resolve())) > IPC_DIR_MAX:
        env["TMPDIR"] = tempfile.mkdtemp(prefix="rollserve-vllm-", dir="/tmp")
    return env


def wait_served(
    url: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    timeout: float,
    api_key: str | None = None,
) -> None:
    """Block until the server at `url` answers `/health` with 200 and lists its model; raise
    `RuntimeError` with the end of its log if it exits, `TimeoutError` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with {proc.returncode} before serving; its log ends:\n"
                + log_tail(log)
            )
        try:
            if (
                httpx.get(f"{url}/health", timeout=5).status_code == 200
                and httpx.get(f"{url}/v1/models", timeout=5, headers=bearer(api_key)).status_code
                == 200
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(
        f"vLLM did not answer {url}/health within {timeout:.0f}s; its log ends:\n" + log_tail(log)
    )


def log_tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.strip().splitlines()[-lines:])
