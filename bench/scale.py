"""Thousands of rollouts in flight on one RUN node: the many-jobs RUN worker (`--jobs N`, every
episode a coroutine on one event loop) against today's prefork RUN worker (a process per job).

One stack per worker kind: embedded Redis, the gateway, prefork INIT and EVAL workers, and the
development server answering after 1-5 s (unscored scripted answers, so the server is not what
is measured: each task names its delay, 1, 2, 3, 4 or 5 s, so every turn's wait is known).
Jobs are multi-turn: `math` ones of three model turns, and `shell` ones whose agent runs bash
twice in its bubblewrap box before it finishes. At each in-flight level N the RUN worker holds
N jobs (`--jobs N`, or N prefork processes) and a batch of 2N jobs keeps it full; measured:

- memory: the RUN worker's proportional set size (PSS, its processes together) idle and at the
  peak of jobs in flight; per in-flight job = (peak - idle) / in flight (prefork: also the
  whole worker / in flight, what a process per job costs);
- per-turn overhead: each model turn's wall time minus the server's known delay and the tool
  time (`turn_seconds`, or `llm_seconds` for a last turn) — what routing, templating, the job
  store, HTTP and the event loop add to a turn; p50 and p99; and the part outside the model
  call (wall time minus the call and the tools: what `bench/pipeline.py` counts per turn);
- CPU per model turn of each part of the stack (RUN worker, INIT and EVAL workers, the
  backend, the gateway, Redis; /proc utime+stime, reaped children included) and the cores
  busy: where the machine's cores go when the turn overhead grows;
- throughput: jobs/s over the middle half of the batch, against what the backend allows
  (N jobs in flight / each job's mean time waiting on the server);
- Redis: bytes written per generated or observed token (INFO `total_net_input_bytes`, every
  command sent: Celery's messages too) and memory per in-flight job and per finished job.

    .venv/bin/python bench/scale.py [--quick] [--levels 10,100,1000] [--prefork-levels 10,100]

Its figure: bench/figures/scale.png (memory per job and turn overhead by level).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # bench/routing.py would shadow the `routing` package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import redis

from api.client import RolloutClient
from bench.support.plot import pyplot
from bench.support.report import print_json, run_baseline
from broker.processes import free_port
from core.schemas import JobStatus, Trajectory
from core.settings import Settings, get_settings
from deploy.stack import DevBackendOptions, Stack, StackOptions
from routing.devserver.tiny import make_tiny_model

FIGURE = Path(__file__).resolve().parent / "figures" / "scale.png"
DELAYS = (1.0, 2.0, 3.0, 4.0, 5.0)
MATH_TURNS = ["Let me think.", "Still thinking it over.", "\\boxed{2}"]


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


SHELL_TURNS = [
    call("bash", command="echo hi > /workspace/hello.txt"),
    call("bash", command="cat /workspace/hello.txt"),
    call("finish"),
]


def script() -> list[dict[str, Any]]:
    entries = []
    for delay in DELAYS:
        entries.append({"match": f"SCALE-MATH-{delay:g}S", "samples": [MATH_TURNS], "delay": delay})
        entries.append(
            {"match": f"SCALE-SHELL-{delay:g}S", "samples": [SHELL_TURNS], "delay": delay}
        )
    return entries


def tasks(n: int, sandboxed: int) -> list[dict[str, Any]]:
    """`n` tasks, `sandboxed` of them shell tasks in a box, the delays in turn."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        delay = DELAYS[i % len(DELAYS)]
        if i < sandboxed:
            out.append(
                {
                    "data_source": "shell",
                    "instance_id": f"shell-{i}-{delay:g}s",
                    "instruction": f"SCALE-SHELL-{delay:g}S: write hi to hello.txt.",
                    "check": 'test "$(cat /workspace/hello.txt)" = hi',
                }
            )
        else:
            out.append(
                {
                    "data_source": "math",
                    "instance_id": f"math-{i}-{delay:g}s",
                    "problem": f"SCALE-MATH-{delay:g}S: What is 1+1?",
                    "answer": "2",
                }
            )
    return out


def delay_of(traj: Trajectory) -> float:
    """The server's delay for this job's requests (named in its instance id)."""
    return float((traj.instance_id or "").rsplit("-", 1)[-1].rstrip("s"))


# ----------------------------------------------------------------------------- measurements


def pss_mb(pid: int) -> float:
    """PSS of a process and its descendants, in MB."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for child in map(int, children):
        out += [child, *descendants(child)]
    return out


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of a process, its live descendants and the children it has reaped."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # utime, stime, cutime, cstime: fields 14-17 of proc(5), 12-15 after the name
        total += sum(int(x) for x in fields[11:15])
    return total / TICKS


def stack_pids(stack: Stack) -> dict[str, list[int]]:
    """The stack's processes by part: run worker, INIT and EVAL workers, backend, gateway,
    Redis."""
    parts: dict[str, list[int]] = {}
    for name, child in stack.children.items():
        part = name
        if name.startswith("worker-run"):
            part = "run_worker"
        elif name.startswith(("worker-init", "worker-eval")):
            part = "init_eval_workers"
        elif name == "dev-backend":
            part = "backend"
        parts.setdefault(part, []).append(child.pid)
    redis_pid = stack.redis.pid if stack.redis is not None else None
    if redis_pid:
        parts["redis"] = [redis_pid]
    return parts


def cpu_by_part(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of each part of the stack (`stack_pids`)."""
    return {part: sum(map(cpu_seconds, pids)) for part, pids in stack_pids(stack).items()}


def redis_info(url: str) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    try:
        return dict(client.info())
    finally:
        client.close()


class Sampler:
    """Polls the fleet every `interval` s: jobs inside RUN, and the RUN worker's PSS and
    Redis memory at the moment the most jobs were in RUN."""

    def __init__(self, client: httpx.Client, pid: int, redis_url: str, interval: float = 0.5):
        self.client, self.pid, self.redis_url, self.interval = client, pid, redis_url, interval
        self.peak_in_run = 0
        self.pss_at_peak = 0.0
        self.redis_at_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                busy = self.client.get("/v1/stats").json()["busy"].get("run", 0)
            except Exception:
                continue
            if busy >= self.peak_in_run:
                self.peak_in_run = busy
                self.pss_at_peak = pss_mb(self.pid)
                self.redis_at_peak = int(redis_info(self.redis_url)["used_memory"])

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def turn_overheads(trajectories: list[Trajectory], outside_call: bool = False) -> list[float]:
    """Per model turn: its wall time minus the server's delay and the tool time, in ms. With
    `outside_call`, minus the whole model call instead (its HTTP, the server's own work and
    queueing): what the worker adds around the call, as `bench/pipeline.py` counts it."""
    out: list[float] = []
    for traj in trajectories:
        delay = delay_of(traj)
        turns = traj.turns
        for i, turn in enumerate(turns):
            if turn.type != "model" or turn.llm_seconds is None:
                continue
            following = turns[i + 1] if i + 1 < len(turns) else None
            tools = getattr(following, "tool_seconds", None) or 0.0
            wall = turn.turn_seconds or turn.llm_seconds
            out.append((wall - (turn.llm_seconds if outside_call else delay) - tools) * 1000)
    return out


def measure_level(stack: Stack, level: int, sandboxed: int, pid: int) -> dict[str, Any]:
    """One batch of 2 x `level` jobs through a RUN worker that holds `level` at once."""
    count = 2 * level
    idle_pss = pss_mb(pid)
    before = redis_info(stack.redis_url)
    cpu_before = cpu_by_part(stack)
    with (
        httpx.Client(base_url=stack.gateway_url, timeout=30) as http,
        RolloutClient(stack.gateway_url, timeout=300) as client,
        Sampler(http, pid, stack.redis_url) as sampler,
    ):
        started = time.monotonic()
        batch = client.submit_batch(
            tasks(count, min(sandboxed, count)),
            group_size=1,
            sampling={"max_tokens": 64, "seed": 0},
            agent={"max_turns": 4},
        )
        finished_at: list[float] = []
        results: list[Trajectory] = []
        for traj in client.iter_batch_results(batch.batch_id):
            finished_at.append(time.monotonic() - started)
            results.append(traj)
        wall = time.monotonic() - started
    after = redis_info(stack.redis_url)
    cpu_after = cpu_by_part(stack)
    completed = [t for t in results if t.status is JobStatus.completed]
    overheads = turn_overheads(completed)
    outside = turn_overheads(completed, outside_call=True)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in results)
    waits = [delay_of(t) * sum(1 for x in t.turns if x.type == "model") for t in completed]
    # Throughput over the middle half of the batch: the worker full, neither filling nor draining.
    lo, hi = finished_at[len(finished_at) // 4], finished_at[(3 * len(finished_at)) // 4]
    middle = (3 * len(finished_at)) // 4 - len(finished_at) // 4
    jobs_per_s = middle / (hi - lo) if hi > lo else None
    allowed = level / statistics.fmean(waits) if waits else None
    in_flight = max(1, sampler.peak_in_run)
    model_turns = max(1, sum(1 for t in results for x in t.turns if x.type == "model"))
    return {
        "level": level,
        "jobs": count,
        "sandboxed": min(sandboxed, count),
        "completed": len(completed),
        "failed": {t.job_id: str(t.error) for t in results if t.status is not JobStatus.completed},
        "in_flight_peak": sampler.peak_in_run,
        "worker_pss_idle_mb": round(idle_pss, 1),
        "worker_pss_peak_mb": round(sampler.pss_at_peak, 1),
        "memory_per_inflight_job_mb": round((sampler.pss_at_peak - idle_pss) / in_flight, 3),
        "worker_pss_per_inflight_job_mb": round(sampler.pss_at_peak / in_flight, 3),
        "turns": len(overheads),
        "turn_overhead_p50_ms": round(percentile(overheads, 0.5) or 0.0, 2),
        "turn_overhead_p99_ms": round(percentile(overheads, 0.99) or 0.0, 2),
        "turn_overhead_outside_call_p50_ms": round(percentile(outside, 0.5) or 0.0, 2),
        "turn_overhead_outside_call_p99_ms": round(percentile(outside, 0.99) or 0.0, 2),
        "jobs_per_s": round(jobs_per_s, 2) if jobs_per_s else None,
        "backend_allows_jobs_per_s": round(allowed, 2) if allowed else None,
        "throughput_vs_backend": round(jobs_per_s / allowed, 3) if jobs_per_s and allowed else None,
        "wall_s": round(wall, 1),
        # Where the machine's cores went, per model turn: the RUN worker's share is what
        # rollserve costs a turn there; the backend's is the stand-in server's.
        "cpu_ms_per_turn": {
            part: round(1000 * (cpu_after[part] - cpu_before.get(part, 0.0)) / model_turns, 3)
            for part in sorted(cpu_after)
        },
        "cpu_cores_busy": round(
            (sum(cpu_after.values()) - sum(cpu_before.values())) / max(wall, 1e-9), 2
        ),
        "redis_bytes_in_per_token": round(
            (after["total_net_input_bytes"] - before["total_net_input_bytes"]) / max(1, tokens), 1
        ),
        "redis_memory_per_inflight_job_kb": round(
            (sampler.redis_at_peak - before["used_memory"]) / in_flight / 1024, 2
        ),
        "redis_memory_per_finished_job_kb": round(
            (after["used_memory"] - before["used_memory"]) / count / 1024, 2
        ),
    }


def run_kind(
    kind: str, levels: list[int], args: argparse.Namespace, work: Path, model: Path
) -> list[dict[str, Any]]:
    """Every level on one stack whose RUN worker is `kind` (`jobs` or `prefork`)."""
    rows: list[dict[str, Any]] = []
    for level in levels:
        data = work / f"{kind}-{level}"
        script_path = data / "script.jsonl"
        data.mkdir(parents=True)
        script_path.write_text("".join(json.dumps(e) + "\n" for e in script()))
        settings = Settings(data_dir=data, port=free_port(), sandbox_dir=data / "boxes")
        options = StackOptions(
            workers={"init": args.init_workers, "run": level, "eval": args.eval_workers},
            run_jobs=level if kind == "jobs" else 0,
            dev_backend=DevBackendOptions(model_dir=model, script=script_path, unscored=True),
            ready_timeout=300,
        )
        with Stack(settings, options).start() as stack:
            [run_child] = [n for n in stack.worker_names if n.startswith("worker-run")]
            pid = stack.children[run_child].pid
            row = measure_level(stack, level, args.sandboxed, pid)
        row["kind"] = kind
        rows.append(row)
        print(describe(row), flush=True)
    return rows


def describe(row: dict[str, Any]) -> str:
    return (
        f"{row['kind']:>8} {row['level']:>6} in flight (peak {row['in_flight_peak']:>5})  "
        f"{row['memory_per_inflight_job_mb']:>7.2f} MB/job  "
        f"turn overhead p50 {row['turn_overhead_p50_ms']:>7.2f} ms  "
        f"p99 {row['turn_overhead_p99_ms']:>8.2f} ms "
        f"(outside the call p50 {row['turn_overhead_outside_call_p50_ms']:.2f} ms)  "
        f"{row['jobs_per_s'] or 0:>7.2f} jobs/s (backend allows "
        f"{row['backend_allows_jobs_per_s'] or 0:.2f})  completed {row['completed']}/{row['jobs']}"
        "\n"
        + " " * 16
        + "CPU ms per turn: "
        + ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_ms_per_turn"].items())
        + f"  ({row['cpu_cores_busy']} cores busy)"
    )


def draw(jobs: list[dict[str, Any]], prefork: list[dict[str, Any]], path: Path) -> Path | None:
    plt, missing = pyplot()
    if plt is None:
        print(f"{missing}: no figure", file=sys.stderr)
        return None
    fig, (mem, over) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, rows, style in (("--jobs N", jobs, "o-"), ("prefork", prefork, "s--")):
        rows = [r for r in rows if "level" in r]
        if not rows:
            continue
        levels = [r["level"] for r in rows]
        mem.plot(levels, [r["worker_pss_per_inflight_job_mb"] for r in rows], style, label=name)
        over.plot(levels, [r["turn_overhead_p50_ms"] for r in rows], style, label=f"{name} p50")
        over.plot(levels, [r["turn_overhead_p99_ms"] for r in rows], style, alpha=0.4,
                  label=f"{name} p99")  # fmt: skip
    for ax, label in ((mem, "worker PSS per in-flight job (MB)"), (over, "per-turn overhead (ms)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("jobs in flight")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle("One RUN node: many jobs per process vs a process per job")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def levels_of(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="levels 10,100; prefork 10")
    parser.add_argument("--levels", default="10,100,1000")
    parser.add_argument("--prefork-levels", default="10,100")
    parser.add_argument("--sandboxed", type=int, default=10, help="shell jobs per level")
    parser.add_argument("--init-workers", type=int, default=2)
    parser.add_argument("--eval-workers", type=int, default=2)
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args(argv)
    if args.quick:
        args.levels, args.prefork_levels, args.sandboxed = "10,100", "10", 4
    print_json(measure(args))
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    model = make_tiny_model(get_settings().tiny_model_dir.resolve())
    with tempfile.TemporaryDirectory(prefix="rollserve-bench-scale-") as tmp:
        work = Path(tmp)
        jobs = run_kind("jobs", levels_of(args.levels), args, work, model)
        baseline: Callable[[], list[dict[str, Any]]] = lambda: run_kind(  # noqa: E731
            "prefork", levels_of(args.prefork_levels), args, work, model
        )
        prefork = run_baseline("prefork", baseline)
    prefork_rows = prefork if isinstance(prefork, list) else []
    top = max(jobs, key=lambda r: r["in_flight_peak"])
    prefork_top = max(prefork_rows, key=lambda r: r["in_flight_peak"], default=None)
    figure = draw(jobs, prefork_rows, args.figure)
    results: dict[str, Any] = {
        "bench": "scale",
        "params": {k: v for k, v in vars(args).items() if k != "figure"},
        "in_flight_max": top["in_flight_peak"],
        "memory_per_inflight_job_mb": top["memory_per_inflight_job_mb"],
        "worker_pss_per_inflight_job_mb": top["worker_pss_per_inflight_job_mb"],
        "turn_overhead_p50_ms_at_max": top["turn_overhead_p50_ms"],
        "turn_overhead_p99_ms_at_max": top["turn_overhead_p99_ms"],
        "turn_overhead_outside_call_p50_ms_at_max": top["turn_overhead_outside_call_p50_ms"],
        "cpu_ms_per_turn_at_max": top["cpu_ms_per_turn"],
        "cpu_cores_busy_at_max": top["cpu_cores_busy"],
        "prefork_memory_per_inflight_job_mb": prefork_top["worker_pss_per_inflight_job_mb"]
        if prefork_top
        else None,
        "memory_ratio_prefork_vs_jobs": round(
            prefork_top["worker_pss_per_inflight_job_mb"] / top["worker_pss_per_inflight_job_mb"],
            1,
        )
        if prefork_top
        else None,
        "redis_bytes_in_per_token_at_max": top["redis_bytes_in_per_token"],
        "redis_memory_per_finished_job_kb_at_max": top["redis_memory_per_finished_job_kb"],
        "jobs": jobs,
        "prefork": prefork,
        "figure": str(figure) if figure else None,
        "seconds": round(time.perf_counter() - started, 1),
    }
    return results


if __name__ == "__main__":
    sys.exit(main())
