"""Boxes that are Apptainer (Singularity) instances: rootless containers for HPC clusters.

A sandbox is one instance started through spython (`instance start`) with `--contain`
(no host directories but the binds; the current directory is not mounted either),
`--writable-tmpfs`, `--no-home`, `--cleanenv`, and `--net --network none` (a spec with network
is refused: it would share the host's); `--fakeroot` when the backend is made with it. The
binds are the socket directory (`/rollserve/sock`), the workspace (`/workspace`), the spec's,
the endpoint directory (`/rollserve/llm`, read-only) when the spec asks for it,
and the service's Python and packages read-only at their host paths, so the tool server runs
from the service's own environment (the image must be able to run that interpreter: same libc
family).

Images: a `.sif` file (or sandbox directory) is used as is; a `docker://` (or other URI)
reference is built once per node into a `.sif` in the cache directory, named after the
reference, under a lock file, so two workers never build the same image twice.

The tool server and every `exec` run inside the instance through `instance exec`. spython's
`execute` has no timeout, no stdin and no handle to kill, so those command lines are run by
this module; spython starts, lists and stops instances and builds images.

Processes of an instance share its namespaces: an `exec` that outlives its timeout is killed
with its process group, and `stop` ends the whole instance. As root without `--fakeroot`,
RLIMIT_NPROC is not enforced (the kernel exempts uid 0): run the service unprivileged.

The box-wide limits (memory, processes, CPU share) are passed as apptainer's own cgroup flags
(`--memory`, `--pids-limit`, `--cpu-shares`) where it can apply them (`cgroup_options`);
the box has no disk of its own, so its disk limits are not enforced.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from sandbox.base import (
    ALLOW_UNLIMITED_ENV,
    ENDPOINT_DIR,
    ENDPOINT_DIR_INSIDE,
    SOCKET_DIR_INSIDE,
    WORKSPACE_INSIDE,
    Limits,
    SandboxBackend,
    SandboxError,
    SandboxInfo,
    SandboxSpec,
    env_flag,
)
from sandbox.cgroups import host_cgroups
from sandbox.process import ProcessSandbox
from sandbox.procs import kill_box_processes, labelled_pids, process_matches, process_start_time
from sandbox.startup import host_env, launcher_argv, service_paths
from sandbox.statedir import locked, prepare_state, write_info

log = logging.getLogger(__name__)

SPYTHON_EXECUTABLE = "singularity"
"""The command spython runs (Apptainer installs it as a compatibility link)."""
_STOP_GRACE_SECONDS = 2


def _bounded(what: str, timeout: float, call: Callable[[], Any]) -> Any:
    """Run `call` (a blocking spython call) with a deadline; spython itself has none.

    spython reports some failures with sys.exit; they become SandboxError here.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except SystemExit as exc:
            outcome["error"] = f"spython gave up (exit {exc.code})"
        except Exception as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    worker = threading.Thread(target=run, name=f"spython {what}", daemon=True)
    worker.start()
    worker.join(max(0.0, timeout))
    if worker.is_alive():
        raise SandboxError(f"{what} did not finish within {timeout:.0f}s")
    if "error" in outcome:
        raise SandboxError(f"{what} failed: {outcome['error']}")
    return outcome.get("value")


def image_cache_name(reference: str) -> str:
    """File name of the .sif a reference is built into: readable, and unique per reference."""
    digest = hashlib.sha256(reference.encode()).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", reference.split("://", 1)[-1]).strip("_")
    return f"{readable[:64]}-{digest}.sif"


def resolve_image(reference: str, cache_dir: Path, build: Callable[[str, Path], None]) -> Path:
    """The local image for `reference`: a path as is, a URI built (once) into `cache_dir`.

    `build(reference, output)` must leave the image at `output`. It runs under a lock file
    next to the image, so concurrent callers on the node wait for one build; it writes to a
    temporary name first, so a crashed build never leaves a half image under the real one.
    """
    if "://" not in reference:
        path = Path(reference)
        if not path.exists():
            raise SandboxError(f"the image {reference} does not exist")
        return path.resolve()
    if reference.startswith("instance://"):
        raise SandboxError("an instance:// reference is not an image")
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / image_cache_name(reference)
    if target.exists():
        return target
    with locked(target.with_suffix(".lock")):
        if target.exists():  # built by whoever held the lock before us
            return target
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            log.info("building %s into %s", reference, target)
            build(reference, partial)
            if not partial.exists():
                raise SandboxError(f"building {reference} left no image")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target


def spython_build(reference: str, output: Path) -> None:
    """Convert `reference` into a .sif at `output` with spython (unprivileged build)."""
    from spython.main import Client

    built = _bounded(
        f"building {reference}",
        24 * 3600,
        lambda: Client.build(
            recipe=reference, image=str(output), sudo=False, force=True, quiet=True
        ),
    )
    if built is None:
        raise SandboxError(f"apptainer could not build {reference}")


def stop_instance(name: str, timeout: float = 30.0) -> None:
    """Stop the instance `name` through spython (force-killed after a short grace)."""
    from spython.main import Client

    instance = Client.instance(name, name=name, start=False, quiet=True)
    _bounded(
        f"stopping instance {name}",
        timeout,
        lambda: instance.stop(name=name, timeout=_STOP_GRACE_SECONDS, quiet=True),
    )


def cgroup_options(limits: Limits) -> list[str]:
    """Apptainer's own cgroup flags for the box-wide limits, where it can apply them here:
    as root on a host with cgroups for boxes, or rootless on cgroup v2 (through systemd);
    none elsewhere, since apptainer refuses to start an instance it cannot limit."""
    host, _ = host_cgroups()
    if host is None or (os.geteuid() != 0 and host.version != 2):
        return []
    options = []
    if limits.box_memory_bytes is not None:
        memory = limits.box_memory_bytes
        options += [f"--memory={memory}", f"--memory-swap={memory}"]
    if limits.box_pids is not None:
        options.append(f"--pids-limit={limits.box_pids}")
    if limits.box_cpu_shares is not None and host.cpu:
        options.append(f"--cpu-shares={limits.box_cpu_shares}")
    return options


class ApptainerSandbox(ProcessSandbox):
    """A sandbox in one Apptainer instance."""

    def __init__(
        self, spec: SandboxSpec, info: SandboxInfo, backend: ApptainerBackend, image: Path
    ) -> None:
        super().__init__(spec, info)
        self._backend = backend
        self.image = image
        assert info.instance is not None
        self.instance = info.instance
        self._instance_up = False

    def container_options(self) -> list[str]:
        """Options of `instance start` (and of a one-off `exec` before the instance runs)."""
        options = ["--contain", "--writable-tmpfs", "--no-home", "--cleanenv"]
        if not self.spec.network:
            options += ["--net", "--network", "none"]
        if self._backend.fakeroot:
            options.append("--fakeroot")
        for path in service_paths():
            options += ["--bind", f"{path}:{path}:ro"]
        for bind in self.spec.binds:
            mode = "ro" if bind.read_only else "rw"
            options += ["--bind", f"{Path(bind.host).resolve()}:{bind.inside}:{mode}"]
        options += ["--bind", f"{self.workspace}:{WORKSPACE_INSIDE}:rw"]
        options += ["--bind", f"{self.state_dir / 'sock'}:{SOCKET_DIR_INSIDE}:rw"]
        if self.spec.endpoint:
            options += ["--bind", f"{self.state_dir / ENDPOINT_DIR}:{ENDPOINT_DIR_INSIDE}:ro"]
        return options + cgroup_options(self.spec.limits)

    def _passed_env(self, env: dict[str, str]) -> dict[str, str]:
        # Under --cleanenv only prefixed host variables reach the container; this way values
        # may hold commas and quotes, which --env would split or mangle.
        prefix = self._backend.env_prefix
        return {f"{prefix}{key}": value for key, value in env.items()}

    def _host_process(
        self, command: list[str], env: dict[str, str], ready_fd: int | None
    ) -> tuple[list[str], dict[str, str]]:
        argv = [self._backend.executable, "--quiet", "exec", "--cleanenv"]
        argv += ["--pwd", self.spec.workdir]
        if self._instance_up:
            argv.append(f"instance://{self.instance}")
        else:
            argv += [*self.container_options(), str(self.image)]
        return [*argv, *command], self._host_env(env)

    def _host_env(self, env: dict[str, str]) -> dict[str, str]:
        # Apptainer finds its instances through the user's environment (HOME); --cleanenv
        # keeps that environment out of the container.
        return {**os.environ, **host_env(self.id, self.job_id), **self._passed_env(env)}

    def _launch_main(self, tool_server: bool, deadline: float) -> None:
        from spython.main import Client

        environ = self._host_env(self._box_env(None))
        options = self.container_options()
        instance = Client.instance(str(self.image), name=self.instance, start=False, quiet=True)
        _bounded(
            f"starting instance {self.instance}",
            deadline - time.monotonic(),
            lambda: instance.start(options=options, quiet=True, environ=environ),
        )
        pid = getattr(instance, "pid", None)
        if pid is None:
            raise SandboxError(f"apptainer did not start instance {self.instance}")
        self._instance_up = True
        self.info.pid, self.info.pgid = int(pid), None
        self.info.start_time = process_start_time(int(pid))
        write_info(self.info)
        if tool_server:
            command = launcher_argv(
                self.python, self._limits(), self._main_command(True), self.info.uid
            )
            self._main = self._spawn_main(command, None)

    def alive(self) -> bool:
        if self._stopped or not self._instance_up:
            return False
        if not process_matches(self.info.pid, self.info.start_time):
            return False
        return self._main is None or self._main.poll() is None

    @classmethod
    def _terminate_box(cls, info: SandboxInfo) -> None:
        ApptainerBackend.terminate(info)


class ApptainerBackend(SandboxBackend):
    """Apptainer instances (see the module docstring)."""

    name: ClassVar[str] = "apptainer"

    def __init__(
        self,
        *,
        fakeroot: bool = False,
        cache_dir: Path | None = None,
        default_image: str | None = None,
    ) -> None:
        self.fakeroot = fakeroot
        self.cache_dir = cache_dir
        self.default_image = default_image
        self.executable = shutil.which(SPYTHON_EXECUTABLE) or SPYTHON_EXECUTABLE
        self.env_prefix = "APPTAINERENV_"

    @functools.cache  # noqa: B019 - one answer per backend object is the point
    def available(self) -> tuple[bool, str]:
        if shutil.which(SPYTHON_EXECUTABLE) is None:
            if shutil.which("apptainer") is not None:
                return (
                    False,
                    "apptainer is on PATH without its `singularity` link, which spython runs",
                )
            return False, "neither apptainer nor singularity is on PATH"
        try:
            result = subprocess.run(
                [self.executable, "--version"], capture_output=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"{self.executable} does not run: {exc}"
        if result.returncode != 0:
            return False, f"`{self.executable} --version` failed"
        version = result.stdout.decode(errors="replace").lower()
        # Singularity (before Apptainer) only reads its own prefix.
        self.env_prefix = "APPTAINERENV_" if "apptainer" in version else "SINGULARITYENV_"
        return True, ""

    def prepare_image(self, reference: str, state_root: Path) -> Path:
        """The local image for `reference`, building a URI's into the cache once per node."""
        cache = self.cache_dir or state_root.resolve() / ".images"
        return resolve_image(reference, cache, spython_build)

    def create(self, spec: SandboxSpec, state_root: Path) -> ApptainerSandbox:
        ok, why = self.available()
        if not ok:
            raise SandboxError(why)
        if spec.network:
            raise SandboxError(
                "apptainer boxes cannot have network: only bwrap gives a box a network "
                "namespace of its own behind the egress proxy (sandbox.network), and a box "
                "never shares the host's"
            )
        reference = spec.root or self.default_image
        if reference is None:
            raise SandboxError("an apptainer sandbox needs an image: spec.root or default_image")
        limited = spec.limits.box_memory_bytes is not None or spec.limits.box_pids is not None
        if limited and not cgroup_options(spec.limits) and not env_flag(ALLOW_UNLIMITED_ENV):
            raise SandboxError(
                "apptainer cannot hold a box's memory and process limits here (it needs cgroups "
                f"for boxes: root, or rootless on cgroup v2); set {ALLOW_UNLIMITED_ENV}=1 to "
                "start boxes without them"
            )
        image = self.prepare_image(reference, state_root)
        info = prepare_state(spec, state_root, self.name)
        info.instance = f"rollserve-{info.id}"
        write_info(info)
        return ApptainerSandbox(spec, info, self, image)

    @classmethod
    def terminate(cls, info: SandboxInfo) -> None:
        # An instance exists once started (pid recorded) or while its start runs (labelled
        # processes); a sandbox that never started has none to stop.
        started = info.pid is not None or bool(labelled_pids(info.id))
        if info.instance and started and shutil.which(SPYTHON_EXECUTABLE) is not None:
            try:
                stop_instance(info.instance)
            except SandboxError as exc:
                log.warning("could not stop instance %s: %s", info.instance, exc)
        kill_box_processes(info)
