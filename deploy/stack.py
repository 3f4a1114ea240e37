"""Starts and stops a whole rollserve stack on one machine: Redis, dev backend, workers, gateway.

Every child runs in its own process group with a parent-death signal, so neither Ctrl-C nor a
killed owner leaves a process behind. A supervisor restarts any child that dies (Redis on the
same port, from its append-only file), with capped exponential backoff.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from broker.celery_app import QUEUES, worker_queues
from broker.embedded import EmbeddedRedis, redact_url, write_private_file
from broker.processes import free_port, spawn, stop_group, wait_for_port
from core.settings import Settings
from deploy.engine import VllmOptions, usable_vllm, vllm_argv, vllm_env, wait_served
from deploy.supervisor import Backoff, Supervisor
from workers.jobpool import POOL_CLASS, POOL_ENV

log = logging.getLogger(__name__)


def _is_loopback(address: str) -> bool:
    address = address.strip().removeprefix("[").removesuffix("]")
    if address.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def gateway_bind_refusal(host: str, settings: Settings) -> str | None:
    """Why the gateway may not bind `host`, or None: an address beyond loopback (127.0.0.0/8,
    ::1, localhost) needs ROLLSERVE_API_TOKEN, or anyone who reaches it could use the API."""
    if settings.api_token or _is_loopback(host):
        return None
    return (
        f"refusing to bind the gateway to {host or 'every interface'}: without "
        "ROLLSERVE_API_TOKEN anyone who reaches that address could submit, read and cancel "
        "jobs; set ROLLSERVE_API_TOKEN, or bind a loopback address (127.0.0.1)"
    )


@dataclass
class DevBackendOptions:
    """How to run the development inference server (a stand-in for vLLM)."""

    model_dir: Path | None = None
    """A Hugging Face model directory; None for the tiny model (made on first use)."""
    script: Path | None = None
    port: int | None = None
    delay: float = 0.0
    delay_max: float | None = None
    """With it, each request waits a uniformly drawn time from `delay` to this."""
    unscored: bool = False
    """Scripted answers with made-up logprobs and no model loaded (load tests)."""
    extra_args: list[str] = field(default_factory=list)


@dataclass
class StackOptions:
    workers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(QUEUES, 1))
    """Worker processes (prefork concurrency) per queue."""
    run_jobs: int = 0
    """With N > 0, the RUN worker holds up to N jobs in one process, their episodes on one
    event loop (`rollserve worker run --jobs N`), instead of `workers["run"]` processes."""
    dev_backend: DevBackendOptions | None = None
    vllm: VllmOptions | None = None
    """A real vLLM server to start, wait for and register (`rollserve up --engine vllm`)."""
    backends: list[dict[str, str]] = field(default_factory=list)
    """Real inference servers to register: {"url", "model", "kind"}."""
    flower: bool = False
    flower_port: int = 5555
    flower_address: str = "127.0.0.1"
    """Interface Flower binds; anything but loopback needs ROLLSERVE_API_TOKEN (basic auth)."""
    gateway_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every child (e.g. shorter time limits in tests)."""
    ready_timeout: float = 60.0
    """Seconds `start()` waits for `GET /readyz` to answer 200 when the stack runs every part
    itself (workers on every queue and a backend); a stack missing a part does not wait."""
    restart_backoff: Backoff = field(default_factory=Backoff)
    """How the supervisor spaces the restarts of a child that dies."""


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
        self.vllm_url = ""
        self.backend_api_key = secrets.token_urlsafe(32)
        """The bearer token the inference servers this stack starts ask for on every route
        but their liveness probes (given to them in the environment, registered with them)."""
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.worker_names: dict[str, str] = {}
        self._commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        self._children_lock = threading.Lock()
        self._scratch: list[Path] = []
        """Directories outside the data directory to remove at stop."""
        self.supervisor = Supervisor(
            self._dead_children, self._restart_child, options.restart_backoff
        )

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
        refusal = gateway_bind_refusal(self.settings.host, self.settings)
        if refusal is not None:
            raise RuntimeError(refusal)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        if not self.redis_url:
            self.redis = EmbeddedRedis(
                self.data_dir / "redis", maxmemory=self.settings.redis_maxmemory
            )
            self.redis_url = self.redis.start()
            log.info("embedded Redis at %s", redact_url(self.redis_url))
        if self.options.flower:
            self._check_flower_exposure()
        # The engines load (seconds for the development server, minutes for vLLM) while the
        # workers and the gateway start: nothing of theirs needs a backend until one is
        # registered, below.
        engines_served: list[Callable[[], None]] = []
        if self.options.dev_backend is not None:
            engines_served.append(self._start_dev_backend(self.options.dev_backend))
        if self.options.vllm is not None:
            engines_served.append(self._start_vllm(self.options.vllm))
        for queue, concurrency in self.options.workers.items():
            if queue == "run" and self.options.run_jobs > 0:
                self.start_worker(queue, 1, jobs=self.options.run_jobs)
            elif concurrency > 0:
                self.start_worker(queue, concurrency)
        self._start_gateway()
        if self.options.flower:
            self._start_flower()
        for served in engines_served:
            served()
        for name in list(self.worker_names):
            self.wait_worker(name)
        self._register_backends()
        self.supervisor.start()
        if self.runs_every_part:
            self.wait_ready(self.options.ready_timeout)

    def stop(self) -> None:
        """Stop every child (workers first, Redis last); safe to call twice.

        The supervisor is paused first, so nothing is restarted while the stack goes down, and
        its thread ends last (children it restarted are tied to that thread's life).
        """
        self.supervisor.pause()
        with self._children_lock:
            order = sorted(self.children, key=lambda n: (not n.startswith("worker"), n))
            for name in order:
                stop_group(self.children.pop(name), timeout=15)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        for directory in self._scratch:
            shutil.rmtree(directory, ignore_errors=True)
        self._scratch.clear()
        self.supervisor.stop()

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
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        whole_env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a child `name` (logging to `logs/NAME.log`) with the stack's environment plus
        `env`, or exactly `whole_env` (a program of another virtualenv)."""
        log_path = self.data_dir / "logs" / f"{name}.log"
        full_env = whole_env if whole_env is not None else {**self.child_env(), **(env or {})}
        proc = spawn(argv, env=full_env, log_path=str(log_path))
        with self._children_lock:
            self.children[name] = proc
            self._commands[name] = (argv, full_env)
        return proc

    # ------------------------------------------------------------------ supervision
    def _dead_children(self) -> dict[str, int]:
        """Children (and the embedded Redis) that have ended, with their return codes."""
        with self._children_lock:
            dead = {name: p.returncode for name, p in self.children.items() if p.poll() is not None}
        code = self.redis.poll() if self.redis is not None else None
        if code is not None:
            dead["redis"] = code
        return dead

    def _restart_child(self, name: str) -> None:
        """Reap what is left of a dead child (its process group) and start it again, with the
        same command, environment and port."""
        if name == "redis":
            if self.redis is not None:
                self.redis.stop()
                self.redis.start()
            return
        with self._children_lock:
            old = self.children.get(name)
            if old is None:  # stopped on purpose meanwhile (kill_worker, stop)
                return
            stop_group(old, timeout=5)  # a dead worker's pool processes go with it
            argv, env = self._commands[name]
            log_path = self.data_dir / "logs" / f"{name}.log"
            self.children[name] = spawn(argv, env=env, log_path=str(log_path))

    def _start_dev_backend(self, opts: DevBackendOptions) -> Callable[[], None]:
        """Start the development server; returns what waits until it listens and adds it to
        the backends to register."""
        port = opts.port or free_port()
        argv = [sys.executable, "-m", "deploy.cli", "dev-backend"]
        if opts.model_dir is not None:
            argv += ["--model", str(opts.model_dir)]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        if opts.script is not None:
            argv += ["--script", str(opts.script)]
        if opts.delay:
            argv += ["--delay", str(opts.delay)]
        if opts.delay_max is not None:
            argv += ["--delay-max", str(opts.delay_max)]
        if opts.unscored:
            argv += ["--unscored"]
        argv += opts.extra_args
        proc = self._spawn("dev-backend", argv, {"VLLM_API_KEY": self.backend_api_key})
        self.dev_backend_url = f"http://127.0.0.1:{port}"

        def served() -> None:
            # First start may build the tiny model (a few seconds) before it listens.
            wait_for_port("127.0.0.1", port, 180, proc)
            model = (opts.model_dir or self.settings.tiny_model_dir).name
            self.options.backends.insert(
                0,
                {
                    "url": self.dev_backend_url,
                    "model": model,
                    "kind": "vllm",
                    "id": "dev",
                    "api_key": self.backend_api_key,
                },
            )

        return served

    def _start_vllm(self, opts: VllmOptions) -> Callable[[], None]:
        """Start a real vLLM on loopback from its own virtualenv; returns what waits until it
        serves (a minute or two on a CPU) and adds it to the backends to register."""
        status = usable_vllm(opts.venv)
        model_dir = opts.model_dir
        if model_dir is None:
            from routing.devserver.tiny import make_tiny_model

            model_dir = make_tiny_model(self.settings.tiny_model_dir)
        port = opts.port or free_port()
        name = model_dir.name
        argv = vllm_argv(
            status, model_dir, port, name, opts.max_model_len, opts.extra_args, guarded=True
        )
        scratch = self.data_dir / "vllm"
        env = vllm_env(scratch, api_key=self.backend_api_key)
        tmp = Path(env["TMPDIR"]).resolve()
        if not tmp.is_relative_to(scratch.resolve()):
            self._scratch.append(tmp)  # moved: too deep for vLLM's sockets; removed at stop
        proc = self._spawn("vllm", argv, whole_env=env)
        self.vllm_url = f"http://127.0.0.1:{port}"

        def served() -> None:
            wait_served(
                self.vllm_url,
                proc,
                self.data_dir / "logs" / "vllm.log",
                opts.ready_timeout,
                api_key=self.backend_api_key,
            )
            self.options.backends.insert(
                0,
                {
                    "url": self.vllm_url,
                    "model": name,
                    "kind": "vllm",
                    "api_key": self.backend_api_key,
                },
            )

        return served

    def start_worker(
        self,
        queue: str,
        concurrency: int,
        name: str | None = None,
        env: dict[str, str] | None = None,
        jobs: int = 0,
    ) -> str:
        """Start a prefork worker on `queue` (with `jobs` > 0, a RUN worker holding that many
        jobs on one event loop); returns its child name (for `kill_worker`).

        `env` overrides settings for this worker alone, e.g. another `ROLLSERVE_NODE_NAME`
        and `ROLLSERVE_SANDBOX_DIR` to play a second worker host.
        """
        env = env or {}
        node_name = env.get("ROLLSERVE_NODE_NAME", self.settings.node_name)
        celery_node = f"{queue}-{uuid.uuid4().hex[:6]}@{node_name}"
        child = name or f"worker-{queue}-{len(self.worker_names)}"
        argv = [
            sys.executable, "-m", "celery", "-A", "broker.worker_app", "worker",
            "-Q", ",".join(worker_queues(queue, node_name)),
            "-P", "custom" if jobs > 0 else "prefork",
            "-c", str(jobs if jobs > 0 else concurrency), "-n", celery_node,
            "-E", "--loglevel", "INFO", "--without-gossip", "--without-mingle",
        ]  # fmt: skip
        if jobs > 0:
            env = {**env, POOL_ENV: POOL_CLASS}
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
        with self._children_lock:
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

    def _check_flower_exposure(self) -> None:
        """Flower shows every job's arguments: beyond loopback only behind the API token."""
        address = self.options.flower_address
        if not self.settings.api_token and not _is_loopback(address):
            raise RuntimeError(
                f"refusing to start Flower on {address}: without ROLLSERVE_API_TOKEN it has no "
                "authentication and shows every job's arguments; set a token or bind 127.0.0.1"
            )

    @property
    def flower_password_file(self) -> Path:
        """Where Flower's password is kept when there is no API token to use (mode 0600)."""
        return self.data_dir / "flower" / "password"

    def flower_password(self) -> str:
        """Flower's password for the user `rollserve`: the API token, or without one a random
        password made once and kept in `flower_password_file`. Flower always asks for it: on
        loopback too, any local user (and any box that reached the host) could read every
        job's arguments there otherwise."""
        if self.settings.api_token:
            return self.settings.api_token
        path = self.flower_password_file
        with contextlib.suppress(FileNotFoundError):
            kept = path.read_text().strip()
            if kept:
                return kept
        password = secrets.token_urlsafe(24)
        write_private_file(path, password + "\n")
        return password

    def _start_flower(self) -> None:
        """Flower on `flower_address`, behind HTTP basic auth (`rollserve:<password>`, see
        `flower_password`) given in a configuration file of mode 0600, never on argv.

        Flower reads the broker from the Celery app (`broker.worker_app`, on the environment's
        ROLLSERVE_REDIS_URL), so the Redis password is not on its command line either.
        """
        self._check_flower_exposure()
        flower_dir = self.data_dir / "flower"
        flower_dir.mkdir(mode=0o700, exist_ok=True)
        config = flower_dir / "flowerconfig.py"
        lines = [f"basic_auth = {[f'rollserve:{self.flower_password()}']!r}"]
        write_private_file(config, "".join(line + "\n" for line in lines))
        argv = [
            sys.executable, "-m", "celery", "-A", "broker.worker_app", "flower",
            f"--port={self.options.flower_port}", f"--address={self.options.flower_address}",
            f"--conf={config}",
        ]  # fmt: skip
        proc = self._spawn("flower", argv)
        address = self.options.flower_address
        wait_for_port(
            "127.0.0.1" if address in ("0.0.0.0", "", "::") else address,
            self.options.flower_port,
            60,
            proc,
        )

    # ------------------------------------------------------------------ readiness
    @property
    def runs_every_part(self) -> bool:
        """Whether this stack itself runs a worker on every queue and has a backend to register
        (otherwise it is ready only once workers or backends from elsewhere join)."""
        workers = self.options.workers
        return bool(self.options.backends) and all(workers.get(q, 0) > 0 for q in QUEUES)

    def readiness(self) -> list[str]:
        """What the gateway's `GET /readyz` says is missing; empty when it answers 200."""
        try:
            answer = httpx.get(f"{self.gateway_url}/readyz", timeout=10)
        except httpx.HTTPError as exc:
            return [f"an answer from the gateway ({type(exc).__name__})"]
        if answer.status_code == 200:
            return []
        try:
            missing = answer.json().get("missing")
        except ValueError:
            missing = None
        return [str(m) for m in missing] if missing else [f"HTTP {answer.status_code} from /readyz"]

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until `GET /readyz` answers 200; fail naming what is missing after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            missing = self.readiness()
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"the stack is not ready after {timeout:.0f}s: missing "
                    f"{', '.join(missing)} (see the logs in {self.data_dir / 'logs'})"
                )
            time.sleep(0.25)

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
