"""Starts and stops a whole rollserve stack on one machine: Redis, dev backend, workers, gateway.

Every child runs in its own process group with a parent-death signal, so neither Ctrl-C nor a
killed owner leaves a process behind.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from broker.celery_app import QUEUES, worker_queues
from broker.embedded import EmbeddedRedis
from broker.processes import free_port, spawn, stop_group, wait_for_port
from broker.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class DevBackendOptions:
    """How to run the development inference server (a stand-in for vLLM)."""

    model_dir: Path | None = None
    """A Hugging Face model directory; None for the tiny model (made on first use)."""
    script: Path | None = None
    port: int | None = None
    delay: float = 0.0
    extra_args: list[str] = field(default_factory=list)


@dataclass
class StackOptions:
    workers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(QUEUES, 1))
    """Worker processes (prefork concurrency) per queue."""
    dev_backend: DevBackendOptions | None = None
    backends: list[dict[str, str]] = field(default_factory=list)
    """Real inference servers to register: {"url", "model", "kind"}."""
    flower: bool = False
    flower_port: int = 5555
    gateway_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every child (e.g. shorter time limits in tests)."""


class Stack:
    """One machine's rollserve: `start()` brings everything up and registers the backends."""

    def __init__(self, settings: Settings, options: StackOptions) -> None:
        self.settings = settings
        self.options = options
        self.data_dir = settings.data_dir
        self.redis: EmbeddedRedis | None = None
        self.redis_url = settings.redis_url or ""
        self.gateway_url = ""
        self.dev_backend_url = ""
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.worker_names: dict[str, str] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Stack:
        """Bring the stack up; a second call (e.g. `with` on a started stack) does nothing."""
        if self.children or self.redis is not None:
            return self
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        if not self.redis_url:
            self.redis = EmbeddedRedis(self.data_dir / "redis")
            self.redis_url = self.redis.start()
            log.info("embedded Redis at %s", self.redis_url)
        if self.options.dev_backend is not None:
            self._start_dev_backend(self.options.dev_backend)
        for queue, concurrency in self.options.workers.items():
            if concurrency > 0:
                self.start_worker(queue, concurrency)
        self._start_gateway()
        if self.options.flower:
            self._start_flower()
        for name in list(self.worker_names):
            self.wait_worker(name)
        self._register_backends()

    def stop(self) -> None:
        """Stop every child (workers first, Redis last); safe to call twice."""
        order = sorted(self.children, key=lambda n: (not n.startswith("worker"), n))
        for name in order:
            stop_group(self.children.pop(name), timeout=15)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ parts
    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.settings.as_env())
        env.update(self.options.env)
        env["ROLLSERVE_REDIS_URL"] = self.redis_url
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log_path = self.data_dir / "logs" / f"{name}.log"
        proc = spawn(argv, env={**self.child_env(), **(env or {})}, log_path=str(log_path))
        self.children[name] = proc
        return proc

    def _start_dev_backend(self, opts: DevBackendOptions) -> None:
        port = opts.port or free_port()
        argv = [sys.executable, "-m", "deploy.cli", "dev-backend"]
        if opts.model_dir is not None:
            argv += ["--model", str(opts.model_dir)]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        if opts.script is not None:
            argv += ["--script", str(opts.script)]
        if opts.delay:
            argv += ["--delay", str(opts.delay)]
        argv += opts.extra_args
        proc = self._spawn("dev-backend", argv)
        # First start may build the tiny model (a few seconds) before it listens.
        wait_for_port("127.0.0.1", port, 180, proc)
        self.dev_backend_url = f"http://127.0.0.1:{port}"
        model = (opts.model_dir or self.settings.tiny_model_dir).name
        self.options.backends.insert(
            0, {"url": self.dev_backend_url, "model": model, "kind": "vllm", "id": "dev"}
        )

    def start_worker(
        self,
        queue: str,
        concurrency: int,
        name: str | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        """Start a prefork worker on `queue`; returns its child name (for `kill_worker`).

        `env` overrides settings for this worker alone, e.g. another `ROLLSERVE_NODE_NAME`
        and `ROLLSERVE_SANDBOX_DIR` to play a second worker host.
        """
        env = env or {}
        node_name = env.get("ROLLSERVE_NODE_NAME", self.settings.node_name)
        celery_node = f"{queue}-{uuid.uuid4().hex[:6]}@{node_name}"
        child = name or f"worker-{queue}-{len(self.worker_names)}"
        argv = [
            sys.executable, "-m", "celery", "-A", "broker.worker_app", "worker",
            "-Q", ",".join(worker_queues(queue, node_name)), "-P", "prefork",
            "-c", str(concurrency), "-n", celery_node,
            "-E", "--loglevel", "INFO", "--without-gossip", "--without-mingle",
        ]  # fmt: skip
        self._spawn(child, argv, env)
        self.worker_names[child] = celery_node
        return child

    def wait_worker(self, child: str, timeout: float = 60.0) -> None:
        """Block until the worker answers a ping."""
        from broker.celery_app import create_celery

        app = create_celery(self.settings, self.redis_url)
        node = self.worker_names[child]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.children.get(child)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{child} exited with {proc.returncode}; see its log")
            if app.control.ping(destination=[node], timeout=0.5):
                return
        raise TimeoutError(f"{child} did not come up within {timeout:.0f}s")

    def kill_worker(self, child: str, sig: int) -> None:
        """Send `sig` to a worker's whole process group (its main process and pool children)."""
        proc = self.children.pop(child)
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
        stop_group(proc)
        self.worker_names.pop(child, None)

    def _start_gateway(self) -> None:
        port = self.options.gateway_port or self.settings.port
        argv = [
            sys.executable, "-m", "uvicorn", "api.main:app",
            "--host", self.settings.host, "--port", str(port), "--log-level", "warning",
        ]  # fmt: skip
        proc = self._spawn("gateway", argv)
        wait_for_port(self.settings.host, port, 60, proc)
        self.gateway_url = f"http://{self.settings.host}:{port}"

    def _start_flower(self) -> None:
        argv = [
            sys.executable, "-m", "celery", "-A", "broker.worker_app", "flower",
            f"--port={self.options.flower_port}", "--address=127.0.0.1",
        ]  # fmt: skip
        self._spawn("flower", argv)

    def _register_backends(self) -> None:
        headers = {}
        if self.settings.api_token:
            headers["Authorization"] = f"Bearer {self.settings.api_token}"
        for backend in self.options.backends:
            answer = httpx.post(
                f"{self.gateway_url}/v1/backends", json=backend, headers=headers, timeout=30
            )
            if answer.status_code != 201:
                raise RuntimeError(f"registering backend {backend['url']} failed: {answer.text}")
