"""The fleet autoscaler against a static fleet sized for the peak, on a bursty trace.

One stack (embedded Redis, the development server answering each RUN call after a fixed
delay, static INIT and EVAL workers) runs the same trace twice: bursts of jobs separated by
idle gaps. First with RUN workers started and stopped by the autoscaler (`deploy.autoscale`,
the local launcher: `rollserve worker run` processes, at least one, at most the peak); then
with the baseline, a static fleet of the peak's size started before the trace. Measured for
each: queue wait (a job's time in queues, p50/p95), worker-seconds (RUN worker processes alive,
sampled every 0.1 s, counting workers still finishing after a warm stop; the autoscaled fleet is
charged until it is back to its floor after the last job, the static one until the last job
ends), and for the autoscaled run the time to scale out: from a burst's arrival to the first
moment more RUN jobs run at once than there were workers before it (a new worker consuming).

    .venv/bin/python bench/autoscale.py [--quick]

Writes bench/figures/autoscale.png (workers and RUN queue depth over time) when matplotlib
imports. The last line printed is one JSON object with every figure and the conditions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a script, this directory would come first on sys.path, and bench/routing.py beside
# this script would shadow the `routing` package: the repository comes first instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from api.client import RolloutClient
from bench.support.plot import pyplot
from bench.support.report import print_json, run_baseline
from broker.jobstore import JobStore
from broker.processes import free_port
from core.schemas import JobStatus
from core.settings import Settings
from deploy.autoscale.autoscaler import Autoscaler
from deploy.autoscale.local import LocalLauncher
from deploy.autoscale.policy import default_policy
from deploy.autoscale.state import read_loads
from deploy.stack import DevBackendOptions, Stack, StackOptions
from routing.devserver.tiny import make_tiny_model

REPO = Path(__file__).resolve().parent.parent
FIGURE = REPO / "bench" / "figures" / "autoscale.png"
TASK = {"data_source": "math", "problem": "BURST: What is 2+2?", "answer": "4"}
SCRIPT = [{"match": "BURST:", "samples": [["2+2 = \\boxed{4}"]]}]
SAMPLE_EVERY = 0.1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Trace:
    bursts: int
    jobs_per_burst: int
    gap: float
    """Seconds from one burst's arrival to the next."""


@dataclass
class Samples:
    """(seconds since the trace began, RUN workers alive, waiting, in flight)."""

    rows: list[tuple[float, int, int, int]] = field(default_factory=list)


def sample_forever(
    launcher: LocalLauncher, store: JobStore, t0: float, out: Samples, stop: threading.Event
) -> None:
    while not stop.wait(SAMPLE_EVERY):
        load = read_loads(store)["run"]
        alive = len(launcher.workers("run")) + launcher.stopping
        out.rows.append((time.monotonic() - t0, alive, load.waiting, load.in_flight))


def worker_seconds(rows: list[tuple[float, int, int, int]], until: float) -> float:
    total = 0.0
    for (t, alive, _, _), (t_next, _, _, _) in itertools.pairwise(rows):
        if t >= until:
            break
        total += alive * (min(t_next, until) - t)
    return total


def play(client: RolloutClient, trace: Trace, t0: float) -> tuple[list[float], list[float]]:
    """Submit the bursts on time; the arrival offset of each burst and every job's queue wait."""
    arrivals, batches = [], []
    for burst in range(trace.bursts):
        delay = t0 + burst * trace.gap - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        arrivals.append(time.monotonic() - t0)
        batches.append(client.submit_batch([TASK] * trace.jobs_per_burst, group_size=1).batch_id)
    waits = []
    for batch_id in batches:
        for trajectory in client.iter_batch_results(batch_id):
            assert trajectory.status is JobStatus.completed, trajectory.error
            waits.append(trajectory.timing.queue or 0.0)
    return arrivals, waits


def warm(client: RolloutClient, jobs: int) -> None:
    batch = client.submit_batch([TASK] * jobs, group_size=1)
    assert all(t.status is JobStatus.completed for t in client.iter_batch_results(batch.batch_id))


def run_fleet(
    stack: Stack, store: JobStore, trace: Trace, peak: int, autoscaled: bool, logs: Path
) -> dict[str, Any]:
    """The trace on one fleet (autoscaled or static at `peak`); its figures and samples."""
    launcher = LocalLauncher(stack.child_env(), logs, stop_timeout=120)
    stop_scaler, stop_sampler = threading.Event(), threading.Event()
    scaler_thread = None
    policy = default_policy(
        "run",
        min_workers=1,
        max_workers=peak,
        target_busy_share=1.0,
        hysteresis=0.5,
        scale_out_cooldown=1.0,
        scale_in_cooldown=trace.gap / 5,
    )
    try:
        with RolloutClient(stack.gateway_url) as client:
            if autoscaled:
                scaler = Autoscaler(launcher, {"run": policy}, lambda: read_loads(store))
                # Workers are tied to the thread that starts them: it lives until the end.
                scaler_thread = threading.Thread(
                    target=scaler.run, args=(stop_scaler, 0.5), daemon=True
                )
                scaler_thread.start()
                warm(client, 1)
            else:
                launcher.start("run", peak)
                warm(client, 2 * peak)
            samples = Samples()
            initial = len(launcher.workers("run"))
            t0 = time.monotonic()
            sampler = threading.Thread(
                target=sample_forever, args=(launcher, store, t0, samples, stop_sampler)
            )
            sampler.start()
            arrivals, waits = play(client, trace, t0)
            last_done = time.monotonic() - t0
            end = last_done
            if autoscaled:  # charged until the fleet is back to its floor
                deadline = time.monotonic() + trace.gap + 30
                while time.monotonic() < deadline:
                    if samples.rows and samples.rows[-1][1] <= policy.floor:
                        break
                    time.sleep(SAMPLE_EVERY)
                end = time.monotonic() - t0
            time.sleep(2 * SAMPLE_EVERY)
            stop_sampler.set()
            sampler.join()
    finally:
        stop_scaler.set()
        if scaler_thread is not None:
            scaler_thread.join(timeout=30)
        launcher.close()
    rows = samples.rows
    scale_out = []
    for arrival in arrivals if autoscaled else []:
        # The fleet just before the burst: the last sample before it, or the starting fleet.
        before = next((alive for t, alive, _, _ in reversed(rows) if t < arrival), initial)
        consuming = [t for t, _, _, busy in rows if t >= arrival and busy > before]
        if consuming and before < peak:
            scale_out.append(consuming[0] - arrival)
    return {
        "queue_wait_p50_s": statistics.median(waits),
        "queue_wait_p95_s": percentile(waits, 95),
        "worker_seconds": worker_seconds(rows, end),
        "window_s": end,
        "last_job_done_s": last_done,
        "peak_workers": max((alive for _, alive, _, _ in rows), default=0),
        "time_to_scale_out_s": scale_out,
        "jobs": len(waits),
        "_rows": rows,
        "_arrivals": arrivals,
    }


def draw(figures: dict[str, dict[str, Any]], path: Path = FIGURE) -> str | None:
    """The figure, or why there is none."""
    plt, missing = pyplot()
    if plt is None:
        return f"no figure: {missing}"
    fig, axes = plt.subplots(len(figures), 1, figsize=(9, 3.2 * len(figures)), sharex=True)
    for ax, (name, run) in zip(axes, figures.items(), strict=True):
        if "_rows" not in run:
            ax.set_title(f"{name}: failed")
            continue
        t = [r[0] for r in run["_rows"]]
        ax.step(t, [r[1] for r in run["_rows"]], where="post", label="RUN workers alive")
        ax.plot(t, [r[2] for r in run["_rows"]], label="RUN queue depth", alpha=0.7)
        ax.plot(t, [r[3] for r in run["_rows"]], label="RUN jobs in flight", alpha=0.7)
        for arrival in run["_arrivals"]:
            ax.axvline(arrival, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{name}: {run['worker_seconds']:.0f} worker-seconds")
        ax.set_ylabel("count")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds since the first burst (dotted: burst arrivals)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short trace (about a minute)")
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args(argv)
    # Quick: short jobs and gaps, so worker start-up weighs heavily; the full trace has jobs
    # and idle gaps closer to RL rollouts (seconds of inference per job, minutes between).
    trace = Trace(3, 6, 15.0) if args.quick else Trace(4, 12, 60.0)
    delay = 1.0 if args.quick else 3.0
    peak = 4
    results: dict[str, Any] = {"bench": "autoscale", "quick": args.quick}

    with tempfile.TemporaryDirectory(prefix="rollserve-bench-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny-qwen3")
        script = work / "script.jsonl"
        script.write_text("".join(json.dumps(e) + "\n" for e in SCRIPT))
        settings = Settings(data_dir=work / "stack", port=free_port())
        options = StackOptions(
            workers={"init": 2, "run": 0, "eval": 2},
            dev_backend=DevBackendOptions(model_dir=model, script=script, delay=delay),
        )
        with Stack(settings, options) as stack:
            client = redis.Redis.from_url(stack.redis_url)
            store = JobStore(client, settings.key_prefix)
            ours = run_fleet(stack, store, trace, peak, True, work / "logs-autoscaled")
            static = run_baseline(
                "static fleet",
                lambda: run_fleet(stack, store, trace, peak, False, work / "logs-static"),
            )
            client.close()

    figure = draw({"autoscaled": ours, f"static fleet of {peak}": static}, args.figure)
    public = {k: v for k, v in ours.items() if not k.startswith("_")}
    base: dict[str, Any] = {k: v for k, v in static.items() if not k.startswith("_")}
    results["autoscaled"] = public
    results["static_peak_fleet"] = base
    ok = "worker_seconds" in base
    results["time_to_scale_out_p50_s"] = (
        statistics.median(public["time_to_scale_out_s"]) if public["time_to_scale_out_s"] else None
    )
    results["worker_seconds_vs_static"] = (
        round(public["worker_seconds"] / base["worker_seconds"], 3) if ok else None
    )
    results["queue_wait_p95_vs_static"] = (
        round(public["queue_wait_p95_s"] / base["queue_wait_p95_s"], 2)
        if ok and base["queue_wait_p95_s"] > 0
        else None
    )
    results["figure"] = figure
    results["conditions"] = {
        "bursts": trace.bursts,
        "jobs_per_burst": trace.jobs_per_burst,
        "gap_s": trace.gap,
        "peak_run_workers": peak,
        "run_worker_concurrency": 1,
        "backend_delay_s": delay,
        "init_eval_processes": 2,
        "autoscale_interval_s": 0.5,
        "scale_in_cooldown_s": trace.gap / 5,
        "launcher": "local",
        "cores": __import__("os").cpu_count(),
    }

    print(f"{'measure':<34}{'autoscaled':>12}{'static':>12}")
    for key, label in [
        ("queue_wait_p50_s", "queue wait p50 (s)"),
        ("queue_wait_p95_s", "queue wait p95 (s)"),
        ("worker_seconds", "RUN worker-seconds"),
        ("window_s", "charged window (s)"),
        ("peak_workers", "most RUN workers alive"),
    ]:
        theirs = f"{base[key]:>12.2f}" if ok else f"{'failed':>12}"
        print(f"{label:<34}{public[key]:>12.2f}{theirs}")
    outs = ", ".join(f"{s:.1f}" for s in public["time_to_scale_out_s"]) or "none seen"
    print(f"{'time to scale out per burst (s)':<34}  {outs}")
    print(f"{'worker-seconds vs static':<34}{results['worker_seconds_vs_static']}")
    print(f"{'figure':<34}{figure}")
    print_json(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
