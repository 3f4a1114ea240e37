"""Latency of tool actions: the tool server's pty bash against tmux, SWE-ReX and TCP.

Measured in one run, on this machine:

- bash round trip from the worker's side (a `ToolClient` call: socket → server → pty →
  bash and back) for `true` and for a command printing 100 kB, over the Unix socket and over
  TCP on loopback (the same server listening on both, calls interleaved);
- the same commands in a tmux session driven by `send-keys` and `capture-pane` polling, the
  way OpenHands drives its shell, at several polling intervals (the best one is reported);
- the same commands through SWE-ReX (`LocalRuntime().run_in_session(BashAction(...))`, in
  this process, so it pays no network hop at all);
- an IPython cell `1+1` through the tool server (jupyter_client straight to the kernel)
  against the same cell through an HTTP hop: a stdlib `http.server` (HTTP/1.1 keep-alive,
  TCP_NODELAY) in its own process that owns a jupyter_client `KernelManager` and runs each
  POSTed cell with `BlockingKernelClient.execute_interactive`, as a kernel gateway would;
  both kernels use the same `ipc` transport, so the difference is the HTTP hop;
- sandbox start-to-ready (create until its tool server answers a `ping`) and stop, for each
  sandbox backend that runs here (local, and bwrap when bubblewrap is installed; a bwrap box
  with network too, as root with slirp4netns and nftables), and a bwrap box with rlimits only
  (no cgroup, no disk of its own) as the baseline of the box-wide limits; the JSON says which
  box-wide limits this host enforces.

    .venv/bin/python bench/tools.py [--quick]

The last line printed is one JSON object with every figure and the conditions; its
figure (`--figure PATH`, default bench/figures/tools.png) shows each p50 against ours. A baseline
that fails (SWE-ReX timing out under load, tmux or the HTTP hop not starting) is recorded as
`{"failed": "..."}` in place of its figures, ratios against it are null, and ours are still
reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import http.client
import json
import logging
import os
import platform
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

# Run as a script, this directory would come first on sys.path, and bench/routing.py beside
# this script would shadow the `routing` package: the repository comes first instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.plot import add_figure_option, compare_bars, measured, write_figure
from bench.support.report import failed_baseline, has_failed, print_json, run_baseline
from sandbox.cgroups import enforced_limits
from sandbox.network import missing as network_missing
from sandbox.toolclient import ToolClient

REPO = Path(__file__).resolve().parent.parent

LINE = "x" * 99
BIG_COMMAND = f"yes {LINE} | head -n 1000"  # 1000 lines of 100 bytes: 100,000 bytes
BIG_BYTES = 100_000
TMUX_INTERVALS = (0.0, 0.001, 0.005, 0.01, 0.05)


# Statistics -----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(seconds: list[float]) -> dict[str, float]:
    """p50 and p99 in milliseconds."""
    return {
        "p50_ms": round(percentile(seconds, 50) * 1000, 4),
        "p99_ms": round(percentile(seconds, 99) * 1000, 4),
        "n": len(seconds),
    }


def ratio(slow: dict[str, Any], fast: dict[str, Any], key: str = "p50_ms") -> float | None:
    """`slow` over `fast` at `key`; None when either is a failed baseline (or `fast` is 0)."""
    if has_failed(slow) or has_failed(fast) or not fast[key]:
        return None
    return round(slow[key] / fast[key], 2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def terminate_and_time(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> float:
    """Seconds from SIGTERM until the process has exited.

    Waits on a pidfd: `Popen.wait(timeout)` polls with growing sleeps and would measure its
    own polling.
    """
    pidfd = os.pidfd_open(proc.pid)
    try:
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        select.select([pidfd], [], [], timeout)
        elapsed = time.perf_counter() - started
    finally:
        os.close(pidfd)
    stop_process(proc)
    return elapsed


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL of the process's own group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


# The tool server --------------------------------------------------------------------------


def server_argv(socket_path: Path, workdir: Path, tcp_port: int | None = None) -> list[str]:
    argv = [sys.executable, "-m", "sandbox.toolserver", "--socket", str(socket_path)]
    argv += ["--workdir", str(workdir)]
    if tcp_port is not None:
        argv += ["--tcp", f"127.0.0.1:{tcp_port}"]
    return argv


@contextlib.contextmanager
def tool_server(work: Path, tcp_port: int) -> Iterator[Path]:
    socket_path = work / "tools.sock"
    proc = subprocess.Popen(
        server_argv(socket_path, work, tcp_port), cwd=REPO, start_new_session=True
    )
    try:
        with ToolClient(socket_path) as client:
            client.wait_until_ready(timeout=20)
        yield socket_path
    finally:
        stop_process(proc)


def time_calls(call: Callable[[], Any], n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return times


class Timed:
    """One side of an interleaved measurement. Ours raises on a failure; a baseline's side
    records its first failure (`failed`) and is not called again."""

    def __init__(
        self,
        name: str,
        call: Callable[[], Any] | None,
        *,
        baseline: bool = False,
        failed: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.call = call
        self.baseline = baseline
        self.failed = failed
        self.times: list[float] = []

    def run(self, record: bool = True) -> None:
        """Call once, keeping the seconds it took when `record`."""
        if self.failed is not None or self.call is None:
            return
        started = time.perf_counter()
        try:
            self.call()
        except Exception as exc:
            if not self.baseline:
                raise
            self.failed = failed_baseline(self.name, exc)
            return
        if record:
            self.times.append(time.perf_counter() - started)

    def figures(self) -> dict[str, Any]:
        """p50 and p99 (`summary`), or the failure."""
        return self.failed if self.failed is not None else summary(self.times)


def bench_ours(socket_path: Path, port: int, n_true: int, n_big: int) -> dict[str, Any]:
    """Unix socket and TCP, interleaved call by call so drift hits both alike."""
    unix = ToolClient(socket_path)
    tcp = ToolClient.tcp("127.0.0.1", port)
    try:
        big = unix.call("bash", command=BIG_COMMAND)
        assert len(big["output"]) == BIG_BYTES and not big["truncated"], big["exit_code"]
        for client in (unix, tcp):
            for _ in range(100):
                client.call("bash", command="true")
        figures: dict[str, Any] = {}
        for name, command, n in (("true", "true", n_true), ("100k", BIG_COMMAND, n_big)):
            times: dict[str, list[float]] = {"unix": [], "tcp": []}
            for index in range(n):
                order = (("unix", unix), ("tcp", tcp))
                for label, client in order if index % 2 else order[::-1]:
                    started = time.perf_counter()
                    client.call("bash", command=command)
                    times[label].append(time.perf_counter() - started)
            figures[name] = {label: summary(values) for label, values in times.items()}
        return figures
    finally:
        unix.close()
        tcp.close()


# tmux -------------------------------------------------------------------------------------


class TmuxShell:
    """A bash in a private tmux server, driven like OpenHands drives its terminal."""

    def __init__(self, work: Path) -> None:
        self.env = dict(os.environ, TMUX_TMPDIR=str(work))
        self.name = f"rs-bench-{os.getpid()}"
        config = work / "tmux.conf"
        config.write_text("set -g history-limit 20000\n")
        self.pid: int | None = None
        self.tmux(
            *("-f", str(config), "new-session", "-d", "-s", "bench", "-x", "250", "-y", "50"),
            "bash --noprofile --norc",
        )
        self.pid = int(self.tmux("display-message", "-p", "-t", "bench", "#{pid}").strip())
        self.run("PS1='$ '; PS2=''", 0.001)

    def tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.name, *args],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def run(self, command: str, interval: float) -> float:
        """Seconds from sending the keys until a capture shows the command finished."""
        self.tmux("send-keys", "-R", "-t", "bench")  # fresh screen; not timed
        self.tmux("clear-history", "-t", "bench")
        token = secrets.token_hex(6)
        marker = f"RS{token}:"
        started = time.perf_counter()
        self.tmux("send-keys", "-t", "bench", f"{command}; printf 'RS%s:%d\\n' {token} $?", "Enter")
        while True:
            if interval:
                time.sleep(interval)
            pane = self.tmux("capture-pane", "-p", "-J", "-t", "bench", "-S", "-")
            at = pane.find(marker)
            if at >= 0 and "\n" in pane[at:]:
                return time.perf_counter() - started

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.tmux("kill-server")
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def bench_tmux(work: Path, n_true: int, n_big: int) -> dict[str, Any]:
    shell = TmuxShell(work)
    try:
        for _ in range(5):
            shell.run("true", 0.0)
        per_interval: dict[str, Any] = {}
        for interval in TMUX_INTERVALS:
            per_interval[f"{interval * 1000:g}ms"] = {
                "true": summary([shell.run("true", interval) for _ in range(n_true)]),
                "100k": summary([shell.run(BIG_COMMAND, interval) for _ in range(n_big)]),
            }
        return per_interval
    finally:
        shell.close()


def best_tmux(per_interval: dict[str, Any], workload: str) -> dict[str, Any]:
    label = min(per_interval, key=lambda key: per_interval[key][workload]["p50_ms"])
    return {**per_interval[label][workload], "poll_interval": label}


# SWE-ReX ----------------------------------------------------------------------------------


def bench_swerex(n_true: int, n_big: int) -> dict[str, Any]:
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest
    from swerex.runtime.local import LocalRuntime

    quiet = logging.getLogger("rollserve.bench.swerex")
    quiet.setLevel(logging.WARNING)

    async def measure() -> dict[str, Any]:
        runtime = LocalRuntime(logger=quiet)
        await runtime.create_session(CreateBashSessionRequest())
        try:
            for _ in range(3):
                await runtime.run_in_session(BashAction(command="true"))
            figures = {}
            for name, command, n in (("true", "true", n_true), ("100k", BIG_COMMAND, n_big)):
                times = []
                for _ in range(n):
                    started = time.perf_counter()
                    await runtime.run_in_session(BashAction(command=command))
                    times.append(time.perf_counter() - started)
                figures[name] = summary(times)
            return figures
        finally:
            await runtime.close()

    return asyncio.run(measure())


# IPython: direct against an HTTP hop -------------------------------------------------------


def serve_http_kernel(host: str, port: int) -> None:
    """The HTTP hop: POST {"code"} → {"output", "status"}, one kernel behind it."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from jupyter_client.manager import KernelManager

    scratch = Path(tempfile.mkdtemp(prefix=".rollserve-bench-kernel-"))
    manager = KernelManager(kernel_name="python3", transport="ipc", ip=str(scratch / "kernel"))
    manager.start_kernel(
        extra_arguments=["--HistoryManager.enabled=False"],
        env=dict(os.environ, IPYTHONDIR=str(scratch / "ipython"), JUPYTER_PLATFORM_DIRS="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=60)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            parts: list[str] = []

            def hook(msg: dict[str, Any]) -> None:
                content = msg["content"]
                if msg["header"]["msg_type"] == "stream":
                    parts.append(content["text"])
                elif msg["header"]["msg_type"] == "execute_result":
                    parts.append(content["data"].get("text/plain", "") + "\n")

            reply = client.execute_interactive(
                request["code"], output_hook=hook, allow_stdin=False, timeout=30
            )
            body = json.dumps(
                {"output": "".join(parts), "status": reply["content"]["status"]}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    def stop(*_: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    server = HTTPServer((host, port), Handler)
    try:
        server.serve_forever()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
        shutil.rmtree(scratch, ignore_errors=True)


class HttpKernel:
    def __init__(self, port: int) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def run(self, code: str) -> dict[str, Any]:
        body = json.dumps({"code": code}).encode()
        self.connection.request(
            "POST", "/execute", body=body, headers={"Content-Type": "application/json"}
        )
        if self.connection.sock is not None:
            self.connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        response = self.connection.getresponse()
        result: dict[str, Any] = json.loads(response.read())
        return result


def connect_http_kernel(port: int, gateway: subprocess.Popen[bytes]) -> HttpKernel:
    """A connection to the HTTP hop once it answers a cell (within 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            hop = HttpKernel(port)
            assert hop.run("1+1")["output"] == "2\n"
            return hop
        except OSError:
            if time.monotonic() > deadline or gateway.poll() is not None:
                raise
            time.sleep(0.05)


def bench_ipython(socket_path: Path, n: int) -> dict[str, Any]:
    """A cell `1+1` through the tool server (`direct`, ours) and through the HTTP hop (`http`,
    the baseline), interleaved call by call; a failing hop is recorded, ours still measured."""
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, __file__, "--http-kernel-server", str(port)],
        cwd=REPO,
        start_new_session=True,
    )
    direct = ToolClient(socket_path)
    try:
        assert direct.call("ipython", code="1+1", timeout=60)["output"] == "2\n"
        ours = Timed("tool server -> kernel", lambda: direct.call("ipython", code="1+1"))
        name = "HTTP hop -> kernel"
        hop = run_baseline(name, lambda: connect_http_kernel(port, gateway))
        if isinstance(hop, HttpKernel):
            kernel = hop
            theirs = Timed(name, lambda: kernel.run("1+1"), baseline=True)
        else:
            theirs = Timed(name, None, baseline=True, failed=hop)
        sides = {"direct": ours, "http": theirs}
        for _ in range(20):
            for side in sides.values():
                side.run(record=False)
        for index in range(n):
            order = list(sides.values())
            for side in order if index % 2 else order[::-1]:
                side.run()
        return {label: side.figures() for label, side in sides.items()}
    finally:
        direct.close()
        stop_process(gateway)


# Start-up -----------------------------------------------------------------------------------


def bench_startup(
    work: Path, n: int, backend: str, network: bool = False, box_limits: bool = True
) -> dict[str, Any]:
    """A sandbox of `backend` (with network: its own namespace, slirp4netns, firewall and
    egress proxy; without `box_limits`: no cgroup and no disk of its own, rlimits only) from
    create until its tool server answers a ping, and its stop."""
    from sandbox.backends import get_backend
    from sandbox.base import Limits, SandboxSpec

    limits = Limits()
    if not box_limits:
        unset = dict.fromkeys(
            ("box_memory_bytes", "box_pids", "box_cpu_shares", "disk_bytes", "disk_inodes")
        )
        limits = dataclasses.replace(limits, **unset)
    ready: list[float] = []
    stopped: list[float] = []
    name = f"sandboxes-{backend}{'-net' if network else ''}{'' if box_limits else '-rlimits'}"
    state_root = work / name
    for index in range(n):
        started = time.perf_counter()
        spec = SandboxSpec(job_id=f"bench-{index}", network=network, limits=limits)
        box = get_backend(backend).create(spec, state_root)
        try:
            box.start(tool_server=True)
            with ToolClient(box.socket_path, timeout=5) as client:
                client.ping()
                ready.append(time.perf_counter() - started)
                if index == 0:
                    client.call("bash", command="true")
            began_stop = time.perf_counter()
            box.stop()
            stopped.append(time.perf_counter() - began_stop)
        finally:
            box.stop()
    return {"ready": summary(ready), "stop": summary(stopped)}


# Report -------------------------------------------------------------------------------------


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


def version(command: list[str]) -> str:
    try:
        out = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError:
        return "missing"
    return (out.stdout or out.stderr).strip().splitlines()[0] if out.stdout or out.stderr else ""


def row(name: str, figures: dict[str, Any], ours: dict[str, Any] | None = None) -> str:
    if has_failed(figures):
        return f"  {name:<44}  {figures['failed']}"
    times = f"{figures['p50_ms']:>10.3f} {figures['p99_ms']:>10.3f}"
    versus = ratio(figures, ours) if ours is not None else None
    return f"  {name:<44}{times}" + (f"{versus:>9.1f}x" if versus is not None else f"{'':>10}")


def p50(entry: Any) -> float | None:
    """An arm's p50 in ms, None when it failed or is absent."""
    return float(entry["p50_ms"]) if measured(entry) else None


def draw(results: dict[str, Any], path: Path) -> Path | None:
    """p50 latency of every arm against ours, per bash workload, for IPython and for a
    sandbox's start (against the bwrap box with rlimits only)."""
    bash, ipython, startup = results["bash"], results["ipython_1plus1"], results["startup"]

    def figure(plt: Any) -> Any:
        fig, axes = plt.subplots(1, 4, figsize=(15, 4.2))
        for ax, (workload, title) in zip(
            axes, (("true", "bash `true`"), ("100k", "bash printing 100 kB")), strict=False
        ):
            entry = bash[workload]
            arms = [
                ("ours, Unix socket", p50(entry["ours_unix"])),
                ("ours, TCP", p50(entry["ours_tcp"])),
            ]
            if "tmux_best" in entry:
                arms.append(("tmux (best poll)", p50(entry["tmux_best"])))
            arms.append(("SWE-ReX", p50(entry["swerex"])))
            compare_bars(ax, arms, unit="ms", reference="ours, Unix socket", log=True)
            ax.set_title(f"{title}: p50 round trip")
        compare_bars(
            axes[2],
            [("ours, kernel direct", p50(ipython["direct"])), ("HTTP hop", p50(ipython["http"]))],
            unit="ms",
            reference="ours, kernel direct",
        )
        axes[2].set_title("IPython `1+1`: p50")
        boxes = [(where, p50(values["ready"])) for where, values in startup.items()]
        reference = "bwrap, rlimits only" if "bwrap, rlimits only" in startup else None
        compare_bars(axes[3], boxes, unit="ms", reference=reference, highlight="bwrap")
        axes[3].set_title("sandbox create until ready: p50")
        fig.suptitle("Tool actions: rollserve's tool server against the baselines (ratios to ours)")
        return fig

    return write_figure(path, figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under about a minute")
    parser.add_argument("--http-kernel-server", type=int, help=argparse.SUPPRESS)
    add_figure_option(parser, "tools")
    options = parser.parse_args(argv)
    if options.http_kernel_server:
        serve_http_kernel("127.0.0.1", options.http_kernel_server)
        return 0

    quick = options.quick
    n = {
        "ours_true": 1000 if quick else 5000,
        "ours_100k": 200 if quick else 1000,
        "tmux_true": 30 if quick else 100,
        "tmux_100k": 15 if quick else 50,
        "swerex_true": 15 if quick else 50,
        "swerex_100k": 8 if quick else 25,
        "ipython": 150 if quick else 1000,
        "startup": 8 if quick else 30,
    }
    have_bwrap = shutil.which("bwrap") is not None
    have_tmux = shutil.which("tmux") is not None
    work = Path(tempfile.mkdtemp(prefix="rs-bench-", dir="/tmp"))
    began = time.perf_counter()
    try:
        port = free_port()
        with tool_server(work, port) as socket_path:
            ours = bench_ours(socket_path, port, n["ours_true"], n["ours_100k"])
            ipython = bench_ipython(socket_path, n["ipython"])
        tmux: dict[str, Any] = (
            run_baseline("tmux", lambda: bench_tmux(work, n["tmux_true"], n["tmux_100k"]))
            if have_tmux
            else {}
        )
        swerex = run_baseline("SWE-ReX", lambda: bench_swerex(n["swerex_true"], n["swerex_100k"]))
        startup = {"local": bench_startup(work, n["startup"], "local")}
        if have_bwrap:
            # The baseline first: the same box with rlimits only (no cgroup, no own disk).
            startup["bwrap, rlimits only"] = bench_startup(
                work, n["startup"], "bwrap", box_limits=False
            )
            startup["bwrap"] = bench_startup(work, n["startup"], "bwrap")
            if not network_missing(os.geteuid() == 0):
                startup["bwrap with network"] = bench_startup(work, n["startup"], "bwrap", True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    figures: dict[str, Any] = {}
    for workload in ("true", "100k"):
        entry: dict[str, Any] = {
            "ours_unix": ours[workload]["unix"],
            "ours_tcp": ours[workload]["tcp"],
            "swerex": swerex if has_failed(swerex) else swerex[workload],
        }
        if has_failed(tmux):
            entry["tmux_best"] = tmux
        elif tmux:
            entry["tmux_best"] = best_tmux(tmux, workload)
            entry["tmux"] = {label: values[workload] for label, values in tmux.items()}
        figures[workload] = entry
    ratios: dict[str, float | None] = {}
    for workload in ("true", "100k"):
        entry = figures[workload]
        for key in ("p50_ms", "p99_ms"):
            suffix = f"{workload}_{key.removesuffix('_ms')}"
            if tmux:
                ratios[f"tmux_best/ours_{suffix}"] = ratio(
                    entry["tmux_best"], entry["ours_unix"], key
                )
            ratios[f"swerex/ours_{suffix}"] = ratio(entry["swerex"], entry["ours_unix"], key)
            ratios[f"tcp/unix_{suffix}"] = ratio(entry["ours_tcp"], entry["ours_unix"], key)
    if "bwrap" in startup:
        for phase in ("ready", "stop"):
            ratios[f"bwrap_box_limits/rlimits_only_{phase}_p50"] = ratio(
                startup["bwrap"][phase], startup["bwrap, rlimits only"][phase]
            )
    ratios["ipython_http/direct_p50"] = ratio(ipython["http"], ipython["direct"])
    ratios["ipython_http/direct_p99"] = ratio(ipython["http"], ipython["direct"], "p99_ms")
    true = figures["true"]

    def beyond(name: str, bound: float, *, inclusive: bool = True) -> bool | None:
        """Whether ratio `name` reaches `bound`; None without the ratio (a failed baseline)."""
        value = ratios.get(name)
        if value is None:
            return None
        return value >= bound if inclusive else value > bound

    aims = {
        "true_p50_under_1ms": true["ours_unix"]["p50_ms"] < 1.0,
        "at_least_5x_faster_than_best_tmux": (
            beyond("tmux_best/ours_true_p50", 5) if tmux else False
        ),
        "at_least_50x_faster_than_swerex": beyond("swerex/ours_true_p50", 50),
        "unix_ahead_of_tcp": beyond("tcp/unix_true_p50", 1, inclusive=False),
        "box_limits_start_at_most_1_2x": (
            None
            if ratios.get("bwrap_box_limits/rlimits_only_ready_p50") is None
            else not beyond("bwrap_box_limits/rlimits_only_ready_p50", 1.2, inclusive=False)
        ),
    }

    header = f"  {'':<44}{'p50 ms':>10} {'p99 ms':>10}{'vs ours':>10}"
    print(f"\nbench/tools.py{' --quick' if quick else ''}  ({os.cpu_count()} CPUs)")
    for workload, title in (("true", "bash `true`"), ("100k", "bash printing 100 kB")):
        entry = figures[workload]
        print(f"\n{title}\n{header}")
        print(row("tool server, Unix socket (ours)", entry["ours_unix"]))
        print(row("tool server, TCP loopback", entry["ours_tcp"], entry["ours_unix"]))
        if has_failed(entry.get("tmux_best")):
            print(row("tmux send-keys + capture-pane", entry["tmux_best"]))
        for label, values in entry.get("tmux", {}).items():
            best = " (best)" if label == entry["tmux_best"]["poll_interval"] else ""
            print(
                row(
                    f"tmux send-keys + capture-pane, poll {label}{best}", values, entry["ours_unix"]
                )
            )
        print(row("SWE-ReX LocalRuntime.run_in_session", entry["swerex"], entry["ours_unix"]))
    print(f"\nIPython cell `1+1`\n{header}")
    print(row("tool server -> jupyter_client -> kernel (ours)", ipython["direct"]))
    print(row("HTTP hop (stdlib http.server) -> kernel", ipython["http"], ipython["direct"]))
    print(f"\nsandbox with tool server: start-to-ready and stop\n{header}")
    for where, values in startup.items():
        print(row(f"{where}: create until ping answered", values["ready"]))
        print(row(f"{where}: stop", values["stop"]))
    met_words = {True: "yes", False: "NO", None: "n/a"}
    print("\naims: " + ", ".join(f"{name}={met_words[met]}" for name, met in aims.items()))
    print(f"elapsed {time.perf_counter() - began:.1f} s\n")

    result = {
        "bench": "tools",
        "quick": quick,
        "bash": figures,
        "ipython_1plus1": ipython,
        "startup": startup,
        "ratios": ratios,
        "aims": aims,
        "sandbox_limits_enforced": {
            name: support.as_dict() for name, support in enforced_limits("bwrap").items()
        },
        "conditions": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "tmux": version(["tmux", "-V"]),
            "bwrap": version(["bwrap", "--version"]),
            "swe_rex": package_version("swe-rex"),
            "jupyter_client": package_version("jupyter_client"),
            "ipykernel": package_version("ipykernel"),
            "big_output_bytes": BIG_BYTES,
            "big_command": "yes <99 x> | head -n 1000",
            "tmux_poll_intervals_s": list(TMUX_INTERVALS),
            "iterations": n,
            "swerex_mode": "LocalRuntime in the benchmark process (no network hop)",
            "http_hop": "stdlib http.server, HTTP/1.1 keep-alive, TCP_NODELAY, own process, "
            "BlockingKernelClient.execute_interactive, ipc kernel transport",
            "ours": "ToolClient (blocking) -> asyncio tool server -> ptyprocess bash",
        },
    }
    figure = draw(result, options.figure)
    result["figure"] = str(figure) if figure else None
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
