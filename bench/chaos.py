"""Faults against a running batch: what is lost, doubled or failed, and how long recovery takes.

Each fault gets a stack of its own (embedded Redis, the development server in script mode
answering after a second, prefork workers under the stack's supervisor, the gateway) with the
default heartbeat, sweep and visibility settings, and one batch; a trainer streams the
batch's results (`iter_batch_lines`, resuming by cursor) from submission to the end. Once a
quarter of the batch has finished, with work in every stage, the fault strikes:

- `redis_killed`: the embedded Redis SIGKILLed (the supervisor restarts it from its AOF);
- `gateway_killed_mid_stream`: the gateway SIGKILLed while the trainer reads the stream;
- `worker_main_killed`: the main process of the run worker holding most jobs SIGKILLed;
- `pool_child_killed`: the pool process running a job's RUN SIGKILLed;
- `backend_stopped`: the inference server SIGSTOPped for 20 s, then continued;
- `backend_killed`: the inference server SIGKILLed (the supervisor restarts it);
- `node_lost`: every worker of a second node, holding sandboxed jobs pinned to it, SIGKILLed
  for good (bubblewrap needed);
- `sandbox_disk_full`: the file system of the sandbox directory filled for 10 s (root
  needed: it is a small tmpfs of the run's own);
- `worker_killed_mid_episode`: 40-turn episodes in bubblewrap boxes (each turn a bash call
  appending its number to a file), the run worker holding them SIGKILLed when they are
  half done: the worker that takes RUN over goes on from the last saved turn in the same
  box. `turns_lost_max_mid_episode` is the most model calls any of them lost (made again, or
  in flight at the kill: the aim is 1), `tools_run_twice` the jobs whose file shows a
  tool call run twice (their grade fails).

Per fault: jobs submitted, completed, failed (with error types), duplicated (a job's end
recorded or streamed more than once), lost (not ended by the deadline, 240 s after the
fault), and seconds to recover: from the fault's end until the stack answers again (gateway
healthy, Redis reachable) and every job a stage of which was running at the fault has ended
(jobs waiting in a queue are not counted: their wait is the backlog's, fault or not). The
baseline is the same batch with no fault, measured in the same run: `slowdown` is the
batch's time under the fault over its time without. Aims: 0 lost and 0 duplicated in every
case, recovery under 60 s.

    .venv/bin/python bench/chaos.py [--quick] [--only FAULT,...]

The last line printed is one JSON object with every figure and the conditions; its
figure (`--figure PATH`, default bench/figures/chaos.png) shows each fault's recovery against
the aim and its batch time against the baseline's. A fault that
cannot be staged here (no bubblewrap, not root) is recorded as skipped with the reason; one
whose run raised is recorded as `{"failed": "..."}` and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import redis

from api.client import RolloutClient, RolloutServiceError
from bench.support.plot import add_figure_option, compare_bars, write_figure
from bench.support.report import failure, print_json, run_baseline
from broker.processes import free_port
from core.settings import Settings
from deploy.stack import DevBackendOptions, Stack, StackOptions
from routing.devserver.tiny import make_tiny_model

AIM_RECOVERY_S = 60.0
DEADLINE_S = 240.0
DELAY_S = 2.0
LONG_TURNS = 40
"""Bash calls of each episode of `worker_killed_mid_episode` (then a finish call)."""
LONG_DELAY_S = 0.4
ANSWER = "So it is \\boxed{4}."
FINISH = '<tool_call>\n{"name": "finish", "arguments": {}}\n</tool_call>'
WRITE = (
    '<tool_call>\n{"name": "bash", "arguments": {"command": "echo ok > /workspace/out.txt"}}\n'
    "</tool_call>"
)
SCRIPT = [
    {"match": "CHAOS-MATH", "samples": [[ANSWER]], "delay": DELAY_S},
    {"match": "CHAOS-BOX", "samples": [[WRITE, FINISH]], "delay": DELAY_S},
    {
        "match": "CHAOS-LONG",
        "samples": [
            [
                *(
                    f'<tool_call>\n{{"name": "bash", "arguments": {{"command": "echo {k} >> '
                    f'/workspace/log.txt"}}}}\n</tool_call>'
                    for k in range(LONG_TURNS)
                ),
                FINISH,
            ]
        ],
        "delay": LONG_DELAY_S,
    },
]
NODE_B = {"init": "worker-init-b", "run": "worker-run-b", "eval": "worker-eval-b"}
LIVE = ("init", "run", "eval")


def math_tasks(n: int) -> list[dict[str, str]]:
    return [
        {"data_source": "math", "instance_id": f"m{i}", "problem": f"CHAOS-MATH {i}: 2+2?",
         "answer": "4"}
        for i in range(n)
    ]  # fmt: skip


def long_tasks(n: int) -> list[dict[str, str]]:
    """Episodes of `LONG_TURNS` bash calls, each appending its number to a file: graded right
    only when every call ran exactly once."""
    return [
        {"data_source": "shell", "instance_id": f"l{i}",
         "instruction": f"CHAOS-LONG {i}: append 0 to {LONG_TURNS - 1} to log.txt.",
         "check": f'test "$(cat /workspace/log.txt)" = "$(seq 0 {LONG_TURNS - 1})"'}
        for i in range(n)
    ]  # fmt: skip


def box_tasks(n: int) -> list[dict[str, str]]:
    return [
        {"data_source": "shell", "instance_id": f"b{i}",
         "instruction": f"CHAOS-BOX {i}: write ok to out.txt.",
         "check": 'test "$(cat /workspace/out.txt)" = ok'}
        for i in range(n)
    ]  # fmt: skip


# ----------------------------------------------------------------------------- one run


@dataclass
class Lab:
    """One stack, its batch and the trainer's stream while a fault plays out."""

    stack: Stack
    client: RolloutClient
    quick: bool
    work: Path
    batch_id: str = ""
    jobs: list[str] = field(default_factory=list)
    streamed: list[tuple[str, float]] = field(default_factory=list)
    stream_error: str = ""
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """Figures of the fault's own (`Fault.settle`)."""

    @property
    def r(self) -> redis.Redis:
        return redis.Redis.from_url(self.stack.redis_url, socket_timeout=5)

    def fields(self, job_id: str, *names: str) -> list[str | None]:
        raw = self.r.hmget(f"rs:job:{job_id}", list(names))
        return [None if v is None else v.decode() for v in raw]

    def statuses(self) -> dict[str, str | None]:
        pipe = self.r.pipeline(transaction=False)
        for job_id in self.jobs:
            pipe.hget(f"rs:job:{job_id}", "status")
        return {
            j: (s.decode() if s else None) for j, s in zip(self.jobs, pipe.execute(), strict=True)
        }

    def running(self) -> list[str]:
        """The jobs a stage of which is running now (marked by a worker)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in self.jobs:
            pipe.hget(f"rs:job:{job_id}", "active")
        return [j for j, active in zip(self.jobs, pipe.execute(), strict=True) if active]

    def read_stream(self) -> None:
        try:
            for line in self.client.iter_batch_lines(self.batch_id, resume_for=DEADLINE_S):
                self.streamed.append((line.trajectory.job_id, time.monotonic()))
        except Exception as exc:  # recorded: the trainer's stream broke for good
            self.stream_error = f"{type(exc).__name__}: {exc}"[:300]


def whole(lab: Lab) -> bool:
    """Whether the stack answers again: every child alive, the gateway healthy with Redis."""
    if lab.stack.redis is None or lab.stack.redis.poll() is not None:
        return False
    if any(p.poll() is not None for p in list(lab.stack.children.values())):
        return False
    try:
        health = httpx.get(f"{lab.stack.gateway_url}/healthz", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    return bool(health.get("redis"))


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, httpx.HTTPError, RolloutServiceError):
            if predicate():
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")


def measure(fault: Fault, work: Path, model: Path, quick: bool) -> dict[str, Any]:
    """Stage the fault against one batch on a stack of its own; its figures."""
    n = fault.batch_size(quick)
    with contextlib.ExitStack() as undo:
        undo.callback(sweep_strays, work)
        stack = fault.start(work, model, undo)
        undo.callback(stack.stop)
        client = undo.enter_context(RolloutClient(stack.gateway_url, timeout=30))
        lab = Lab(stack, client, quick, work)
        started = time.monotonic()
        accepted = client.submit_batch(
            fault.tasks(n), group_size=1, sampling={"seed": 0}, agent=fault.agent
        )
        lab.batch_id, lab.jobs = accepted.batch_id, list(accepted.jobs)
        reader = threading.Thread(target=lab.read_stream, name="trainer", daemon=True)
        reader.start()
        wait_for(lambda: fault.ready(lab), 120, "work in flight to strike at")
        in_flight = lab.running()
        struck = time.monotonic()
        lifted = fault.strike(lab)
        lifted_wall = time.time() - (time.monotonic() - lifted)
        back = None
        deadline = lifted + DEADLINE_S
        while time.monotonic() < deadline:
            if back is None and whole(lab):
                back = time.monotonic()
            with contextlib.suppress(redis.RedisError):
                if back is not None and all(
                    s not in LIVE and s != "queued" for s in lab.statuses().values()
                ):
                    break
            time.sleep(0.25)
        ended = time.monotonic()
        reader.join(timeout=30 if back is not None else 1)
        figures = tally(lab, in_flight, lifted_wall)
        fault.settle(lab)
        last_in_flight = figures.pop("_last_in_flight_end")
        recovered = None
        if back is not None and figures["lost"] == 0:
            recovered = max(back - lifted, last_in_flight)
        return {
            **figures,
            "fault_s": round(lifted - struck, 2),
            "recover_s": None if recovered is None else round(recovered, 2),
            "batch_s": round(ended - started, 2),
            "stream_error": lab.stream_error or None,
            "notes": lab.notes,
            **lab.extra,
        }


def sweep_strays(root: Path) -> None:
    """Stop what a fault left behind under `root` once its stack is down: process groups
    whose command line names `root` (a lost node's box keepers, which outlive its workers by
    design) and mounts under it (their boxes' disks), deepest first."""
    mine = str(root)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            group = os.getpgid(int(entry.name))
            named = mine in (entry / "cmdline").read_bytes().decode(errors="replace")
            if named and group != os.getpgrp():
                os.killpg(group, signal.SIGKILL)
    with contextlib.suppress(OSError):
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for point in sorted((m for m in mounts if m.startswith(mine + "/")), reverse=True):
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)


def tally(lab: Lab, in_flight: list[str], lifted_wall: float) -> dict[str, Any]:
    r = lab.r
    statuses = lab.statuses()
    done = [v[b"job_id"].decode() for _, v in r.xrange(f"rs:batch:{lab.batch_id}:done")]
    recorded = Counter(done)
    streamed = Counter(job_id for job_id, _ in lab.streamed)
    errors: Counter[str] = Counter()
    for job_id, status in statuses.items():
        if status not in (None, "completed", *LIVE, "queued"):
            raw = lab.fields(job_id, "error")[0]
            kind = json.loads(raw).get("type", "?") if raw else "?"
            errors[f"{status}:{kind}"] += 1
    ends = [lab.fields(j, "t_end")[0] for j in in_flight]
    last = max((float(t) - lifted_wall for t in ends if t is not None), default=0.0)
    attempts = [int(lab.fields(j, "attempt")[0] or 0) for j in lab.jobs]
    return {
        "submitted": len(lab.jobs),
        "completed": sum(s == "completed" for s in statuses.values()),
        "failed": sum(errors.values()),
        "errors": dict(errors),
        "duplicated": sum(c - 1 for c in recorded.values() if c > 1)
        + sum(c - 1 for c in streamed.values() if c > 1),
        "lost": sum(s in (None, "queued", *LIVE) for s in statuses.values()),
        "streamed": len(streamed),
        "retried": sum(a > 0 for a in attempts),
        "in_flight_at_fault": len(in_flight),
        "_last_in_flight_end": max(last, 0.0),
    }


# ----------------------------------------------------------------------------- faults


def write_script(work: Path) -> Path:
    path = work / "script.jsonl"
    path.write_text("".join(json.dumps(entry) + "\n" for entry in SCRIPT))
    return path


def standard_stack(work: Path, model: Path, **settings: Any) -> Stack:
    data = Path(tempfile.mkdtemp(prefix="stack-", dir=work))
    config = Settings(data_dir=data, port=free_port(), **settings)
    options = StackOptions(
        workers={"init": 1, "run": 2, "eval": 1},
        dev_backend=DevBackendOptions(model_dir=model, script=write_script(work)),
    )
    stack = Stack(config, options).start()
    try:
        stack.wait_worker(stack.start_worker("run", 2))  # two run workers of two processes
    except BaseException:
        stack.stop()
        raise
    return stack


@dataclass
class Fault:
    name: str
    sandboxed: bool = False
    agent: dict[str, Any] | None = None
    """The batch's agent parameters (None: the service's defaults)."""

    def batch_size(self, quick: bool) -> int:
        return (12 if self.sandboxed else 16) if quick else (24 if self.sandboxed else 48)

    def tasks(self, n: int) -> list[dict[str, str]]:
        return box_tasks(n) if self.sandboxed else math_tasks(n)

    def unavailable(self) -> str | None:
        """Why this fault cannot be staged on this machine, or None."""
        return None

    def start(self, work: Path, model: Path, undo: contextlib.ExitStack) -> Stack:
        return standard_stack(work, model, sandbox_backend="local")

    def ready(self, lab: Lab) -> bool:
        """Whether to strike now: a quarter of the batch ended and RUN holds work."""
        statuses = lab.statuses()
        ended = sum(s not in (None, "queued", *LIVE) for s in statuses.values())
        return ended >= len(lab.jobs) // 4 and "run" in statuses.values()

    def strike(self, lab: Lab) -> float:
        """Inflict the fault; returns when it ended (`time.monotonic()`)."""
        raise NotImplementedError

    def settle(self, lab: Lab) -> None:
        """After the figures: what the fault's aftermath needs before the stack stops."""


class RedisKilled(Fault):
    def strike(self, lab: Lab) -> float:
        assert lab.stack.redis is not None and lab.stack.redis.pid is not None
        os.killpg(lab.stack.redis.pid, signal.SIGKILL)
        return time.monotonic()


class GatewayKilled(Fault):
    def ready(self, lab: Lab) -> bool:
        return super().ready(lab) and len(lab.streamed) >= 2

    def strike(self, lab: Lab) -> float:
        os.killpg(lab.stack.children["gateway"].pid, signal.SIGKILL)
        return time.monotonic()


def run_holders(lab: Lab) -> dict[int, list[str]]:
    """Jobs in RUN by the main pid of the worker holding them."""
    out: dict[int, list[str]] = {}
    for job_id in lab.jobs:
        status, owner = lab.fields(job_id, "status", "active_owner")
        parts = (owner or "").split("|")
        if status == "run" and len(parts) == 3 and parts[1].isdigit():
            out.setdefault(int(parts[1]), []).append(job_id)
    return out


class WorkerMainKilled(Fault):
    def ready(self, lab: Lab) -> bool:
        return super().ready(lab) and bool(run_holders(lab))

    def strike(self, lab: Lab) -> float:
        pid, held = max(run_holders(lab).items(), key=lambda item: len(item[1]))
        os.kill(pid, signal.SIGKILL)
        lab.notes.append(f"the killed worker held {len(held)} job(s) in RUN")
        return time.monotonic()


class PoolChildKilled(Fault):
    def ready(self, lab: Lab) -> bool:
        return super().ready(lab) and self.victim(lab) is not None

    def victim(self, lab: Lab) -> int | None:
        for job_id in lab.jobs:
            status, where = lab.fields(job_id, "status", "active_at")
            parts = (where or "").split("|")
            if status == "run" and len(parts) == 3 and parts[1].isdigit():
                return int(parts[1])
        return None

    def strike(self, lab: Lab) -> float:
        pid = self.victim(lab)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return time.monotonic()


class BackendStopped(Fault):
    def strike(self, lab: Lab) -> float:
        group = lab.stack.children["dev-backend"].pid
        os.killpg(group, signal.SIGSTOP)
        time.sleep(10.0 if lab.quick else 20.0)
        os.killpg(group, signal.SIGCONT)
        return time.monotonic()


class BackendKilled(Fault):
    def strike(self, lab: Lab) -> float:
        os.killpg(lab.stack.children["dev-backend"].pid, signal.SIGKILL)
        return time.monotonic()


def no_bwrap() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    return None


class NodeLost(Fault):
    def unavailable(self) -> str | None:
        return no_bwrap()

    def start(self, work: Path, model: Path, undo: contextlib.ExitStack) -> Stack:
        stack = standard_stack(
            work, model, node_name="node-a", sandbox_backend="bwrap", reap_interval=2.0
        )
        undo.callback(stack.stop)
        env = {
            "ROLLSERVE_NODE_NAME": "node-b",
            "ROLLSERVE_SANDBOX_DIR": str(stack.settings.data_dir / "sandboxes-b"),
        }
        for stage, name in NODE_B.items():
            stack.wait_worker(stack.start_worker(stage, 1, name=name, env=env))
        return stack

    def pinned_to_b(self, lab: Lab) -> list[str]:
        return [j.decode() for j in lab.r.smembers("rs:pinned:node-b")]

    def ready(self, lab: Lab) -> bool:
        live = lab.statuses()
        return any(live.get(j) == "run" for j in self.pinned_to_b(lab))

    def strike(self, lab: Lab) -> float:
        lab.notes.append(f"{len(self.pinned_to_b(lab))} job(s) pinned to the lost node")
        for name in NODE_B.values():
            lab.stack.kill_worker(name, signal.SIGKILL)
        return time.monotonic()

    def settle(self, lab: Lab) -> None:
        """The node comes back: its workers reap the boxes its jobs left there."""
        boxes = lab.stack.settings.data_dir / "sandboxes-b"
        started = time.monotonic()
        env = {"ROLLSERVE_NODE_NAME": "node-b", "ROLLSERVE_SANDBOX_DIR": str(boxes)}
        lab.stack.wait_worker(lab.stack.start_worker("run", 1, name="worker-run-b2", env=env))
        try:
            wait_for(lambda: not any(p.is_dir() for p in boxes.iterdir()), 60, "the reap")
            lab.notes.append(
                f"the node's boxes were reaped {time.monotonic() - started:.1f}s after a worker "
                "of it came back"
            )
        except TimeoutError as exc:
            lab.notes.append(str(exc))


class SandboxDiskFull(Fault):
    def unavailable(self) -> str | None:
        if os.geteuid() != 0:
            return "needs root (it mounts a small tmpfs as the sandbox directory)"
        return no_bwrap()

    def start(self, work: Path, model: Path, undo: contextlib.ExitStack) -> Stack:
        self.disk = work / "sandbox-disk"
        self.disk.mkdir(exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(self.disk)],
                       check=True)  # fmt: skip
        undo.callback(subprocess.run, ["umount", "-l", str(self.disk)], check=False)
        return standard_stack(
            work, model, sandbox_backend="bwrap", sandbox_dir=self.disk / "boxes",
            reap_interval=2.0,
        )  # fmt: skip

    def ready(self, lab: Lab) -> bool:
        statuses = lab.statuses()
        ended = sum(s not in (None, "queued", *LIVE) for s in statuses.values())
        return ended >= len(lab.jobs) // 4 and any(s in LIVE for s in statuses.values())

    def strike(self, lab: Lab) -> float:
        ballast = self.disk / "ballast"
        with ballast.open("wb") as out, contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * (1 << 20))
        time.sleep(5.0 if lab.quick else 10.0)
        ballast.unlink()
        return time.monotonic()


@dataclass
class WorkerKilledMidEpisode(Fault):
    """The run worker holding long episodes killed when they are half done."""

    saved: dict[str, int] = field(default_factory=dict)

    def batch_size(self, quick: bool) -> int:
        return 2 if quick else 4

    def tasks(self, n: int) -> list[dict[str, str]]:
        return long_tasks(n)

    def unavailable(self) -> str | None:
        return no_bwrap()

    def start(self, work: Path, model: Path, undo: contextlib.ExitStack) -> Stack:
        return standard_stack(work, model, sandbox_backend="bwrap")

    def model_calls(self, lab: Lab, job_id: str) -> int:
        return sum(t.type == "model" for t in lab.client.get_rollout(job_id).turns)

    def ready(self, lab: Lab) -> bool:
        held = run_holders(lab)
        if not held:
            return False
        _, jobs = max(held.items(), key=lambda item: len(item[1]))
        return all(self.model_calls(lab, j) >= LONG_TURNS // 2 for j in jobs)

    def strike(self, lab: Lab) -> float:
        pid, held = max(run_holders(lab).items(), key=lambda item: len(item[1]))
        self.saved = {job_id: self.model_calls(lab, job_id) for job_id in held}
        os.kill(pid, signal.SIGKILL)
        lab.notes.append(f"the killed worker held {len(held)} episode(s) in RUN")
        return time.monotonic()

    def settle(self, lab: Lab) -> None:
        """Per killed episode: model calls saved at the kill and not kept, plus the call in
        flight then (it is made again)."""
        lost: dict[str, int] = {}
        twice = 0
        for job_id, saved in self.saved.items():
            traj = lab.client.get_rollout(job_id)
            kept = 0
            if traj.resumes:
                kept = sum(t.type == "model" for t in traj.turns[: traj.resumes[0].turn])
            lost[job_id] = saved - kept + 1
            twice += traj.reward != 1.0
        lab.extra = {
            "turns_lost_max_mid_episode": max(lost.values(), default=None),
            "turns_lost_per_episode": sorted(lost.values()),
            "episodes_resumed": sum(bool(lab.client.get_rollout(j).resumes) for j in lost),
            "tools_run_twice": twice,
        }


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        RedisKilled("redis_killed"),
        GatewayKilled("gateway_killed_mid_stream"),
        WorkerMainKilled("worker_main_killed"),
        PoolChildKilled("pool_child_killed"),
        BackendStopped("backend_stopped"),
        BackendKilled("backend_killed"),
        NodeLost("node_lost", sandboxed=True),
        SandboxDiskFull("sandbox_disk_full", sandboxed=True),
        WorkerKilledMidEpisode(
            "worker_killed_mid_episode", sandboxed=True, agent={"max_turns": LONG_TURNS + 5}
        ),
    )
}


class NoFault(Fault):
    def strike(self, lab: Lab) -> float:
        return time.monotonic()


# ----------------------------------------------------------------------------- report


def staged(entry: dict[str, Any]) -> bool:
    """Whether `entry` holds figures (not a skip, nor `{"failed": "<why>"}`)."""
    return "skipped" not in entry and not isinstance(entry.get("failed"), str)


def meets_aims(entry: dict[str, Any]) -> bool:
    recover = entry.get("recover_s")
    return (
        entry.get("lost") == 0
        and entry.get("duplicated") == 0
        and recover is not None
        and recover < AIM_RECOVERY_S
        and (entry.get("turns_lost_max_mid_episode") or 0) <= 1
        and not entry.get("tools_run_twice")
    )


def draw(results: dict[str, Any], path: Path) -> Path | None:
    """Per fault: seconds to recover against the aim, and the batch's time against the
    no-fault baseline's, each bar marked with what was lost or duplicated."""
    entries = {"none (baseline)": results["baseline"], **results["faults"]}

    def value(entry: dict[str, Any], key: str) -> float | None:
        return entry.get(key) if staged(entry) else None

    def figure(plt: Any) -> Any:
        if not any(staged(entry) for entry in entries.values()):
            return None
        fig, (recover, batch) = plt.subplots(1, 2, figsize=(13, 4.6))
        compare_bars(
            recover, [(name, value(e, "recover_s")) for name, e in entries.items()], unit="s"
        )
        recover.axhline(AIM_RECOVERY_S, color="tab:red", linestyle=":", label="aim")
        recover.set_title("seconds to recover after the fault")
        recover.legend(fontsize=8)
        compare_bars(
            batch,
            [(name, value(e, "batch_s")) for name, e in entries.items()],
            unit="s",
            reference="none (baseline)",
        )
        batch.set_title("batch time, ratio to the batch without a fault")
        counts = [
            f"{name}: {e['lost']} lost, {e['duplicated']} duplicated, {e['failed']} failed"
            for name, e in entries.items()
            if staged(e) and (e["lost"] or e["duplicated"] or e["failed"])
        ]
        done = "; ".join(counts) or "every job completed once: none lost, none duplicated"
        fig.suptitle(
            f"Faults against a running batch{' (quick)' if results['quick'] else ''}\n{done}",
            fontsize=10,
        )
        return fig

    return write_figure(path, figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller batches, shorter faults")
    parser.add_argument("--only", default="", help=f"comma-separated of: {', '.join(FAULTS)}")
    add_figure_option(parser, "chaos")
    args = parser.parse_args(argv)
    chosen = [name for name in args.only.split(",") if name] or list(FAULTS)
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        parser.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rollserve-chaos-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny-qwen3")
        baseline = run_baseline(
            "no fault", lambda: measure(NoFault("none"), work, model, args.quick)
        )
        for name in chosen:
            fault = FAULTS[name]
            reason = fault.unavailable()
            if reason is not None:
                results[name] = {"skipped": reason}
                continue
            try:
                results[name] = measure(fault, work, model, args.quick)
            except Exception as exc:
                print(f"fault {name} could not be staged:", file=sys.stderr)
                results[name] = failure(exc)

    base_s = baseline.get("batch_s") if isinstance(baseline, dict) else None
    print(f"{'fault':<28}{'sub':>5}{'done':>6}{'fail':>6}{'dup':>5}{'lost':>6}"
          f"{'recover':>9}{'batch':>8}{'slowdown':>10}")  # fmt: skip
    for name, entry in [("no fault (baseline)", baseline), *results.items()]:
        if not staged(entry):
            print(f"{name:<28}  {entry.get('skipped') or entry.get('failed')}")
            continue
        if base_s and name in results:
            entry["slowdown"] = round(entry["batch_s"] / base_s, 2)
        recover = entry["recover_s"]
        print(
            f"{name:<28}{entry['submitted']:>5}{entry['completed']:>6}{entry['failed']:>6}"
            f"{entry['duplicated']:>5}{entry['lost']:>6}"
            f"{'-' if recover is None else f'{recover:.1f}s':>9}{entry['batch_s']:>7.1f}s"
            f"{entry.get('slowdown', '-'):>10}"
        )
    met = [meets_aims(e) for e in results.values() if "skipped" not in e]
    mid = results.get("worker_killed_mid_episode", {})
    report: dict[str, Any] = {
        "bench": "chaos",
        "quick": args.quick,
        "turns_lost_max_mid_episode": mid.get("turns_lost_max_mid_episode"),
        "aims": {
            "lost": 0,
            "duplicated": 0,
            "recover_s_below": AIM_RECOVERY_S,
            "turns_lost_max_mid_episode": 1,
        },
        "all_met": bool(met) and all(met),
        "baseline": baseline,
        "faults": results,
        "conditions": {
            "model_delay_s": DELAY_S,
            "deadline_s": DEADLINE_S,
            "workers": "init 1 of 1 process, run 2 of 2, eval 1 of 1 (node_lost: 1 more each)",
            "settings": "defaults (heartbeat TTL 20 s, sweep every 10 s)",
            "cpus": os.cpu_count(),
        },
    }
    figure = draw(report, args.figure)
    report["figure"] = str(figure) if figure else None
    print_json(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
