"""Training through rollserve, end to end: the example GRPO trainer (`examples/train`) learns
the `casing` task on CPU with its rollouts, rewards and weight switches all through a real
stack (embedded Redis, prefork workers, the gateway, the development inference server serving
the policy being trained).

The same steps run twice from the same starting policy and seeds: synchronously (roll out,
train, switch the fleet's weights, repeat) and asynchronously, one step off-policy (batch k+1
rolls out while the trainer works on batch k; jobs carry `max_staleness` 1). Reported: the
reward curve of each (first and last five steps), the policy versions the trajectories came
from, how long a weight switch took (drain, load, resume, as `update_weights` reports it),
seconds per step in each mode and their ratio, and the staleness of the async mode's turns
(steps between the weights that generated a turn and those it was trained into). It draws the
reward curves, by step and by wall time, into `bench/figures/train.png`.

    .venv/bin/python bench/train.py [--quick] [--steps N] [--ppo-epochs K] [--backend-delay S]

Here rollout and training share two cores, so running them at once gains little; with
`--backend-delay` the inference time is spent waiting, as on a fleet of other machines.

Needs the example installed (`make install` does it: `pip install -e examples/train`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # bench/routing.py would shadow the `routing` package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.plot import pyplot
from bench.support.report import print_json
from broker.processes import free_port
from core.settings import Settings, get_settings
from deploy.stack import DevBackendOptions, Stack, StackOptions
from routing.devserver.tiny import make_tiny_model

FIGURE = Path(__file__).resolve().parent / "figures" / "train.png"


def run_mode(
    mode: Literal["sync", "async"], policy: Path, work: Path, args: argparse.Namespace
) -> list[Any]:
    from rollserve_casing.grpo import Config, describe, train

    data = work / f"stack-{mode}"
    settings = Settings(data_dir=data, port=free_port(), sandbox_dir=data / "boxes")
    options = StackOptions(
        workers={"init": 1, "run": args.run_workers, "eval": 1},
        dev_backend=DevBackendOptions(model_dir=policy, delay=args.backend_delay),
        # One compute thread per process, as the trainer has: with more threads than free
        # cores, torch's OpenMP workers wait on each other, and the trainer and the server's
        # model would slow each other down several times over.
        env={"OMP_NUM_THREADS": "1"},
    )
    with Stack(settings, options).start() as stack:
        cfg = Config(
            url=stack.gateway_url,
            policy_dir=policy,
            work_dir=work / f"weights-{mode}",
            steps=args.steps,
            prompts=args.prompts,
            group_size=args.group_size,
            ppo_epochs=args.ppo_epochs,
            mode=mode,
            max_staleness=1,
            seed=args.seed,
            decoupled=not args.plain_ppo,
        )

        return train(cfg, lambda row: print(f"{mode:>5} {describe(row)}", flush=True))


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summary(stats: list[Any]) -> dict[str, Any]:
    rewards = [s.reward_mean for s in stats]
    # The first step includes the first rollout, which no training overlaps: left out.
    steady = [s.seconds for s in stats[1:]] or [s.seconds for s in stats]
    staleness: Counter[int] = Counter()
    versions: set[int] = set()
    for s in stats:
        staleness.update(s.staleness)
        versions.update(s.turn_versions)
    return {
        "reward_first5_mean": round(mean(rewards[:5]) or 0.0, 4),
        "reward_last5_mean": round(mean(rewards[-5:]) or 0.0, 4),
        "rewards": [round(r, 4) for r in rewards],
        "step_s_mean": round(statistics.fmean(steady), 3),
        "wall_s": round(sum(s.seconds for s in stats), 2),
        "policy_versions_seen": sorted(versions),
        "staleness_histogram": {str(k): v for k, v in sorted(staleness.items())},
        "failed_jobs": sum(s.failed for s in stats),
        "switch_s": [round(s.switch_s, 4) for s in stats],
        "max_ratio_deviation": round(max(s.max_ratio_deviation for s in stats), 6),
    }


def draw(runs: Mapping[str, list[Any]], path: Path) -> Path | None:
    plt, missing = pyplot()
    if plt is None:
        print(f"{missing}: no figure", file=sys.stderr)
        return None
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode, stats in runs.items():
        rewards = [s.reward_mean for s in stats]
        clock, elapsed = [], 0.0
        for s in stats:
            elapsed += s.seconds
            clock.append(elapsed)
        by_step.plot(range(1, len(rewards) + 1), rewards, marker=".", label=mode)
        by_time.plot(clock, rewards, marker=".", label=mode)
    by_step.set_xlabel("optimizer step")
    by_time.set_xlabel("wall time (s)")
    for ax in (by_step, by_time):
        ax.set_ylabel("mean reward (rollserve EVAL)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("GRPO on the casing task through rollserve (tiny Qwen3, CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 steps per mode")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--ppo-epochs", type=int, default=2)
    parser.add_argument("--run-workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plain-ppo",
        action="store_true",
        help="clip against the service's logprobs (plain PPO) instead of decoupled PPO",
    )
    parser.add_argument(
        "--backend-delay",
        type=float,
        default=0.0,
        help="seconds the development server waits before each answer: inference that runs "
        "elsewhere (a GPU fleet), whose time does not take this machine's cores",
    )
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 6
    print_json(measure(args))
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both modes: the figures, or `{"failed": ...}` when the example is not installed."""
    try:
        from rollserve_casing.policy import WarmStart, make_policy
    except ImportError as exc:
        return {"bench": "train", "failed": f"the example is not installed: {exc}"}

    started = time.perf_counter()
    base = make_tiny_model(get_settings().tiny_model_dir.resolve())
    with tempfile.TemporaryDirectory(prefix="rollserve-bench-train-") as tmp:
        work = Path(tmp)
        policy = make_policy(base, work / "start", WarmStart(seed=args.seed))
        modes: tuple[Literal["sync", "async"], ...] = ("sync", "async")
        runs: dict[str, list[Any]] = {m: run_mode(m, policy, work, args) for m in modes}
    figure = draw(runs, args.figure)

    sync, asyn = summary(runs["sync"]), summary(runs["async"])
    switches = [s.switch_s for stats in runs.values() for s in stats]
    results: dict[str, Any] = {
        "bench": "train",
        "params": {k: v for k, v in vars(args).items() if k != "figure"},
        "reward_first5_mean": sync["reward_first5_mean"],
        "reward_last5_mean": sync["reward_last5_mean"],
        "reward_first5_mean_async": asyn["reward_first5_mean"],
        "reward_last5_mean_async": asyn["reward_last5_mean"],
        "policy_versions_seen": sorted(
            set(sync["policy_versions_seen"]) | set(asyn["policy_versions_seen"])
        ),
        "weight_switch_s_p50": round(statistics.median(switches), 4),
        "step_s_sync": sync["step_s_mean"],
        "step_s_async": asyn["step_s_mean"],
        "async_speedup_vs_sync": round(sync["step_s_mean"] / asyn["step_s_mean"], 3),
        "staleness_histogram_async": asyn["staleness_histogram"],
        "staleness_histogram_sync": sync["staleness_histogram"],
        "sync": sync,
        "async": asyn,
        "figure": str(figure) if figure else None,
        "aims": {
            "reward_rises_0.2_sync": sync["reward_last5_mean"] - sync["reward_first5_mean"] >= 0.2,
            "reward_rises_0.2_async": asyn["reward_last5_mean"] - asyn["reward_first5_mean"] >= 0.2,
            "async_1.3x": sync["step_s_mean"] / asyn["step_s_mean"] >= 1.3,
        },
        "seconds": round(time.perf_counter() - started, 1),
        "warm_start": asdict(WarmStart(seed=args.seed)),
    }
    print()
    print(f"{'':<8}{'first 5':>9}{'last 5':>9}{'s/step':>9}")
    for mode, s in (("sync", sync), ("async", asyn)):
        print(
            f"{mode:<8}{s['reward_first5_mean']:>9.3f}{s['reward_last5_mean']:>9.3f}{s['step_s_mean']:>9.2f}"
        )
    print(
        f"async speed-up {results['async_speedup_vs_sync']}x; "
        f"switch p50 {results['weight_switch_s_p50']}s"
    )
    return results


if __name__ == "__main__":
    sys.exit(main())
