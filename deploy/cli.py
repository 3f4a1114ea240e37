"""The `rollserve` command: up, worker, gateway, submit, status, dev-backend, demo."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from broker.celery_app import QUEUES
from core.settings import Settings, get_settings
from deploy.engine import ENGINES

if TYPE_CHECKING:
    from deploy.stack import Stack


def _stop_on_sigterm() -> threading.Event:
    """SIGTERM and SIGINT become a normal exit path, so children are stopped, never orphaned."""
    stopping = threading.Event()

    def handler(_signum: int, _frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stopping


def _parse_backend(value: str) -> dict[str, str]:
    """`URL=MODEL` or `URL=MODEL:kind` → a backend registration."""
    if "=" not in value:
        raise argparse.ArgumentTypeError(f"--backend {value!r}: expected URL=MODEL[:vllm|sglang]")
    url, model = value.split("=", 1)
    kind = "vllm"
    if model.rsplit(":", 1)[-1] in ("vllm", "sglang"):
        model, kind = model.rsplit(":", 1)
    return {"url": url, "model": model, "kind": kind}


# ----------------------------------------------------------------------------- commands


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from deploy.engine import VllmOptions, usable_vllm
    from deploy.stack import DevBackendOptions, Stack, StackOptions

    if args.engine == "vllm" and args.script is not None:
        print("rollserve up: --script is for the development server, not vLLM", file=sys.stderr)
        return 2
    if args.model is not None and not (args.model / "config.json").is_file():
        print(f"rollserve up: --model {args.model}: no config.json there", file=sys.stderr)
        return 2

    if args.run_jobs is not None and args.run_jobs < 1:
        print(f"rollserve up: --run-jobs must be at least 1, not {args.run_jobs}", file=sys.stderr)
        return 2
    options = StackOptions(
        workers={"init": args.init_workers, "run": args.run_workers, "eval": args.eval_workers},
        backends=list(args.backend or []),
        flower=args.flower,
        flower_port=args.flower_port,
        flower_address=args.flower_address,
        gateway_port=args.port,
        run_jobs=args.run_jobs or 0,
    )
    if args.engine == "vllm":
        try:
            usable_vllm()  # before anything starts
        except RuntimeError as exc:
            print(f"rollserve up: {exc}", file=sys.stderr)
            return 1
        options.vllm = VllmOptions(model_dir=args.model)
    if (not args.backend and args.engine == "dev") or args.dev_backend:
        options.dev_backend = DevBackendOptions(
            model_dir=args.model,
            script=args.script,
            port=settings.dev_backend_port,
        )
    from broker.embedded import redact_url

    stopping = _stop_on_sigterm()
    stack = Stack(settings, options)
    print("starting rollserve ...", flush=True)
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as exc:  # the stack stopped whatever it had started
        print(f"rollserve up: {exc}", file=sys.stderr, flush=True)
        return 1
    with stack:
        print(f"gateway      {stack.gateway_url}  (OpenAPI at {stack.gateway_url}/docs)")
        print(f"redis        {redact_url(stack.redis_url)}{'  (embedded)' if stack.redis else ''}")
        if stack.dev_backend_url:
            print(f"dev backend  {stack.dev_backend_url}  (stand-in for vLLM)")
        if stack.vllm_url:
            print(
                f"vllm         {stack.vllm_url}  (log: {settings.data_dir / 'logs' / 'vllm.log'})"
            )
        if args.flower:
            auth = (
                "  (user rollserve, the API token)"
                if settings.api_token
                else f"  (user rollserve, password in {stack.flower_password_file})"
            )
            print(f"flower       http://{args.flower_address}:{args.flower_port}{auth}")
        print(f"workers      {', '.join(stack.worker_names.values())}")
        print(f"logs         {settings.data_dir / 'logs'}")
        _wait_ready(stack, stopping)
        print("Ctrl-C stops everything.", flush=True)
        stopping.wait()
        print("stopping ...", flush=True)
    return 0


def _wait_ready(stack: Stack, stopping: threading.Event) -> None:
    """Say `ready` once `GET /readyz` answers 200; until then, say what is missing (a stack
    that leaves a queue or the backends to other machines waits for them to join)."""
    said: list[str] = []
    while not stopping.is_set():
        missing = stack.readiness()
        if not missing:
            print(f"ready        {stack.gateway_url}/readyz answers 200", flush=True)
            return
        if missing != said:
            print(f"not ready    waiting for {', '.join(missing)}", flush=True)
            said = missing
        stopping.wait(1.0)


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    if not settings.redis_url:
        print("rollserve worker: set ROLLSERVE_REDIS_URL to the stack's Redis", file=sys.stderr)
        return 2
    from broker.celery_app import get_celery

    problem = worker_options_problem(args)
    if problem:
        print(f"rollserve worker: {problem}", file=sys.stderr)
        return 2
    argv = worker_argv(args, settings)
    from celery.bin.celery import celery as celery_command

    get_celery()  # fails early, naming the setting, without ROLLSERVE_REDIS_URL
    # Celery's own command line in standalone mode exits with the worker's status (the app's
    # `worker_main` drops it), so a worker that lost the broker for good exits non-zero and
    # its supervisor (systemd) restarts it.
    celery_command.main(args=["-A", "broker.worker_app", *argv], prog_name="celery")
    return 0


def worker_argv(args: argparse.Namespace, settings: Settings) -> list[str]:
    """The `celery worker` arguments of a `rollserve worker` command line that
    `worker_options_problem` accepts."""
    from broker.celery_app import worker_queues
    from workers.jobpool import use_jobs_pool

    node_only = bool(getattr(args, "node_only", False))
    queues = ",".join(worker_queues(args.queue, settings.node_name, node_only=node_only))
    # Many jobs per process (RUN only): Celery's threads pool, each thread's episode on the
    # process's shared event loop (workers.jobsloop); INIT and EVAL are CPU-bound: prefork.
    pool = [*use_jobs_pool(), "-c", str(args.jobs)] if args.jobs else ["-P", "prefork"]
    argv = ["worker", "-Q", queues, *pool, "-E", "--loglevel", args.loglevel]
    argv += ["-n", args.hostname or f"{args.queue}-{os.getpid()}@{settings.node_name}"]
    if args.concurrency:
        argv += ["--concurrency", str(args.concurrency)]
    if args.autoscale:
        argv += ["--autoscale", args.autoscale]
    return argv


def worker_options_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a `rollserve worker` command line, or None."""
    if getattr(args, "node_only", False) and args.queue == "init":
        return "--node-only is for RUN and EVAL workers: INIT has no node queue (all take `init`)"
    jobs = getattr(args, "jobs", None)
    if jobs is None:
        return None
    if args.queue != "run":
        return f"--jobs is for RUN workers only; {args.queue} work is CPU-bound (use --concurrency)"
    if jobs < 1:
        return f"--jobs must be at least 1, not {jobs}"
    if args.concurrency or args.autoscale:
        return "--jobs sets how many jobs the process holds; drop --concurrency and --autoscale"
    return None


def cmd_autoscale(args: argparse.Namespace, settings: Settings) -> int:
    from deploy.autoscale.command import run

    return run(args, settings)


def cmd_gateway(args: argparse.Namespace, settings: Settings) -> int:
    from deploy.stack import gateway_bind_refusal

    host = args.host or settings.host
    refusal = gateway_bind_refusal(host, settings)
    if refusal is not None:
        print(f"rollserve gateway: {refusal}", file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run("api.main:app", host=host, port=args.port or settings.port)
    return 0


def _client(settings: Settings, url: str | None) -> Any:
    from api.client import RolloutClient

    return RolloutClient(url or settings.url, token=settings.api_token)


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    from rich.console import Console

    from api.client import RolloutServiceError
    from deploy.submit import (
        SubmitInputError,
        read_tasks_numbered,
        render_summary,
        submit_and_collect,
    )

    console = Console(stderr=True)
    try:
        tasks, lines = read_tasks_numbered(args.tasks)
    except (SubmitInputError, OSError) as exc:
        console.print(f"rollserve submit: {exc}", style="red", soft_wrap=True, markup=False)
        return 2
    sampling = {k: v for k, v in _sampling_args(args).items() if v is not None}
    agent = {"max_turns": args.max_turns} if args.max_turns else None
    try:
        with _client(settings, args.url) as client:
            summary = submit_and_collect(
                client, tasks, group_size=args.group_size, out=args.out,
                sampling=sampling or None, agent=agent, console=console,
                line_numbers=lines, source=str(args.tasks),
            )  # fmt: skip
    except (RolloutServiceError, SubmitInputError) as exc:
        console.print(f"rollserve submit: {exc}", style="red", soft_wrap=True, markup=False)
        return 1
    render_summary(summary, Console())
    return 0


def _sampling_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from rich.console import Console

    from api.client import RolloutServiceError
    from deploy.submit import render_status

    try:
        with _client(settings, args.url) as client:
            render_status(client.stats(), client.list_backends(), Console())
    except RolloutServiceError as exc:
        print(f"rollserve status: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from rich.console import Console

    from api.client import RolloutClient
    from broker.embedded import redact_url
    from broker.processes import free_port
    from deploy.stack import DevBackendOptions, Stack, StackOptions
    from deploy.submit import read_tasks, render_summary, submit_and_collect

    for path in (args.tasks, args.script):
        if not path.exists():
            print(
                f"rollserve demo: {path} not found (run it from the repository root)",
                file=sys.stderr,
            )
            return 2
    tasks = read_tasks(args.tasks)
    console = Console()
    options = StackOptions(
        dev_backend=DevBackendOptions(script=args.script),
        gateway_port=args.port or free_port(),
    )
    console.print(
        f"[bold]rollserve demo[/bold]: {len(tasks)} tasks x {args.group_size} samples through "
        "init → run → eval on an embedded Redis, the development inference server (scripted "
        "completions scored by a tiny random Qwen3) and one prefork worker per queue"
    )
    _stop_on_sigterm_as_interrupt()
    with Stack(settings, options) as stack:
        console.print(f"gateway {stack.gateway_url}, redis {redact_url(stack.redis_url)}")
        with RolloutClient(stack.gateway_url, token=settings.api_token) as client:
            summary = submit_and_collect(
                client, tasks, group_size=args.group_size, out=args.out,
                sampling={"temperature": 1.0, "seed": 0, "max_tokens": 256},
                agent={"max_turns": 3}, console=console,
            )  # fmt: skip
    render_summary(summary, console)
    console.print(f"trajectories written to [bold]{args.out}[/bold]")
    return 0


def _stop_on_sigterm_as_interrupt() -> None:
    def handler(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def cmd_dev_backend(argv: list[str]) -> int:
    from routing.devserver.cli import main as dev_main

    return dev_main(argv)


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollserve", description="Rollout-as-a-service for RL of multi-turn LLM agents."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the whole stack on this machine (Ctrl-C stops it)")
    up.add_argument("--port", type=int, default=None, help="gateway port (ROLLSERVE_PORT)")
    up.add_argument(
        "--backend",
        type=_parse_backend,
        action="append",
        metavar="URL=MODEL",
        help="register a real vLLM server (repeatable); no dev backend then",
    )
    up.add_argument("--dev-backend", action="store_true", help="also start the development server")
    up.add_argument(
        "--run-jobs",
        type=int,
        default=None,
        metavar="N",
        help="one RUN worker holding up to N jobs on an event loop (instead of prefork)",
    )
    up.add_argument(
        "--engine",
        choices=ENGINES,
        default="dev",
        help="the inference server to start: the development server (default), or a real vLLM "
        "from its own virtualenv (`make vllm`; a minute or two to start on a CPU)",
    )
    up.add_argument(
        "--model", type=Path, default=None, help="model dir to serve (default: the tiny model)"
    )
    up.add_argument("--script", type=Path, default=None, help="scripted completions (JSONL)")
    for queue in QUEUES:
        up.add_argument(f"--{queue}-workers", type=int, default=1, metavar="N",
                        help=f"prefork processes on the {queue} queue")  # fmt: skip
    up.add_argument(
        "--flower",
        action="store_true",
        help="start Flower too (behind basic auth rollserve:<ROLLSERVE_API_TOKEN> when set)",
    )
    up.add_argument("--flower-port", type=int, default=5555)
    up.add_argument(
        "--flower-address",
        default="127.0.0.1",
        help="interface Flower binds; other than loopback only with ROLLSERVE_API_TOKEN set",
    )

    worker = sub.add_parser("worker", help="a Celery worker on one queue")
    worker.add_argument("queue", choices=QUEUES)
    worker.add_argument("--concurrency", type=int, default=None)
    worker.add_argument("--autoscale", default=None, metavar="MAX,MIN")
    worker.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="RUN only: hold up to N jobs in this one process, their agent loops on one "
        "event loop (instead of one prefork process per job)",
    )
    worker.add_argument(
        "--node-only",
        action="store_true",
        help="RUN and EVAL only: consume this node's queue (QUEUE.<ROLLSERVE_NODE_NAME>, the "
        "jobs whose sandbox INIT started here) and not the shared one",
    )
    worker.add_argument(
        "--hostname", default=None, help="Celery node name (default QUEUE-PID@host)"
    )
    worker.add_argument("--loglevel", default="INFO")

    autoscale = sub.add_parser(
        "autoscale", help="size the worker fleets from their queues (local, Slurm, Kubernetes)"
    )
    from deploy.autoscale.command import add_arguments as add_autoscale_arguments

    add_autoscale_arguments(autoscale)

    gateway = sub.add_parser("gateway", help="the REST gateway alone")
    gateway.add_argument("--host", default=None)
    gateway.add_argument("--port", type=int, default=None)

    submit = sub.add_parser("submit", help="submit a JSONL file of tasks as one batch")
    submit.add_argument("tasks", type=Path)
    submit.add_argument("--group-size", type=int, default=1)
    submit.add_argument("--out", type=Path, required=True)
    submit.add_argument("--temperature", type=float, default=None)
    submit.add_argument("--top-p", type=float, default=None)
    submit.add_argument("--max-tokens", type=int, default=None)
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--max-turns", type=int, default=None)
    submit.add_argument("--url", default=None, help="gateway URL (default ROLLSERVE_URL)")

    status = sub.add_parser("status", help="queues, workers, backends and throughput")
    status.add_argument("--url", default=None)

    sub.add_parser("dev-backend", help="the development inference server (vLLM's API on CPU)",
                   add_help=False)  # fmt: skip

    demo = sub.add_parser("demo", help="run the shipped examples end to end")
    demo.add_argument("--tasks", type=Path, default=Path("examples/demo_tasks.jsonl"))
    demo.add_argument("--script", type=Path, default=Path("examples/demo_script.jsonl"))
    demo.add_argument("--group-size", type=int, default=4)
    demo.add_argument("--out", type=Path, default=Path("results/demo.jsonl"))
    demo.add_argument("--port", type=int, default=None)
    return parser


COMMANDS = {
    "up": cmd_up,
    "worker": cmd_worker,
    "autoscale": cmd_autoscale,
    "gateway": cmd_gateway,
    "submit": cmd_submit,
    "status": cmd_status,
    "demo": cmd_demo,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "dev-backend":
        return cmd_dev_backend(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        settings = get_settings()
    except ValueError as exc:
        print(f"rollserve: bad configuration: {exc}", file=sys.stderr)
        return 2
    return COMMANDS[args.command](args, settings)


if __name__ == "__main__":
    sys.exit(main())
