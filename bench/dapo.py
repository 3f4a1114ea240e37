"""Time and waste to reach K informative groups: three ways of doing DAPO dynamic sampling.

One real stack (embedded Redis, prefork init/run/eval workers, the gateway, the development
server in script mode) and task pools whose rewards and rollout times are scripted: a task's
samples are all right, all wrong, or mixed (then its group of 4 is informative: two right,
two wrong), and every model call takes the task's delay, drawn from a heavy-tailed
distribution (median 1 s) — heterogeneous rollout times, as agent tasks have. A trainer's
loop of a few steps, each needing K informative groups from its own pool; all three modes
draw the same tasks in the same order, with the same number of groups in flight (the run
fleet is just big enough for them):

(a) round-synchronous DAPO: plain batches of `inflight` groups, each waited for whole,
    filtered on the client; rounds go on until K informative groups are in;
(b) asynchronous refill without early cancellation: a dynamic batch with
    `early_cancel: false` — groups refill as slots free up; at the target the trainer moves
    on, and what still runs of the batch runs to its end beside the next step (discarded);
(c) rollserve: a dynamic batch — refill, and early cancellation at the target.

Per mode: seconds until every step had its K groups (the sum over steps, and the median
step), until nothing of the mode runs any more (`settled`), and rollout-seconds (each job's
time from its first stage to its end, from the job store) split into used (the K groups),
filtered (uniform groups found before the target: the price of DAPO itself) and wasted
(work beyond what the target needed: groups cut off by the cancellation or completed after
the target, whatever their rewards); `fleet busy` is rollout-seconds over run processes times
settled time (what waiting for whole rounds leaves idle).

    .venv/bin/python bench/dapo.py [--quick]

The last line printed is one JSON object with every figure and the conditions; its
figure (`--figure PATH`, default bench/figures/dapo.png) shows each mode's time to K against
(a) and its rollout-seconds used, filtered and wasted. A baseline
mode, (a) or (b), that fails is recorded as `{"failed": "..."}` (its batches are cancelled,
ratios against it are null) and not run again; (c) is still run and reported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import statistics
import sys
import tempfile
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

from api.client import RolloutClient, RolloutServiceError
from bench.support.plot import add_figure_option, compare_bars, measured, write_figure
from bench.support.report import print_json, run_baseline
from broker.processes import free_port
from core.settings import Settings
from deploy.stack import DevBackendOptions, Stack, StackOptions
from routing.devserver.tiny import make_tiny_model

RIGHT, WRONG = "So it is \\boxed{4}.", "I think \\boxed{5}."
GROUP = 4
KINDS = {"mixed": [[RIGHT], [WRONG]], "right": [[RIGHT]], "wrong": [[WRONG]]}
SAMPLING = {"seed": 0, "max_tokens": 32}


@dataclass
class PoolTask:
    marker: str
    kind: str
    delay: float

    @property
    def task(self) -> dict[str, str]:
        return {
            "data_source": "math",
            "instance_id": self.marker.lower(),
            "problem": f"{self.marker}: What is 2+2?",
            "answer": "4",
        }


def make_pool(n: int, seed: int, informative: float) -> list[PoolTask]:
    """`n` tasks in a seeded order: a share `informative` mixed, the rest all right or all wrong
    (3:2); delays log-normal around 1 s (sigma 0.7), between 0.25 and 6 s."""
    rng = random.Random(seed)
    mixed = round(n * informative)
    right = round((n - mixed) * 0.6)
    kinds = ["mixed"] * mixed + ["right"] * right + ["wrong"] * (n - mixed - right)
    rng.shuffle(kinds)
    return [
        PoolTask(
            f"DAPO-{seed}-{i:03d}", kind, round(min(6.0, max(0.25, math.exp(rng.gauss(0, 0.7)))), 2)
        )
        for i, kind in enumerate(kinds)
    ]


def script_for(pools: list[list[PoolTask]]) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = [{"match": "WARM-UP:", "samples": [[RIGHT], [WRONG]]}]
    for pool in pools:
        for t in pool:
            entries.append({"match": f"{t.marker}:", "samples": KINDS[t.kind], "delay": t.delay})
    return entries


PARTS = ("used", "filtered", "wasted")


@dataclass
class Run:
    """One mode through every step of a training loop."""

    mode: str
    steps_to_target: list[float]
    """Per step: seconds from its submission until its K groups are at the client."""
    settled: float = 0.0
    """Seconds from the loop's start until nothing of this mode runs any more."""
    groups_drawn: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    service: list[dict[str, Any]] = field(default_factory=list)
    batch_ids: list[str] = field(default_factory=list)
    """Every batch submitted, so that a failed run's can be cancelled."""

    @property
    def to_target(self) -> float:
        return sum(self.steps_to_target)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def share(self, part: str) -> float:
        return self.seconds[part] / self.total if self.total else 0.0


def job_seconds(r: redis.Redis, job_ids: list[str]) -> dict[str, tuple[float, float]]:
    """Per job: rollout-seconds (first stage → end; 0 if it never started) and its end."""
    pipe = r.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hmget(f"rs:job:{job_id}", ["t_init", "t_end"])
    out: dict[str, tuple[float, float]] = {}
    for job_id, (t_init, t_end) in zip(job_ids, pipe.execute(), strict=True):
        end = float(t_end) if t_end else math.inf
        out[job_id] = (end - float(t_init) if t_init and t_end else 0.0, end)
    return out


def round_synchronous_step(
    client: RolloutClient,
    r: redis.Redis,
    pool: list[PoolTask],
    target: int,
    inflight: int,
    run: Run,
) -> None:
    """(a), one step: rounds of `inflight` groups as plain batches, each waited for whole."""
    started = time.perf_counter()
    groups: dict[str, list[str]] = {}
    rewards: dict[str, list[float | None]] = {}

    def informative() -> int:
        return sum(1 for v in rewards.values() if None not in v and len(set(v)) > 1)

    cursor = 0
    while informative() < target and cursor < len(pool):
        round_tasks = pool[cursor : cursor + inflight]
        cursor += len(round_tasks)
        batch = client.submit_batch([t.task for t in round_tasks], GROUP, sampling=SAMPLING)
        run.batch_ids.append(batch.batch_id)
        for traj in client.iter_batch_results(batch.batch_id):  # the whole round
            groups.setdefault(traj.group_id, []).append(traj.job_id)
            rewards.setdefault(traj.group_id, []).append(traj.reward)
    run.steps_to_target.append(time.perf_counter() - started)
    run.groups_drawn += len(groups)
    # Judged as the service judges: in order of completion, groups after the K-th informative
    # one were not needed (surplus), whatever their rewards.
    secs = job_seconds(r, [j for jobs in groups.values() for j in jobs])
    finished = {g: max(secs[j][1] for j in jobs) for g, jobs in groups.items()}
    kept = 0
    for group_id in sorted(groups, key=lambda g: finished[g]):
        cost = sum(secs[j][0] for j in groups[group_id])
        values = rewards[group_id]
        if kept >= target:
            run.seconds["wasted"] += cost
        elif None not in values and len(set(values)) > 1:
            kept += 1
            run.seconds["used"] += cost
        else:
            run.seconds["filtered"] += cost


def dynamic_step(
    client: RolloutClient, pool: list[PoolTask], target: int, inflight: int, run: Run
) -> str:
    """(b) or (c), one step: a dynamic batch, read until its K groups are in; the trainer
    moves on then (with (b), what still runs of it goes on beside the next step)."""
    started = time.perf_counter()
    batch = client.submit_batch(
        [t.task for t in pool],
        GROUP,
        sampling=SAMPLING,
        dynamic_sampling={
            "target_groups": target,
            "max_inflight_groups": inflight,
            "early_cancel": run.mode == "c",
        },
    )
    run.batch_ids.append(batch.batch_id)
    counts: dict[str, int] = {}
    for traj in client.iter_batch_results(batch.batch_id):
        counts[traj.group_id] = counts.get(traj.group_id, 0) + 1
        if sum(1 for n in counts.values() if n == GROUP) == target:
            break
    run.steps_to_target.append(time.perf_counter() - started)
    return batch.batch_id


def settle_dynamic(
    client: RolloutClient, r: redis.Redis, batch_ids: list[str], target: int, run: Run
) -> None:
    """Wait until every batch of the run is done, then account its rollout-seconds by the
    service's verdicts (`accepted` used; `filtered`, `failed` filtered; the rest wasted)."""
    while not all(client.batch_progress(b).done for b in batch_ids):
        time.sleep(0.05)
    part = {"accepted": "used", "filtered": "filtered", "failed": "filtered"}
    for batch_id in batch_ids:
        progress = client.batch_progress(batch_id)
        dyn = progress.dynamic
        assert dyn is not None and dyn.groups_accepted == target, progress
        assert dyn.unconfirmed_stops == 0
        run.groups_drawn += dyn.groups_drawn
        job_ids = [j.decode() for j in r.lrange(f"rs:batch:{batch_id}:jobs", 0, -1)]
        secs = job_seconds(r, job_ids)
        for job_id in job_ids:
            verdict = r.hget(f"rs:group:{job_id.rsplit('-', 1)[0]}", "verdict") or b""
            run.seconds[part.get(verdict.decode(), "wasted")] += secs[job_id][0]
        run.service.append(
            {
                "rollout_seconds": {
                    "used": round(dyn.rollout_seconds_used, 2),
                    "filtered": round(dyn.rollout_seconds_filtered, 2),
                    "wasted": round(dyn.rollout_seconds_wasted, 2),
                },
                "groups": {
                    "drawn": dyn.groups_drawn,
                    "accepted": dyn.groups_accepted,
                    "filtered": dyn.groups_filtered,
                    "cancelled": dyn.groups_cancelled,
                    "surplus": dyn.groups_surplus,
                },
                "time_to_target": round(dyn.time_to_target or math.nan, 3),
                "time_to_done": round(dyn.time_to_done or math.nan, 3),
            }
        )


def run_mode(
    run: Run,
    client: RolloutClient,
    r: redis.Redis,
    pools: list[list[PoolTask]],
    target: int,
    inflight: int,
) -> Run:
    """A training loop of `run.mode`, one step per pool: each step needs K informative groups."""
    started = time.perf_counter()
    if run.mode == "a":
        for pool in pools:
            round_synchronous_step(client, r, pool, target, inflight, run)
    else:
        batch_ids = [dynamic_step(client, pool, target, inflight, run) for pool in pools]
        settle_dynamic(client, r, batch_ids, target, run)
    run.settled = time.perf_counter() - started
    return run


def cancel_batches(client: RolloutClient, batch_ids: list[str]) -> None:
    """Cancel what still runs of `batch_ids` (after a failed run), so it loads no later mode."""
    for batch_id in batch_ids:
        with contextlib.suppress(RolloutServiceError):
            client.cancel_batch(batch_id)


def start(work: Path, model: Path, script: list[dict[str, Any]], run_workers: int) -> Stack:
    path = work / "script.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in script))
    settings = Settings(data_dir=work / "stack", port=free_port(), sandbox_backend="local")
    options = StackOptions(
        workers={"init": 2, "run": run_workers, "eval": 2},
        dev_backend=DevBackendOptions(model_dir=model, script=path),
    )
    return Stack(settings, options).start()


def warm_up(client: RolloutClient, jobs: int) -> None:
    task = {"data_source": "math", "problem": "WARM-UP: What is 2+2?", "answer": "4"}
    batch = client.submit_batch([task] * (jobs // GROUP), GROUP, sampling=SAMPLING)
    list(client.iter_batch_results(batch.batch_id))


NAMES = {"a": "(a) round-synchronous", "b": "(b) refill, no cancel", "c": "(c) rollserve"}


def draw(results: dict[str, Any], path: Path) -> Path | None:
    """Time to K informative groups per mode (speed-up against (a)), and its rollout-seconds
    split into used, filtered and wasted (medians over the loops)."""
    modes = [m for m in NAMES if measured(results.get(m))]

    def part(mode: str, name: str) -> float:
        return statistics.median(run["rollout_seconds"][name] for run in results[mode]["runs"])

    def figure(plt: Any) -> Any:
        fig, (time_ax, work_ax) = plt.subplots(1, 2, figsize=(10, 4))
        compare_bars(
            time_ax,
            [
                (NAMES[m], results[m]["to_target_all_steps_s_median"] if m in modes else None)
                for m in NAMES
            ],
            unit="s",
            reference=NAMES["a"],
            highlight=NAMES["c"],
            speedup=True,
        )
        time_ax.set_title("time to K informative groups, all steps")
        bottom = [0.0] * len(modes)
        for name, colour in zip(PARTS, ("tab:green", "tab:gray", "tab:red"), strict=True):
            heights = [part(m, name) for m in modes]
            work_ax.bar([NAMES[m] for m in modes], heights, bottom=bottom, color=colour, label=name)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for x, m in enumerate(modes):
            work_ax.annotate(
                f"{results[m]['wasted_share_median']:.1%} wasted", (x, bottom[x]), xytext=(0, 2),
                textcoords="offset points", ha="center", fontsize=8,
            )  # fmt: skip
        work_ax.tick_params(axis="x", labelrotation=20)
        work_ax.set_ylabel("rollout-seconds")
        work_ax.set_title("rollout-seconds by use")
        work_ax.margins(y=0.3)
        work_ax.legend(fontsize=8, loc="upper center", ncol=3)
        fig.suptitle("DAPO dynamic sampling: three modes on one stack")
        return fig

    return write_figure(path, figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short loop (about a minute)")
    add_figure_option(parser, "dapo")
    args = parser.parse_args(argv)
    pool_size, target, inflight = (32, 8, 4) if args.quick else (64, 16, 4)
    steps, repeats = (2, 1) if args.quick else (2, 2)
    informative = 0.35
    loops = [
        [make_pool(pool_size, 10 * rep + step, informative) for step in range(steps)]
        for rep in range(repeats)
    ]
    run_workers = inflight * GROUP
    runs: dict[str, list[Run]] = {"a": [], "b": [], "c": []}
    failed: dict[str, dict[str, str]] = {}  # baseline modes that failed (not run again)
    names = {
        "a": "(a) round-synchronous",
        "b": "(b) async refill, no cancel",
        "c": "(c) refill + early cancel",
    }

    with tempfile.TemporaryDirectory(prefix="rollserve-bench-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny-qwen3")
        script = script_for([pool for loop in loops for pool in loop])
        with (
            start(work, model, script, run_workers) as stack,
            RolloutClient(stack.gateway_url, timeout=120) as client,
        ):
            r = redis.Redis.from_url(stack.redis_url)
            warm_up(client, run_workers * 2)
            for rep, pools in enumerate(loops):
                # every mode runs its whole loop alone; the order turns with each repetition
                for mode in ("a", "b", "c") if rep % 2 == 0 else ("c", "b", "a"):
                    if mode in failed:
                        continue
                    run = Run(mode, [])
                    measure = functools.partial(run_mode, run, client, r, pools, target, inflight)
                    outcome = measure() if mode == "c" else run_baseline(names[mode], measure)
                    if isinstance(outcome, Run):
                        runs[mode].append(outcome)
                    else:
                        failed[mode] = outcome
                        cancel_batches(client, run.batch_ids)

    def med(mode: str, value: str) -> float:
        getters = {
            "to_target": lambda o: o.to_target,
            "settled": lambda o: o.settled,
            "step": lambda o: statistics.median(o.steps_to_target),
            "total": lambda o: o.total,
            "wasted": lambda o: o.seconds["wasted"],
            "wasted_share": lambda o: o.share("wasted"),
            "filtered_share": lambda o: o.share("filtered"),
            "drawn": lambda o: float(o.groups_drawn),
            "busy": lambda o: o.total / (run_workers * o.settled),
        }
        return float(statistics.median(getters[value](o) for o in runs[mode]))

    print(
        f"{steps} training steps of K = {target} informative groups of {GROUP}, "
        f"{inflight} groups in flight, {run_workers} run processes; median of {repeats} loop(s)"
    )
    print(
        f"{'mode':<30}{'to K, all steps':>16}{'per step':>10}{'settled':>9}{'rollout-s':>11}"
        f"{'wasted':>8}{'filtered':>10}{'groups':>8}{'fleet busy':>12}"
    )
    for mode, name in names.items():
        if mode in failed:
            print(f"{name:<30}  {failed[mode]['failed']}")
            continue
        print(
            f"{name:<30}{med(mode, 'to_target'):>15.1f}s{med(mode, 'step'):>9.2f}s"
            f"{med(mode, 'settled'):>8.1f}s{med(mode, 'total'):>11.1f}"
            f"{100 * med(mode, 'wasted_share'):>7.1f}%{100 * med(mode, 'filtered_share'):>9.1f}%"
            f"{med(mode, 'drawn'):>8.0f}{100 * med(mode, 'busy'):>11.0f}%"
        )
    ratios: dict[str, dict[str, float | None]] = {}
    for mode in ("b", "c"):
        if "a" in failed or mode in failed:  # no ratio against a failed baseline
            ratios[mode] = {"to_target_speedup_vs_a": None, "wasted_seconds_vs_a": None}
            continue
        ratios[mode] = {
            "to_target_speedup_vs_a": round(med("a", "to_target") / med(mode, "to_target"), 2),
            "wasted_seconds_vs_a": round(med(mode, "wasted") / med("a", "wasted"), 2)
            if med("a", "wasted")
            else None,
        }

    def speedup(mode: str) -> str:
        value = ratios[mode]["to_target_speedup_vs_a"]
        return "n/a" if value is None else f"{value}x faster"

    print(f"time to K against (a): (b) {speedup('b')}, (c) {speedup('c')}")
    results: dict[str, Any] = {"bench": "dapo", "quick": args.quick}
    for mode in names:
        if mode in failed:
            results[mode] = failed[mode]
            continue
        results[mode] = {
            "to_target_all_steps_s_median": round(med(mode, "to_target"), 2),
            "to_target_per_step_s_median": round(med(mode, "step"), 2),
            "settled_s_median": round(med(mode, "settled"), 2),
            "rollout_seconds_median": round(med(mode, "total"), 1),
            "wasted_seconds_median": round(med(mode, "wasted"), 1),
            "wasted_share_median": round(med(mode, "wasted_share"), 3),
            "filtered_share_median": round(med(mode, "filtered_share"), 3),
            "groups_drawn_median": med(mode, "drawn"),
            "fleet_busy_share_median": round(med(mode, "busy"), 3),
            "runs": [
                {
                    "steps_to_target_s": [round(x, 2) for x in o.steps_to_target],
                    "settled_s": round(o.settled, 2),
                    "rollout_seconds": {k: round(v, 2) for k, v in o.seconds.items()},
                    "groups_drawn": o.groups_drawn,
                    **({"service": o.service} if o.service else {}),
                }
                for o in runs[mode]
            ],
        }
    results["ratios"] = ratios
    results["conditions"] = {
        "backend": "development server, script mode (stand-in for vLLM)",
        "steps_per_loop": steps,
        "loops": repeats,
        "pool_size_per_step": pool_size,
        "informative_share": informative,
        "group_size": GROUP,
        "target_groups": target,
        "groups_in_flight": inflight,
        "model_call_delay_s": "per task, log-normal, median 1, sigma 0.7, clipped to [0.25, 6]",
        "workers": {"init": 2, "run": run_workers, "eval": 2},
        "cores": os.cpu_count(),
    }
    figure = draw(results, args.figure)
    results["figure"] = str(figure) if figure else None
    print_json(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
