"""Per-job overhead of the pipeline and throughput against run-worker count.

Overhead: submit → completed as the client sees it (`POST /v1/rollouts?wait=true`), minus the
time the job spent in model calls, one job at a time, against the development server in
script mode (an instant backend: canned text scored by the tiny model).

Throughput: a batch through stacks with 1, 2 and 4 run-worker processes, with the backend
answering each call after a fixed delay, as a GPU server would — run workers mostly wait on
inference, which is what more of them should overlap.

Real vLLM: the same overhead measure against a real vLLM server (the CPU build from
`make vllm`, serving the tiny model, 16 generated tokens per job) in place of the development
server: what the pipeline costs beside the real engine, its `/tokenize` included. Without
vLLM (or with `--no-vllm`) that row is `{"failed": "<why>"}`.

    .venv/bin/python bench/pipeline.py [--quick] [--no-vllm]

The last line printed is one JSON object with every figure and the conditions; its
figure (`--figure PATH`, default bench/figures/pipeline.png) shows the overhead against the
Celery floor and the throughput against linear scaling. If the Celery
baseline fails, its figure is `{"failed": "..."}` and the ratio against it null.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script, this directory would come first on sys.path, and bench/routing.py beside
# this script would shadow the `routing` package: the repository comes first instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from api.client import RolloutClient
from bench.support.plot import add_figure_option, compare_bars, measured, write_figure
from bench.support.report import failure, has_failed, print_json, run_baseline
from broker.embedded import EmbeddedRedis
from broker.processes import free_port, spawn, stop_group
from core.schemas import JobStatus, Trajectory
from core.settings import Settings
from deploy.engine import VllmOptions
from deploy.stack import DevBackendOptions, Stack, StackOptions
from routing.devserver.tiny import make_tiny_model

REPO = Path(__file__).resolve().parent.parent
TASK = {"data_source": "math", "problem": "BENCH: What is 2+2?", "answer": "4"}
TRUE_CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "true"}}\n</tool_call>'
FINISH_CALL = '<tool_call>\n{"name": "finish", "arguments": {}}\n</tool_call>'
TOOL_TURNS = 8
SCRIPT = [
    {"match": "BENCH:", "samples": [["2+2 = \\boxed{4}"]]},
    {"match": "BENCH-TURNS", "samples": [[TRUE_CALL] * TOOL_TURNS + [FINISH_CALL]]},
]
TOOL_TASK = {"data_source": "shell", "instruction": "BENCH-TURNS: run true.", "check": "true"}
VLLM_SAMPLING = {"max_tokens": 16, "temperature": 1.0}
"""Jobs against the real vLLM: its random tiny model never answers, so it stops at this."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def start(work: Path, model: Path, run_workers: int, delay: float, vllm: bool = False) -> Stack:
    script = work / "script.jsonl"
    script.write_text("".join(json.dumps(e) + "\n" for e in SCRIPT))
    data_dir = work / f"stack-{run_workers}-{delay}{'-vllm' if vllm else ''}"
    settings = Settings(
        data_dir=data_dir,
        port=free_port(),
        sandbox_dir=data_dir / "sandboxes",
        sandbox_backend="bwrap" if shutil.which("bwrap") else "local",
    )
    options = StackOptions(
        workers={"init": 2, "run": run_workers, "eval": 2},
        dev_backend=None
        if vllm
        else DevBackendOptions(model_dir=model, script=script, delay=delay),
        vllm=VllmOptions(model_dir=model) if vllm else None,
    )
    return Stack(settings, options).start()


PARTS = ("submit", "hops", "init", "run_without_model", "eval", "delivery")
"""Where a job's overhead goes (`overhead_parts`): the gateway accepting it (client start until
its record exists), the queue hops between stages (Celery's delivery, `timing.queue`), the
stages' own work (`run` without its model calls), and the result reaching the waiting client
(the job's end until the client has it)."""


def overhead_parts(started_at: float, total: float, traj: Trajectory) -> dict[str, float]:
    """Seconds of each of `PARTS` for one job (wall clock; same machine)."""
    timing = traj.timing
    created = traj.created_at if traj.created_at is not None else started_at
    finished = traj.finished_at if traj.finished_at is not None else created
    return {
        "submit": created - started_at,
        "hops": timing.queue or 0.0,
        "init": timing.init or 0.0,
        "run_without_model": (timing.run or 0.0) - timing.llm,
        "eval": timing.eval or 0.0,
        "delivery": started_at + total - finished,
    }


def measure_overhead(
    client: RolloutClient, jobs: int, sampling: dict[str, Any] | None = None, warm: int = 3
) -> dict[str, Any]:
    overheads: list[float] = []
    totals: list[float] = []
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    for _ in range(warm):  # warm up the workers' connections and template caches
        client.submit_rollout(TASK, sampling=sampling, wait=True, timeout=300)
    for _ in range(jobs):
        started_at = time.time()
        started = time.perf_counter()
        traj = client.submit_rollout(TASK, sampling=sampling, wait=True, timeout=300)
        total = time.perf_counter() - started
        assert isinstance(traj, Trajectory) and traj.status is JobStatus.completed, traj
        totals.append(total)
        overheads.append(total - traj.timing.llm)
        for name, seconds in overhead_parts(started_at, total, traj).items():
            parts[name].append(seconds)
    return {
        "overhead_p50_ms": 1000 * statistics.median(overheads),
        "overhead_p99_ms": 1000 * percentile(overheads, 99),
        "total_p50_ms": 1000 * statistics.median(totals),
        "overhead_parts_p50_ms": {
            name: round(1000 * statistics.median(values), 2) for name, values in parts.items()
        },
        "jobs": jobs,
    }


def measure_turn_overhead(client: RolloutClient, jobs: int) -> dict[str, float]:
    """Per tool turn: its wall time minus model time and tool time (templating, the job
    store's writes, parsing), over a scripted shell agent that calls `true` turn after turn."""
    client.submit_rollout(TOOL_TASK, wait=True, timeout=120)
    overheads: list[float] = []
    for _ in range(jobs):
        traj = client.submit_rollout(
            TOOL_TASK, agent={"max_turns": TOOL_TURNS + 1}, wait=True, timeout=120
        )
        assert isinstance(traj, Trajectory) and traj.status is JobStatus.completed, traj
        turns = traj.turns
        for model, env in zip(turns[0::2], turns[1::2], strict=False):
            assert model.type == "model" and env.type == "env"
            overheads.append(model.turn_seconds - model.llm_seconds - env.tool_seconds)
    return {
        "turn_overhead_p50_ms": 1000 * statistics.median(overheads),
        "turn_overhead_p99_ms": 1000 * percentile(overheads, 99),
        "turns": len(overheads),
    }


def measure_celery_floor(work: Path, runs: int) -> float:
    """p50 seconds of a bare 3-hop Celery chain with the same settings and worker flags."""
    with EmbeddedRedis(work / "floor-redis") as server:
        env = dict(os.environ, FLOOR_REDIS_URL=server.url, PYTHONPATH=str(REPO))
        argv = [sys.executable, "-m", "celery", "-A", "bench.support.celery_floor", "worker"]
        argv += ["-P", "prefork"]
        argv += ["-c", "1", "-E", "--without-gossip", "--without-mingle", "--loglevel", "WARNING"]
        workers = [
            spawn(
                [*argv, "-Q", queue, "-n", f"floor-{queue}@%h"],
                env=env,
                log_path=str(work / f"floor-{queue}.log"),
            )
            for queue in ("init", "run", "eval")
        ]
        try:
            os.environ["FLOOR_REDIS_URL"] = server.url
            # Imported only now: the module's Celery app reads FLOOR_REDIS_URL when imported.
            from bench.support import celery_floor

            client = redis.Redis.from_url(server.url)
            deadline = time.monotonic() + 60
            while len(celery_floor.app.control.ping(timeout=0.5)) < 3:
                assert time.monotonic() < deadline, "floor workers did not start"
            latencies = celery_floor.chain_latency(client, runs + 5)[5:]
        finally:
            for proc in workers:
                stop_group(proc)
    return statistics.median(latencies)


def measure_vllm_overhead(work: Path, model: Path, jobs: int) -> dict[str, Any]:
    """`measure_overhead` against a real vLLM; `{"failed": ...}` when none can serve here."""
    try:
        stack = start(work, model, 1, 0.0, vllm=True)
    except (RuntimeError, TimeoutError) as exc:
        print(f"no real-vLLM row: {exc}", file=sys.stderr)
        return failure(exc)
    with stack, RolloutClient(stack.gateway_url) as client:
        # A fresh engine's first requests take about 25 s: warm it before the clock starts.
        figures: dict[str, Any] = measure_overhead(client, jobs, VLLM_SAMPLING, warm=5)
        traj = client.submit_rollout(TASK, sampling=VLLM_SAMPLING, wait=True, timeout=300)
        assert isinstance(traj, Trajectory)
        figures["llm_p50_ms_one_call"] = round(1000 * traj.timing.llm, 1)
        figures["model_turns"] = sum(1 for t in traj.turns if t.type == "model")
        figures["response_ids"] = len(traj.response_ids)
        return figures


def measure_throughput(client: RolloutClient, jobs: int, workers: int) -> float:
    # Warm every pool process (connections, template pieces) before the clock starts.
    warm = client.submit_batch([TASK] * (4 * workers), group_size=1)
    list(client.iter_batch_results(warm.batch_id))
    started = time.perf_counter()
    batch = client.submit_batch([TASK] * jobs, group_size=1)
    done = list(client.iter_batch_results(batch.batch_id))
    elapsed = time.perf_counter() - started
    assert len(done) == jobs and all(t.status is JobStatus.completed for t in done)
    return jobs / elapsed


def draw(results: dict[str, Any], path: Path) -> Path | None:
    """Per-job overhead p50 against the bare Celery chain (and beside the real vLLM), and
    throughput by run workers against linear scaling from one."""
    floor = results["celery_3hop_floor_p50_ms"]
    vllm = results["real_vllm"]
    rates = {int(k): v for k, v in results["throughput_jobs_per_s"].items()}

    def figure(plt: Any) -> Any:
        fig, (over, scale) = plt.subplots(1, 2, figsize=(10, 4))
        compare_bars(
            over,
            [
                ("bare Celery 3-hop chain", floor if isinstance(floor, int | float) else None),
                ("rollserve, dev server", results["overhead_p50_ms"]),
                ("rollserve, real vLLM", vllm["overhead_p50_ms"] if measured(vllm) else None),
            ],
            unit="ms",
            reference="bare Celery 3-hop chain",
            highlight="rollserve, dev server",
        )
        over.set_title("pipeline overhead per job, p50")
        workers = sorted(rates)
        one = rates[workers[0]] / workers[0]
        scale.plot(workers, [rates[w] for w in workers], "o-", label="measured")
        scale.plot(workers, [one * w for w in workers], ":", color="grey", label="linear from 1")
        for w in workers:
            scale.annotate(
                f"{rates[w]:.3g} jobs/s\n{rates[w] / rates[workers[0]]:.2f}x", (w, rates[w]),
                xytext=(4, -18), textcoords="offset points", fontsize=8,
            )  # fmt: skip
        scale.set_xticks(workers)
        scale.set_ylim(bottom=0)
        scale.set_xlabel("run worker processes")
        scale.set_ylabel("jobs/s")
        scale.set_title("throughput, backend answering after 0.1 s")
        scale.grid(alpha=0.3)
        scale.legend()
        return fig

    return write_figure(path, figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer jobs (under about a minute)")
    parser.add_argument("--no-vllm", action="store_true", help="leave out the real-vLLM row")
    add_figure_option(parser, "pipeline")
    args = parser.parse_args(argv)
    overhead_jobs = 40 if args.quick else 200
    batch_jobs = 24 if args.quick else 96
    delay = 0.1
    results: dict[str, Any] = {"bench": "pipeline", "quick": args.quick}

    with tempfile.TemporaryDirectory(prefix="rollserve-bench-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny-qwen3")
        floor = run_baseline("celery floor", lambda: measure_celery_floor(work, overhead_jobs))
        with start(work, model, 1, 0.0) as stack, RolloutClient(stack.gateway_url) as client:
            results.update(measure_overhead(client, overhead_jobs))
            results.update(measure_turn_overhead(client, 5 if args.quick else 25))
        rates: dict[int, float] = {}
        for workers in (1, 2, 4):
            with (
                start(work, model, workers, delay) as stack,
                RolloutClient(stack.gateway_url) as client,
            ):
                rates[workers] = measure_throughput(client, batch_jobs, workers)
        if args.no_vllm:
            vllm_row: dict[str, Any] = {"failed": "left out (--no-vllm)"}
        else:
            vllm_row = measure_vllm_overhead(work, model, 20 if args.quick else 60)

    if isinstance(floor, float):
        results["celery_3hop_floor_p50_ms"] = 1000 * floor
        results["overhead_vs_celery_floor"] = round(results["overhead_p50_ms"] / (1000 * floor), 2)
    else:
        results["celery_3hop_floor_p50_ms"] = floor
        results["overhead_vs_celery_floor"] = None
    results["real_vllm"] = vllm_row
    results["throughput_jobs_per_s"] = {str(k): round(v, 2) for k, v in rates.items()}
    results["scaling_2_vs_1"] = round(rates[2] / rates[1], 2)
    results["scaling_4_vs_1"] = round(rates[4] / rates[1], 2)
    results["conditions"] = {
        "backend": "development server, script mode (stand-in for vLLM)",
        "backend_delay_s_for_throughput": delay,
        "batch_jobs": batch_jobs,
        "init_eval_workers": 2,
        "tool_turn_sandbox": "bwrap" if shutil.which("bwrap") else "local",
        "cores": __import__("os").cpu_count(),
    }

    print(f"{'measure':<36}{'value':>12}")
    print(f"{'overhead per job p50 (ms)':<36}{results['overhead_p50_ms']:>12.1f}")
    print(f"{'overhead per job p99 (ms)':<36}{results['overhead_p99_ms']:>12.1f}")
    print(f"{'submit→completed p50 (ms)':<36}{results['total_p50_ms']:>12.1f}")
    for name, ms in results["overhead_parts_p50_ms"].items():
        print(f"{f'  of which {name} p50 (ms)':<36}{ms:>12.2f}")
    print(f"{'per tool turn overhead p50 (ms)':<36}{results['turn_overhead_p50_ms']:>12.2f}")
    print(f"{'per tool turn overhead p99 (ms)':<36}{results['turn_overhead_p99_ms']:>12.2f}")
    if isinstance(floor, float):
        print(f"{'bare Celery 3-hop chain p50 (ms)':<36}{1000 * floor:>12.1f}")
        print(f"{'overhead / Celery floor':<36}{results['overhead_vs_celery_floor']:>12.2f}")
    else:
        print(f"{'bare Celery 3-hop chain p50 (ms)':<36}  {floor['failed']}")
    for workers, rate in rates.items():
        print(f"{f'jobs/s, {workers} run worker(s), {delay}s backend':<36}{rate:>12.2f}")
    print(
        f"{'scaling 2 vs 1 / 4 vs 1':<36}"
        f"{results['scaling_2_vs_1']:>6} /{results['scaling_4_vs_1']:>5}"
    )
    if has_failed(vllm_row):
        print(f"{'real vLLM':<36}  {vllm_row['failed']}")
    else:
        print(f"{'real vLLM: overhead per job p50 (ms)':<36}{vllm_row['overhead_p50_ms']:>12.1f}")
        print(f"{'real vLLM: overhead per job p99 (ms)':<36}{vllm_row['overhead_p99_ms']:>12.1f}")
        print(f"{'real vLLM: submit→completed p50 (ms)':<36}{vllm_row['total_p50_ms']:>12.1f}")
    figure = draw(results, args.figure)
    results["figure"] = str(figure) if figure else None
    print_json(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
