"""`rollserve autoscale`: the autoscaler's flags, its launcher, and the loop that prints
each decision."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
from types import FrameType

import redis

from broker.celery_app import QUEUES
from core.settings import Settings
from deploy.autoscale.autoscaler import Autoscaler, Step
from deploy.autoscale.launcher import Launcher, slots
from deploy.autoscale.policy import QueuePolicy, default_policy

LAUNCHERS = ("local", "slurm", "k8s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="local",
        help="where workers run: processes here, Slurm jobs, or the replicas "
        "of a Kubernetes Deployment per queue",
    )
    for queue in QUEUES:
        floor = 1 if queue == "run" else 0
        parser.add_argument(
            f"--{queue}-min",
            type=int,
            default=floor,
            metavar="N",
            help=f"fewest {queue} workers (default {floor})",
        )
        parser.add_argument(
            f"--{queue}-max",
            type=int,
            default=4,
            metavar="N",
            help=f"most {queue} workers (default 4)",
        )
    parser.add_argument(
        "--run-scale-to-zero",
        action="store_true",
        help="let RUN go to no worker (with --run-min 0)",
    )
    parser.add_argument(
        "--run-jobs",
        type=int,
        default=None,
        metavar="N",
        help="start RUN workers that hold N jobs each on one event loop (worker run --jobs N; "
        "ROLLSERVE_AUTOSCALE_RUN_JOBS)",
    )
    parser.add_argument("--once", action="store_true", help="make one decision and exit")
    parser.add_argument(
        "--interval",
        type=float,
        default=None,
        help="seconds between decisions (ROLLSERVE_AUTOSCALE_INTERVAL)",
    )
    parser.add_argument(
        "--sbatch-args",
        default="",
        help="extra sbatch options for worker jobs, e.g. '--partition=cpu'",
    )
    parser.add_argument("--namespace", default=None, help="Kubernetes namespace (k8s)")


def policies(args: argparse.Namespace, settings: Settings) -> dict[str, QueuePolicy]:
    """Each queue's policy from the flags and the ROLLSERVE_AUTOSCALE_* settings."""
    shared = {
        "concurrency": settings.autoscale_concurrency,
        "target_busy_share": settings.autoscale_target_busy_share,
        "hysteresis": min(0.2, settings.autoscale_target_busy_share / 2),
        "scale_out_cooldown": settings.autoscale_scale_out_cooldown,
        "scale_in_cooldown": settings.autoscale_scale_in_cooldown,
    }
    found = {}
    for queue in QUEUES:
        bounds: dict[str, object] = {
            "min_workers": getattr(args, f"{queue}_min"),
            "max_workers": getattr(args, f"{queue}_max"),
        }
        if queue == "run" and args.run_scale_to_zero:
            bounds["scale_to_zero"] = True
        concurrency = slots(queue, settings.autoscale_concurrency, run_jobs(args, settings))
        found[queue] = default_policy(queue, **{**shared, "concurrency": concurrency}, **bounds)
    return found


def run_jobs(args: argparse.Namespace, settings: Settings) -> int:
    """Jobs per RUN worker (0: prefork processes), from `--run-jobs` or the settings."""
    given = getattr(args, "run_jobs", None)
    chosen = settings.autoscale_run_jobs if given is None else given
    if chosen < 0:
        raise ValueError(f"--run-jobs must be 0 or more, not {chosen}")
    return int(chosen)


def make_launcher(args: argparse.Namespace, settings: Settings) -> Launcher:
    if args.launcher == "slurm":
        from deploy.autoscale.slurm import SlurmLauncher

        return SlurmLauncher(
            log_dir=settings.data_dir / "logs" / "slurm",
            concurrency=settings.autoscale_concurrency,
            sbatch_args=shlex.split(args.sbatch_args),
            run_jobs=run_jobs(args, settings),
        )
    if args.launcher == "k8s":
        from deploy.autoscale.kubernetes import KubernetesLauncher

        return KubernetesLauncher(namespace=args.namespace)
    import os

    from deploy.autoscale.local import LocalLauncher

    env = {**os.environ, "ROLLSERVE_REDIS_URL": settings.redis_url or ""}
    return LocalLauncher(
        env,
        settings.data_dir / "logs" / "autoscale",
        settings.autoscale_concurrency,
        run_jobs=run_jobs(args, settings),
    )


def print_step(step: Step) -> None:
    print(step.describe(), flush=True)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """The command: one decision with `--once`, else decisions until SIGTERM or Ctrl-C (the
    local launcher then warm-stops the workers it started and waits for them)."""
    if not settings.redis_url:
        print("rollserve autoscale: set ROLLSERVE_REDIS_URL to the stack's Redis", file=sys.stderr)
        return 2
    try:
        chosen = policies(args, settings)
    except ValueError as exc:
        print(f"rollserve autoscale: {exc}", file=sys.stderr)
        return 2
    from broker.jobstore import JobStore
    from deploy.autoscale.state import read_loads

    store = JobStore(redis.Redis.from_url(settings.redis_url), settings.key_prefix)
    launcher = make_launcher(args, settings)
    scaler = Autoscaler(launcher, chosen, lambda: read_loads(store), settle=not args.once)
    if args.once:
        # Local workers live only as long as the autoscaler that started them.
        apply = args.launcher != "local"
        if not apply:
            print("(local launcher: one decision shown, no worker started or stopped)")
        steps = scaler.tick(apply=apply)
        for step in steps:
            print_step(step)
        return 1 if any(step.error for step in steps) else 0
    stop = threading.Event()

    def handler(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    try:
        scaler.run(stop, args.interval or settings.autoscale_interval, print_step)
    finally:
        if args.launcher == "local":
            print("stopping the workers started here (each finishes its jobs) ...", flush=True)
            launcher.close()
    return 0
