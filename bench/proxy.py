"""The harness endpoint's cost: a job's model call through its OpenAI-compatible endpoint,
against the same call made directly with the worker's inference client.

Measured in one run, on this machine, against the development server in its fast scripted
mode (`--unscored`: scripted answers, no model run, so the engine's own time is small and
stable) registered as the one backend of a real `BackendPool` in an embedded Redis:

- per-call overhead of the endpoint with 1, 100 and 500 jobs in flight (`--quick`: 1, 20 and
  100). Each job is what RUN makes for a harness job, in this process: a real
  `HarnessSession` over a real `RoutedPolicy` (`offload=True`, as on a `--jobs N` worker:
  routing's Redis round trips are made on threads), its trajectory saved to the job store
  after each call as RUN saves it, and its own app (`make_app`) on its own Unix socket
  (`serve_unix`). The harness side runs in processes of their own, as harnesses do: each job
  makes several calls, each sending the whole history back (the assistant reply as returned,
  then a tool result, or a user message after a reply without tool calls), waiting between
  its calls as a harness running a tool does, `level / --rate` seconds on average, so every
  level runs at the same moderate load and differs in the jobs in flight. Three arms run side
  by side at each level, each from a process of its own, so that whatever else loads this
  shared machine loads them alike: the endpoint driven by a plain aiohttp client posting Chat
  Completions (the headline: it does what the worker's own engine client does, so the
  client's cost cancels against the direct arm), the endpoint driven by the official `openai`
  SDK's async client (its own CPU per call is about the endpoint's; reported beside), and the
  direct arm: exactly the engine requests the endpoint made for the same jobs (the same prompt
  ids, `max_tokens` and sampling, recorded beforehand), with the same waits, made with
  `VLLMClient.complete` (`routing.clients.make_client`). Overhead = endpoint latency (as the
  harness sees it) - direct latency, per percentile; the ratio is endpoint / direct.
- where an endpoint call's time goes (p50 and mean of each part): the engine call, the
  engine's `/tokenize` (the new messages rendered into ids by the model's template) and
  `/detokenize` round trips, routing's Redis calls (timed on their threads), the rest of the
  session's work (thread hops, planning, parsing, the trajectory's copy and save) and what
  lies outside the session (HTTP over the socket, the app, JSON, the client library).
- `cpu_ms_per_call`: this process's CPU time (the endpoint side, threads included) per
  endpoint call, minus the direct process's per direct call, at 100 jobs; each harness
  process's CPU per call is reported for its client library.
- saturated: 100 jobs in flight calling back to back, through the endpoint (aiohttp), then
  directly, each alone (this is the pass that records the requests the direct arms replay):
  the latencies are queueing there, and the figures are calls per second and CPU per call.
- `differing_ids`: over every endpoint call, the generated ids that differ between what the
  engine returned (read from the raw `/v1/completions` answers at the engine client) and what
  the job's trajectory recorded (`builder.fill` → `core.flatten.sequences`, the ids under
  loss mask 1 of every segment), lengths included.
- mini-swe-agent (from `.harness-venv`, `make harness-env`) run unmodified with its `mini`
  command outside any sandbox on a few small tasks in temporary directories, against a job's
  endpoint on TCP (`serve_tcp`; `OPENAI_BASE_URL`, `OPENAI_API_KEY`, litellm's model
  `openai/<name>`), in both of its action formats (tool calls, `mini.yaml`; one
  ```mswea_bash_command block, `mini_textbased.yaml`), the development server answering from
  its script: three bash actions, then the submit command. Recorded: segments per job and why
  each began (`core.schemas.SEGMENT_REASONS`), and whether the task's check passed. Without
  `.harness-venv` these figures are null and `notes` says why.

    .venv/bin/python bench/proxy.py [--quick] [--levels 1,100,500] [--rate CALLS_PER_S]
        [--figure PATH] [--model DIR]

The last line printed is one JSON object with every figure and the conditions (the machine's
load average among them: others share it); the figure (`--figure PATH`, default
bench/figures/proxy.png) shows latency and overhead by jobs in flight, and where an endpoint
call's time goes.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this directory would come first on sys.path, and bench/routing.py beside
# this script would shadow the `routing` package: the repository comes first instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import contextlib
import contextvars
import dataclasses
import gc
import hmac
import json
import os
import platform
import random
import secrets
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import httpx
import redis
from aiohttp import web

from bench.support.devserver import devserver_env
from bench.support.plot import add_figure_option, write_figure
from bench.support.report import print_json
from broker.connections import redis_client
from broker.embedded import EmbeddedRedis
from broker.jobstore import JobStore
from broker.jobstore.model import JobSpec
from broker.processes import die_with_parent, free_port, spawn, stop_group
from broker.resultstore.directory import DirectoryResults
from core.flatten import sequences
from core.schemas import TERMINAL_STATUSES, Backend, BackendSpec, Trajectory
from core.settings import get_settings
from routing.chat import ChatTemplater
from routing.clients import make_client
from routing.devserver.tiny import make_tiny_model
from routing.pool import BackendPool, Route
from routing.protocol import InferenceClient
from workers.agent import Limits
from workers.harness.server import make_app, serve_tcp, serve_unix, stop_server
from workers.harness.session import HarnessSession
from workers.harness.toolparsers import get_parser
from workers.harness.wire import ChatRequest, ChatResult
from workers.routed_policy import RoutedPolicy
from workers.trajectory import TrajectoryBuilder

REPO = Path(__file__).resolve().parent.parent
SERVED = "proxy-bench"
"""The development server's model name (litellm's model is `openai/proxy-bench`)."""
START_TIMEOUT = 180.0
DRIVE_TIMEOUT = 900.0
"""Seconds the harness process may take for one arm."""
MINI_TIMEOUT = 240.0
MINI_STEP_LIMIT = 12
HARNESS_VENV = REPO / ".harness-venv"
HARNESS_STAMP = HARNESS_VENV / ".installed-stamp"
FINAL = [status.value for status in TERMINAL_STATUSES]


@dataclass(frozen=True)
class Sizes:
    levels: tuple[int, ...]
    """Jobs in flight at each level."""
    calls_per_job: int
    min_jobs: int
    """Jobs run at a level: at least this many, each lane running its jobs one after another
    (so that one job in flight still gives enough calls for a p99)."""
    max_tokens: int
    mini_tasks: int
    """mini-swe-agent tasks run in each of its two action formats."""
    rate: float = 30.0
    """Model calls per second each arm's jobs offer together: between its calls a job waits
    (its harness running a tool) `level / rate` seconds on average, so that every level runs
    at the same moderate load (the three arms together keep about a third of this 2-core
    machine busy) and differs in the jobs in flight; a saturated machine is measured apart."""

    @property
    def headline(self) -> int:
        return HEADLINE_LEVEL if HEADLINE_LEVEL in self.levels else max(self.levels)


FULL = Sizes(levels=(1, 100, 500), calls_per_job=6, min_jobs=40, max_tokens=64, mini_tasks=3)
QUICK = Sizes(levels=(1, 20, 100), calls_per_job=3, min_jobs=20, max_tokens=64, mini_tasks=1)
HEADLINE_LEVEL = 100
"""The level `proxy_overhead_p50_ms`, `cpu_ms_per_call` and the saturated run are read at (the
largest level when `--levels` leaves it out)."""
CLIENTS = ("aiohttp", "openai_sdk")
HEADLINE_CLIENT = "aiohttp"
"""The harness client of the headline figures: the endpoint's overhead net of the client
library (the openai SDK's own CPU per call is about the endpoint's; both are reported)."""


# ----------------------------------------------------------------------------- the script

BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command"}},
            "required": ["command"],
        },
    },
}
BENCH_MATCH = "PROXY-BENCH"


def tool_call(command: str) -> str:
    """A bash tool call as Qwen-family models write it (the endpoint's hermes parser)."""
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<tool_call>\n{call}\n</tool_call>"


def bench_turn(k: int) -> str:
    """The engine's answer to a bench job's call `k`: mostly a bash tool call, every third a
    plain reply (the harness then sends a user message, not a tool result)."""
    if k % 3 == 2:
        return f"Module {k} looks right to me; the failure must come from somewhere else."
    return f"Let me read module {k} next.\n{tool_call(f'sed -n 1,40p src/module_{k}.py')}"


def first_messages(index: int) -> list[dict[str, Any]]:
    return [
        {
            "role": "system",
            "content": "You are a careful software engineer working in a repository. Use the "
            "bash tool to read and change files, one command at a time; keep answers short.",
        },
        {
            "role": "user",
            "content": f"{BENCH_MATCH} job {index}: the tests of package pkg{index} fail since "
            "the last refactor. Find the cause and fix it.",
        },
    ]


def observation(job: int, call: int) -> str:
    """What the harness sends back after call `call` of job `job` (a file's lines)."""
    return "\n".join(
        f"{n:4d}  def step_{job}_{call}_{n}(value):  return value + {n}  # see issue {job * 7 + n}"
        for n in range(8)
    )


@dataclass(frozen=True)
class MiniTask:
    name: str
    files: dict[str, str]
    instruction: str
    steps: list[tuple[str, str]]
    """(thought, command) per turn; the submit command follows."""
    check: str
    """A bash command that succeeds when the task is done."""


SUBMIT = ("The change is checked; submitting.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
MINI_TASKS = [
    MiniTask(
        "greeting",
        {"hello.py": 'print("Helo, world")\n'},
        "hello.py greets with a typo in it. Fix the typo.",
        [
            ("Let me look at the script first.", "cat hello.py"),
            ("The greeting misspells Hello; fixing it.", "sed -i 's/Helo/Hello/' hello.py"),
            ("Now check what it prints.", "python3 hello.py"),
        ],
        'test "$(python3 hello.py)" = "Hello, world"',
    ),
    MiniTask(
        "adder",
        {"add.py": "def add(a, b):\n    return a - b\n"},
        "add(2, 3) in add.py does not return 5. Fix the function.",
        [
            ("Read the function.", "cat add.py"),
            ("It subtracts instead of adding.", "sed -i 's/a - b/a + b/' add.py"),
            ("Check the fix.", "python3 -c 'from add import add; print(add(2, 3))'"),
        ],
        "python3 -c 'from add import add; assert add(2, 3) == 5'",
    ),
    MiniTask(
        "count",
        {"notes.txt": "alpha\nbeta\ngamma\ndelta\n"},
        "Write the number of lines of notes.txt into count.txt.",
        [
            ("Count the lines first.", "wc -l < notes.txt"),
            ("Write the count.", "wc -l < notes.txt > count.txt"),
            ("Check the file.", "cat count.txt"),
        ],
        'test "$(cat count.txt)" = 4',
    ),
]
MINI_FORMATS = ("toolcall", "text")


def mini_match(task: MiniTask, actions: str) -> str:
    return f"PROXY-MINI-{task.name.upper()}-{actions.upper()}"


def mini_turn(thought: str, command: str, actions: str) -> str:
    """One answer in mini-swe-agent's format: a hermes tool call the endpoint parses into
    `tool_calls`, or the text-based format's one bash block."""
    if actions == "toolcall":
        return f"THOUGHT: {thought}\n\n{tool_call(command)}"
    return f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```"


def script(sizes: Sizes) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = [
        {"match": BENCH_MATCH, "samples": [[bench_turn(k) for k in range(sizes.calls_per_job)]]}
    ]
    for task in MINI_TASKS:
        for actions in MINI_FORMATS:
            turns = [mini_turn(t, c, actions) for t, c in [*task.steps, SUBMIT]]
            entries.append({"match": mini_match(task, actions), "samples": [turns]})
    return entries


# ----------------------------------------------------------------------------- instruments

PARTS: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "proxy_bench_parts", default=None
)
"""The parts of the endpoint call in progress (set per call by `TimedEndpoint`)."""


def charge(part: str, seconds: float) -> None:
    parts = PARTS.get()
    if parts is not None:
        parts[part] = parts.get(part, 0.0) + seconds


class EngineTap:
    """Sits on the engine client's requests: every `/v1/completions` body sent and the
    `token_ids` of its raw answer, by request id, and the time of each request charged to the
    endpoint call in progress (`engine`, or `tokenizer` for `/tokenize` and `/detokenize`)."""

    def __init__(self, client: Any) -> None:
        self.sent: dict[str, dict[str, Any]] = {}
        self.returned: dict[str, list[int]] = {}
        post = client._post

        async def tapped(
            path: str, body: dict[str, Any], *, headers: dict[str, str] | None = None
        ) -> dict[str, Any]:
            started = time.perf_counter()
            data: dict[str, Any] = await post(path, body, headers=headers)
            charge(
                "engine" if path == "/v1/completions" else "tokenizer",
                time.perf_counter() - started,
            )
            if path == "/v1/completions":
                request_id = str(body.get("request_id"))
                self.sent[request_id] = dict(body)
                self.returned[request_id] = [int(i) for i in data["choices"][0]["token_ids"]]
            return data

        setattr(client, "_post", tapped)  # noqa: B010  (an instance attribute over the method)

    def of_job(self, job_id: str) -> list[str]:
        """The request ids of a job's engine calls, in order (`RoutedPolicy` names them
        `<job id>-<n>`)."""
        ids = [r for r in self.sent if r.rsplit("-", 1)[0] == job_id]
        return sorted(ids, key=lambda r: int(r.rsplit("-", 1)[1]))


class TimedPool(BackendPool):
    """The backend pool, each Redis call of routing timed on the thread that makes it."""

    def route(self, job_id: str, job_key: str | None = None, final: Iterable[str] = ()) -> Route:
        started = time.perf_counter()
        try:
            return super().route(job_id, job_key, final)
        finally:
            charge("routing", time.perf_counter() - started)

    def get(self, backend_id: str) -> Backend | None:
        started = time.perf_counter()
        try:
            return super().get(backend_id)
        finally:
            charge("routing", time.perf_counter() - started)

    def request_done(self, job_id: str) -> bool:
        started = time.perf_counter()
        try:
            return super().request_done(job_id)
        finally:
            charge("routing", time.perf_counter() - started)


class TimedEndpoint:
    """A job's `HarnessSession` as its app serves it, each call's time and parts recorded."""

    def __init__(self, session: HarnessSession) -> None:
        self.session = session
        self.calls: list[dict[str, float]] = []

    @property
    def model(self) -> str:
        return self.session.model

    async def generate(self, request: ChatRequest) -> ChatResult:
        parts: dict[str, float] = {}
        token = PARTS.set(parts)
        started = time.perf_counter()
        try:
            return await self.session.generate(request)
        finally:
            parts["generate"] = time.perf_counter() - started
            PARTS.reset(token)
            self.calls.append(parts)


# ----------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    """The development server, Redis, the pool and store, and the worker's engine client."""

    work: Path
    url: str
    pool: TimedPool
    store: JobStore
    engine: InferenceClient
    templater: ChatTemplater
    tap: EngineTap

    def clients_of(self, _backend: Backend) -> tuple[Any, ChatTemplater]:
        return self.engine, self.templater


def wait_served(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the development server exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the development server did not serve within {START_TIMEOUT:g}s")
        time.sleep(0.1)


@contextlib.contextmanager
def rig(work: Path, model_dir: Path, sizes: Sizes) -> Iterator[Rig]:
    """Everything the arms share, started; stopped (no process left) on the way out."""
    with contextlib.ExitStack() as stack:
        home = work / "devserver"
        (home / "tmp").mkdir(parents=True)
        script_path = home / "script.jsonl"
        script_path.write_text("".join(json.dumps(e) + "\n" for e in script(sizes)))
        port, max_model_len = free_port(), 8192
        argv = [sys.executable, "-m", "routing.devserver", "--model", str(model_dir)]
        argv += ["--port", str(port), "--served-model-name", SERVED, "--script", str(script_path)]
        argv += ["--unscored", "--max-model-len", str(max_model_len)]
        env = devserver_env(home)
        log = home / "server.log"
        server = spawn(argv, env=env, cwd=str(REPO), log_path=str(log))
        stack.callback(stop_group, server)
        url = f"http://127.0.0.1:{port}"
        valkey = EmbeddedRedis(work / "redis")
        stack.callback(valkey.stop)
        redis_url = valkey.start()
        wait_served(url, server, log)
        client: redis.Redis = redis_client(redis_url, 5.0)
        stack.callback(client.close)
        settings = get_settings()
        prefix = "proxy:"
        pool = TimedPool(client, prefix, settings.health_failures)
        pool.register(BackendSpec(url=url, model=SERVED), max_model_len=max_model_len)
        results = DirectoryResults(work / "results", settings.results_keep)
        store = JobStore(client, prefix, results=results, stub_ttl=settings.results_stub_ttl)
        engine = make_client(
            "vllm",
            "completions",
            url,
            SERVED,
            timeout=settings.backend_timeout,
            retries=settings.backend_retries,
        )
        tap = EngineTap(engine)
        yield Rig(work, url, pool, store, engine, ChatTemplater(engine), tap)


# ----------------------------------------------------------------------------- jobs


@dataclass
class EndpointJob:
    index: int
    job_id: str
    key: str
    address: str
    """The app's Unix socket path, or `host:port`."""
    endpoint: TimedEndpoint
    runner: web.AppRunner
    trajectory: Trajectory


async def open_job(
    rig: Rig, tag: str, index: int, limits: Limits, socket_path: Path | None
) -> EndpointJob:
    """A job as RUN makes it for a harness: its record, routed policy and session (its
    trajectory saved after each call), and its app serving on `socket_path` (TCP when None)."""
    job_id = f"{tag}-{index}-{secrets.token_hex(4)}"
    spec = JobSpec(
        task={"instance": f"{tag}-{index}"},
        data_source="proxy",
        instance_id=f"{tag}-{index}",
        sampling={},
        agent={},
        group_id=job_id,
        job_id=job_id,
    )
    rig.store.create_jobs([spec])
    trajectory = rig.store.skeleton(rig.store.get(job_id))
    routed = RoutedPolicy(
        rig.pool,
        job_id,
        rig.clients_of,
        job_key=rig.store.job_key(job_id),
        final=FINAL,
        offload=True,
    )

    def save(builder: TrajectoryBuilder) -> Awaitable[bool]:
        builder.fill(trajectory)
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, rig.store.save_partial, job_id, trajectory)

    session = HarnessSession(
        job_id, routed, limits, get_parser("hermes"), model=SERVED, on_turn=save
    )
    endpoint = TimedEndpoint(session)
    key = secrets.token_urlsafe(32)

    async def find(given: str) -> TimedEndpoint | None:
        return endpoint if hmac.compare_digest(given.encode(), key.encode()) else None

    app = make_app(find)
    if socket_path is not None:
        runner = await serve_unix(app, str(socket_path))
        address = str(socket_path)
    else:
        runner = await serve_tcp(app, "127.0.0.1", 0)
        host, port = runner.addresses[0][:2]
        address = f"{host}:{port}"
    return EndpointJob(index, job_id, key, address, endpoint, runner, trajectory)


async def close_job(rig: Rig, job: EndpointJob) -> None:
    """Stop the job's app, let its last save land, give back its backend, fill its record."""
    await stop_server(job.runner)
    session = job.endpoint.session
    await session.flush()
    rig.pool.release(job.job_id)
    if session.builder is not None:
        session.builder.fill(job.trajectory)


def recorded_outputs(trajectory: Trajectory) -> list[int]:
    """The generated ids of the trajectory as a trainer reads them: every segment's ids
    under loss mask 1, in order."""
    out: list[int] = []
    for segment in sequences(trajectory):
        out += [i for i, mask in zip(segment.response_ids, segment.loss_mask, strict=True) if mask]
    return out


def differing(a: list[int], b: list[int]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))


def check_ids(rig: Rig, job: EndpointJob) -> tuple[int, int]:
    """(ids differing between the engine's answers and the record, ids the engine returned)."""
    returned = [i for r in rig.tap.of_job(job.job_id) for i in rig.tap.returned[r]]
    return differing(returned, recorded_outputs(job.trajectory)), len(returned)


# ----------------------------------------------------------------------------- helper processes
# The harness side (one process per client library) and the direct arm run in processes of
# their own (`serve_helper`), so that the arms of a level run side by side, under the same load
# from whatever else shares the machine, and each process's CPU time is its own arm's.


async def in_lanes(count: int, level: int, run_job: Callable[[int], Awaitable[None]]) -> None:
    """Jobs 0..count-1 with `level` in flight: lane i runs jobs i, i + level, ... in turn."""

    async def lane(first: int) -> None:
        for j in range(first, count, level):
            await run_job(j)

    await asyncio.gather(*(lane(i) for i in range(min(level, count))))


def pauses(job: int, calls: int, think: float) -> list[float]:
    """Seconds job `job` waits before each of its calls: a start spread over one think time,
    then a think time each, drawn around `think` (the same draws in every arm)."""
    draw = random.Random(job)
    return [draw.uniform(0.0, think)] + [draw.uniform(0.5, 1.5) * think for _ in range(calls - 1)]


def continue_history(messages: list[dict[str, Any]], reply: dict[str, Any], text: str) -> None:
    """Append the reply as it came back, then a tool result per tool call (a user message
    when it made none), as a harness does."""
    messages.append(reply)
    calls = reply.get("tool_calls") or []
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})
    if not calls:
        messages.append({"role": "user", "content": text})


async def serve_helper() -> None:
    """A helper process: runs the arm of each spec file named on stdin, until stdin closes."""
    engines: dict[str, Any] = {}
    try:
        while line := (await asyncio.to_thread(sys.stdin.readline)).strip():
            spec = json.loads(Path(line).read_text())
            if spec["client"] == "direct":
                await replay_arm(spec, engines)
            else:
                await drive_arm(spec)
    finally:
        for engine in engines.values():
            await engine.aclose()


async def on_go(spec: dict[str, Any], run: Callable[[], Awaitable[list[list[float]]]]) -> None:
    """Print `ready`, start `run` on `go` (stdin), write its latencies (per job, seconds) and
    errors with this process's CPU and wall seconds over it to the spec's `out`, print `done`."""
    errors: list[str] = spec.setdefault("errors", [])
    gc.collect()
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    cpu, wall = time.process_time(), time.perf_counter()
    latencies = await run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    out = {"latencies": latencies, "errors": errors, "cpu_s": cpu, "wall_s": wall}
    Path(spec["out"]).write_text(json.dumps(out))
    print("done", flush=True)


async def drive_arm(spec: dict[str, Any]) -> None:
    """The harness side: every job of the spec through its endpoint, timed per call."""
    import aiohttp
    import httpx2  # the openai SDK's own HTTP library
    import openai

    jobs: list[dict[str, Any]] = spec["jobs"]
    plain = spec["client"] == "aiohttp"
    latencies: list[list[float]] = [[] for _ in jobs]
    sessions: list[aiohttp.ClientSession] = []
    sdks: list[openai.AsyncOpenAI] = []
    for job in jobs:
        if plain:
            connector = aiohttp.UnixConnector(path=job["socket"])
            sessions.append(aiohttp.ClientSession(connector=connector))
        else:
            transport = httpx2.AsyncHTTPTransport(uds=job["socket"])
            http = httpx2.AsyncClient(transport=transport, timeout=DRIVE_TIMEOUT)
            sdks.append(
                openai.AsyncOpenAI(
                    base_url="http://job/v1", api_key=job["key"], http_client=http, max_retries=0
                )
            )

    async def call(j: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
        if plain:
            body = {
                "model": SERVED,
                "messages": messages,
                "tools": [BASH_TOOL],
                "max_tokens": spec["max_tokens"],
            }
            headers = {"Authorization": f"Bearer {jobs[j]['key']}"}
            async with sessions[j].post(
                "http://job/v1/chat/completions", json=body, headers=headers
            ) as answer:
                data = await answer.json()
                if answer.status != 200:
                    raise RuntimeError(f"{answer.status}: {data}")
            reply: dict[str, Any] = data["choices"][0]["message"]
            return reply
        completion = await sdks[j].chat.completions.create(
            model=SERVED,
            messages=messages,  # type: ignore[arg-type]
            tools=[BASH_TOOL],  # type: ignore[list-item]
            max_tokens=spec["max_tokens"],
        )
        return completion.choices[0].message.model_dump(exclude_none=True)

    async def run_job(j: int) -> None:
        messages = list(jobs[j]["messages"])
        waits = pauses(jobs[j]["index"], spec["calls"], spec["think"])
        for k in range(spec["calls"]):
            await asyncio.sleep(waits[k])
            started = time.perf_counter()
            try:
                reply = await call(j, messages)
            except Exception as exc:
                spec["errors"].append(f"job {j} call {k}: {type(exc).__name__}: {exc}"[:500])
                return
            latencies[j].append(time.perf_counter() - started)
            continue_history(messages, reply, observation(jobs[j]["index"], k))

    async def run() -> list[list[float]]:
        await in_lanes(len(jobs), spec["level"], run_job)
        return latencies

    try:
        await on_go(spec, run)
    finally:
        for session in sessions:
            await session.close()
        for sdk in sdks:
            await sdk.close()


async def replay_arm(spec: dict[str, Any], engines: dict[str, Any]) -> None:
    """The direct arm: the engine requests of `bodies` (per job, in order) made with the
    worker's client (kept, warm, across arms), each job waiting as in the endpoint arms."""
    engine = engines.get(spec["url"])
    if engine is None:
        engine = engines[spec["url"]] = make_client(
            "vllm", "completions", spec["url"], SERVED,
            timeout=spec["timeout"], retries=spec["retries"],
        )  # fmt: skip
        await engine.max_model_len()  # asked once, as the worker's client has it
    bodies: list[list[dict[str, Any]]] = spec["bodies"]
    latencies: list[list[float]] = [[] for _ in bodies]

    async def run_job(j: int) -> None:
        waits = pauses(j, len(bodies[j]), spec["think"])
        for k, body in enumerate(bodies[j]):
            await asyncio.sleep(waits[k])
            started = time.perf_counter()
            try:
                await engine.complete(
                    body["prompt"],
                    max_tokens=body["max_tokens"],
                    temperature=body["temperature"],
                    top_p=body["top_p"],
                    seed=body.get("seed"),
                    stop=body.get("stop"),
                    cache_salt=body.get("cache_salt"),
                    request_id=f"direct-{spec['tag']}-{j}-{k}",
                )
            except Exception as exc:
                spec["errors"].append(f"job {j} call {k}: {type(exc).__name__}: {exc}"[:500])
                return
            latencies[j].append(time.perf_counter() - started)

    async def run() -> list[list[float]]:
        await in_lanes(len(bodies), spec["level"], run_job)
        return latencies

    await on_go(spec, run)


class Helper:
    """One helper process (`serve_helper`), as this process drives it."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.out: Path | None = None

    @classmethod
    async def start(cls, name: str, work: Path) -> Helper:
        log_path = work / f"helper-{name}.log"
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(Path(__file__).resolve()),
                "--helper",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                cwd=str(REPO),
                preexec_fn=die_with_parent,
            )
        return cls(name, proc, log_path)

    async def _expect(self, expected: bytes, timeout: float) -> None:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if line.strip() != expected:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"helper {self.name} said {line!r}, not {expected!r}:\n{tail}")

    async def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        await self.proc.stdin.drain()

    async def prepare(self, spec_path: Path, out: Path) -> None:
        """Hand over the arm of `spec_path`; returns once it is ready to start."""
        self.out = out
        await self._send(str(spec_path))
        await self._expect(b"ready", START_TIMEOUT)

    async def go(self) -> None:
        await self._send("go")

    async def finish(self) -> dict[str, Any]:
        """The arm's results, once it is done."""
        await self._expect(b"done", DRIVE_TIMEOUT)
        assert self.out is not None
        result: dict[str, Any] = json.loads(self.out.read_text())
        if result["errors"]:
            raise RuntimeError(
                f"{len(result['errors'])} calls of helper {self.name} failed: {result['errors'][0]}"
            )
        return result

    async def stop(self) -> None:
        """End the process: its stdin closed, it exits; killed (its group) if it does not."""
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()


async def run_together(
    rig: Rig, helpers: dict[str, Helper], specs: dict[str, dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], float, float]:
    """The arms of `specs` (by helper name) run side by side: each one's results, and this
    process's CPU and wall seconds from their start to the end of the last."""
    for name, spec in specs.items():
        spec_path = rig.work / f"{spec['tag']}-{name}.json"
        spec["out"] = str(spec_path.with_suffix(".out.json"))
        spec_path.write_text(json.dumps(spec))
        await helpers[name].prepare(spec_path, Path(spec["out"]))
    gc.collect()  # the garbage of earlier arms is not collected (and charged) in these
    cpu, wall = time.process_time(), time.perf_counter()
    for name in specs:
        await helpers[name].go()
    results = await asyncio.gather(*(helpers[name].finish() for name in specs))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return dict(zip(specs, results, strict=True)), cpu, wall


# ----------------------------------------------------------------------------- the arms


@dataclass
class Arm:
    """One arm at one level: every call's latency (seconds) and its process's CPU."""

    name: str
    level: int
    jobs: int
    latencies: list[float]
    wall_s: float
    helper_cpu_s: float
    """The CPU time of the arm's helper process (its harness client, or the direct calls)."""
    parts: list[dict[str, float]] = field(default_factory=list)
    """Per endpoint call: its parts, in seconds (`PART_NAMES`)."""
    bodies: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per job: the engine requests its calls made, in order."""
    differing_ids: int = 0
    generated_ids: int = 0
    segments: Counter[str] = field(default_factory=Counter)

    @property
    def calls(self) -> int:
        return len(self.latencies)


PART_NAMES = ("engine", "tokenizer", "routing", "session_other", "outside_session")


@dataclass
class Level:
    """The arms of one level, run side by side."""

    level: int
    think: float
    arms: dict[str, Arm]
    endpoint_cpu_s: float
    """This process's CPU time over the endpoint arms (both clients)."""

    @property
    def endpoint_cpu_per_call(self) -> float:
        """This process's CPU per endpoint call minus the direct arm's per direct call."""
        calls = sum(self.arms[c].calls for c in CLIENTS if c in self.arms)
        direct = self.arms["direct"]
        return self.endpoint_cpu_s / calls - direct.helper_cpu_s / direct.calls


def limits_for(sizes: Sizes) -> Limits:
    return Limits(
        max_turns=sizes.calls_per_job + MINI_STEP_LIMIT,
        max_total_tokens=1_000_000,
        max_tokens=sizes.max_tokens,
    )


async def open_jobs(rig: Rig, tag: str, count: int, sizes: Sizes) -> list[EndpointJob]:
    sockets = rig.work / "sockets" / tag
    sockets.mkdir(parents=True)
    limits = limits_for(sizes)
    return [await open_job(rig, tag, i, limits, sockets / f"{i}.sock") for i in range(count)]


def harness_spec(
    tag: str, client: str, jobs: list[EndpointJob], level: int, think: float, sizes: Sizes
) -> dict[str, Any]:
    return {
        "tag": tag,
        "client": client,
        "level": level,
        "think": think,
        "calls": sizes.calls_per_job,
        "max_tokens": sizes.max_tokens,
        "jobs": [
            {
                "index": j.index,
                "socket": j.address,
                "key": j.key,
                "messages": first_messages(j.index),
            }
            for j in jobs
        ],
    }


def direct_spec(
    rig: Rig, tag: str, bodies: list[list[dict[str, Any]]], level: int, think: float
) -> dict[str, Any]:
    settings = get_settings()
    return {
        "tag": tag,
        "client": "direct",
        "level": level,
        "think": think,
        "url": rig.url,
        "timeout": settings.backend_timeout,
        "retries": settings.backend_retries,
        "bodies": bodies,
    }


def endpoint_arm(
    rig: Rig, name: str, level: int, jobs: list[EndpointJob], result: dict[str, Any]
) -> Arm:
    """The arm of closed `jobs`, driven by a harness helper that returned `result`."""
    arm = Arm(name, level, len(jobs), [], result["wall_s"], result["cpu_s"])
    for job, latencies in zip(jobs, result["latencies"], strict=True):
        arm.latencies += latencies
        for latency, parts in zip(latencies, job.endpoint.calls, strict=True):
            arm.parts.append(split(latency, parts))
        arm.bodies.append([rig.tap.sent[r] for r in rig.tap.of_job(job.job_id)])
        wrong, checked = check_ids(rig, job)
        arm.differing_ids += wrong
        arm.generated_ids += checked
        arm.segments.update(s.reason for s in sequences(job.trajectory))
    return arm


def direct_arm(name: str, level: int, result: dict[str, Any]) -> Arm:
    latencies = [x for job in result["latencies"] for x in job]
    return Arm(name, level, len(result["latencies"]), latencies, result["wall_s"], result["cpu_s"])


def split(latency: float, parts: dict[str, float]) -> dict[str, float]:
    """An endpoint call's latency (as the harness saw it) in `PART_NAMES`."""
    engine, tokenizer, routing = (parts.get(p, 0.0) for p in ("engine", "tokenizer", "routing"))
    generate = parts["generate"]
    return {
        "engine": engine,
        "tokenizer": tokenizer,
        "routing": routing,
        "session_other": generate - engine - tokenizer - routing,
        "outside_session": latency - generate,
    }


async def run_endpoint_arms(
    rig: Rig,
    helpers: dict[str, Helper],
    tag: str,
    level: int,
    think: float,
    sizes: Sizes,
    clients: dict[str, int],
    bodies: list[list[dict[str, Any]]] | None = None,
) -> Level:
    """`clients` (name → jobs) each through their endpoints, and, given `bodies`, the direct
    arm replaying them, side by side, `level` jobs of each in flight."""
    jobs = {c: await open_jobs(rig, f"{tag}-{c}", n, sizes) for c, n in clients.items()}
    try:
        specs = {c: harness_spec(tag, c, jobs[c], level, think, sizes) for c in clients}
        if bodies is not None:
            specs["direct"] = direct_spec(rig, tag, bodies, level, think)
        results, cpu, _ = await run_together(rig, helpers, specs)
    finally:
        for each in jobs.values():
            for job in each:
                await close_job(rig, job)
    arms = {c: endpoint_arm(rig, c, level, jobs[c], results[c]) for c in clients}
    if bodies is not None:
        arms["direct"] = direct_arm("direct", level, results["direct"])
    return Level(level, think, arms, cpu)


async def run_direct(
    rig: Rig, helpers: dict[str, Helper], tag: str, level: int, bodies: list[list[dict[str, Any]]]
) -> Arm:
    """The direct arm alone, its jobs calling back to back."""
    results, _, _ = await run_together(
        rig, helpers, {"direct": direct_spec(rig, tag, bodies, level, 0.0)}
    )
    return direct_arm("direct", level, results["direct"])


@dataclass
class Saturated:
    """The headline level's jobs calling back to back, each arm alone."""

    endpoint: Level
    direct: Arm

    def figures(self) -> dict[str, Any]:
        arm, direct = self.endpoint.arms["aiohttp"], self.direct
        ours, base = arm.calls / arm.wall_s, direct.calls / direct.wall_s
        endpoint_cpu = self.endpoint.endpoint_cpu_s / arm.calls
        return {
            "jobs_in_flight": arm.level,
            "calls": arm.calls,
            "client": "aiohttp",
            "direct_calls_per_s": round(base, 1),
            "endpoint_calls_per_s": round(ours, 1),
            "throughput_ratio": round(ours / base, 3),
            "direct_p50_ms": ms(percentile(direct.latencies, 0.5)),
            "endpoint_p50_ms": ms(percentile(arm.latencies, 0.5)),
            "endpoint_cpu_ms_per_call": ms(endpoint_cpu - direct.helper_cpu_s / direct.calls),
        }


async def record(rig: Rig, helpers: dict[str, Helper], sizes: Sizes) -> Saturated:
    """Every job any level runs, through its endpoint with the headline level's jobs in flight
    and no wait between calls (their engine requests are what the direct arms replay), then
    the same requests made directly: the saturated figures."""
    count = max(max(level, sizes.min_jobs) for level in sizes.levels)
    level = sizes.headline
    endpoint = await run_endpoint_arms(
        rig, helpers, "saturated", level, 0.0, sizes, {"aiohttp": count}
    )
    direct = await run_direct(rig, helpers, "saturated", level, endpoint.arms["aiohttp"].bodies)
    return Saturated(endpoint, direct)


async def measure_level(
    rig: Rig, helpers: dict[str, Helper], level: int, sizes: Sizes, recorded: list[list[Any]]
) -> Level:
    count, think = max(level, sizes.min_jobs), level / sizes.rate
    clients = dict.fromkeys(CLIENTS, count)
    return await run_endpoint_arms(
        rig, helpers, f"level-{level}", level, think, sizes, clients, recorded[:count]
    )


# ----------------------------------------------------------------------------- figures


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def latency_figures(arm: Arm) -> dict[str, Any]:
    return {
        "p50_ms": ms(percentile(arm.latencies, 0.5)),
        "p99_ms": ms(percentile(arm.latencies, 0.99)),
        "calls": arm.calls,
        "helper_cpu_ms_per_call": ms(arm.helper_cpu_s / arm.calls),
    }


def overhead(endpoint: Arm, direct: Arm) -> dict[str, Any]:
    """Endpoint minus direct latency per percentile, their ratio, and the endpoint call's
    parts."""
    out: dict[str, Any] = {}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        ours, base = percentile(endpoint.latencies, q), percentile(direct.latencies, q)
        out[f"{name}_ms"] = ms(ours - base)
        out[f"ratio_{name}"] = round(ours / base, 3)
    out["parts_p50_ms"] = {
        part: ms(percentile([p[part] for p in endpoint.parts], 0.5)) for part in PART_NAMES
    }
    out["parts_mean_ms"] = {
        part: ms(statistics.fmean(p[part] for p in endpoint.parts)) for part in PART_NAMES
    }
    return out


def requests_differing(arm: Arm, recorded: list[list[dict[str, Any]]]) -> int:
    """Engine requests of an endpoint arm that differ from the recorded ones (prompt ids or
    max_tokens), missing or extra ones included."""
    key = ("prompt", "max_tokens")
    count = 0
    for ours, theirs in zip(arm.bodies, recorded, strict=False):
        count += abs(len(ours) - len(theirs))
        count += sum(
            [x.get(k) for k in key] != [y.get(k) for k in key]
            for x, y in zip(ours, theirs, strict=False)
        )
    return count


# ----------------------------------------------------------------------------- mini-swe-agent


def harness_missing() -> str | None:
    """Why mini-swe-agent cannot run here, or None."""
    if not HARNESS_STAMP.is_file():
        return f"no harness environment at {HARNESS_VENV} (`make harness-env` has not finished)"
    if not (HARNESS_VENV / "bin" / "mini").is_file():
        return f"{HARNESS_VENV} has no `mini` command"
    return None


def mini_env(address: str, key: str, config_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    env.pop("PYTHONPATH", None)
    env.update(
        OPENAI_BASE_URL=f"http://{address}/v1",
        OPENAI_API_KEY=key,
        MSWEA_CONFIGURED="true",
        MSWEA_SILENT_STARTUP="1",
        MSWEA_COST_TRACKING="ignore_errors",
        MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT="2",
        MSWEA_GLOBAL_CONFIG_DIR=str(config_dir),
        LITELLM_LOCAL_MODEL_COST_MAP="True",
    )
    return env


async def run_mini(
    rig: Rig, task: MiniTask, actions: str, index: int, sizes: Sizes
) -> dict[str, Any]:
    """mini-swe-agent on `task` against a job's endpoint on TCP; what its job recorded."""
    where = rig.work / "mini" / f"{task.name}-{actions}"
    where.mkdir(parents=True)
    for name, text in task.files.items():
        (where / name).write_text(text)
    job = await open_job(rig, "mini", index, limits_for(sizes), None)
    config = "mini.yaml" if actions == "toolcall" else "mini_textbased.yaml"
    argv = [str(HARNESS_VENV / "bin" / "mini"), "-y", "--exit-immediately", "-l", "0"]
    argv += ["-m", f"openai/{SERVED}", "-t", f"{mini_match(task, actions)}: {task.instruction}"]
    argv += ["-o", str(rig.work / "mini" / f"{task.name}-{actions}.traj.json")]
    argv += ["-c", config, "-c", f"agent.step_limit={MINI_STEP_LIMIT}"]
    if actions == "text":
        argv += ["--model-class", "litellm_textbased"]
    log_path = rig.work / "mini" / f"{task.name}-{actions}.log"
    env = mini_env(job.address, job.key, rig.work / "mini" / "config")
    timed_out = False
    try:
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=str(where),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        try:
            await asyncio.wait_for(proc.wait(), MINI_TIMEOUT)
        except TimeoutError:
            timed_out = True
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
    finally:
        await close_job(rig, job)
    traj_path = rig.work / "mini" / f"{task.name}-{actions}.traj.json"
    info: dict[str, Any] = {}
    if traj_path.is_file():
        info = json.loads(traj_path.read_text()).get("info", {})
    segments = sequences(job.trajectory) if job.endpoint.session.builder is not None else []
    wrong, checked = check_ids(rig, job)
    check = subprocess.run(["bash", "-c", task.check], cwd=where, capture_output=True)
    row = {
        "task": task.name,
        "actions": actions,
        "exit_status": info.get("exit_status"),
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "check_passed": check.returncode == 0,
        "endpoint_calls": job.endpoint.session.calls,
        "refused_calls": job.endpoint.session.refused,
        "segments": len(segments),
        "segment_reasons": [s.reason for s in segments],
        "differing_ids": wrong,
        "generated_ids": checked,
    }
    if not row["check_passed"] or row["exit_status"] != "Submitted":
        row["log_tail"] = log_path.read_text(errors="replace")[-1500:]
    return row


async def mini_runs(rig: Rig, sizes: Sizes) -> list[dict[str, Any]]:
    runs = [
        run_mini(rig, task, actions, i * len(MINI_FORMATS) + a, sizes)
        for i, task in enumerate(MINI_TASKS[: sizes.mini_tasks])
        for a, actions in enumerate(MINI_FORMATS)
    ]
    return list(await asyncio.gather(*runs))


# ----------------------------------------------------------------------------- the run


@dataclass
class Outcome:
    levels: dict[int, Level]
    saturated: Saturated
    warm_up: Level
    mini: list[dict[str, Any]] | None
    mini_missing: str | None
    recorded: list[list[dict[str, Any]]]
    phases: dict[str, float]
    """Wall seconds of each part of the run."""
    load_at_start: float
    """The machine's 1-minute load average as the run began (others share it)."""


async def bench(work: Path, model_dir: Path, sizes: Sizes) -> Outcome:
    phases: dict[str, float] = {}
    mark, load = time.perf_counter(), os.getloadavg()[0]

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = round(now - mark, 1)
        mark = now

    with rig(work, model_dir, sizes) as r:
        helpers: dict[str, Helper] = {}
        try:
            for name in (*CLIENTS, "direct"):
                helpers[name] = await Helper.start(name, work)
            # Imports, the template's pieces, the tokenizer's caches and connections warm.
            warm = await run_endpoint_arms(r, helpers, "warm-up", 1, 0.0, sizes, {"aiohttp": 2})
            warm = await run_endpoint_arms(
                r, helpers, "warm-up-2", 1, 0.0, sizes, {"openai_sdk": 2},
                warm.arms["aiohttp"].bodies,
            )  # fmt: skip
            lap("start")
            saturated = await record(r, helpers, sizes)
            recorded = saturated.endpoint.arms["aiohttp"].bodies
            print(describe_saturated(saturated), flush=True)
            lap("saturated")
            levels: dict[int, Level] = {}
            for level in sizes.levels:
                levels[level] = await measure_level(r, helpers, level, sizes, recorded)
                print(describe_level(levels[level]), flush=True)
                lap(f"level_{level}")
            missing = harness_missing()
            mini = None if missing else await mini_runs(r, sizes)
            lap("mini_swe_agent")
            return Outcome(levels, saturated, warm, mini, missing, recorded, phases, load)
        finally:
            for helper in helpers.values():
                await helper.stop()
            await r.engine.aclose()


def client_note(level: Level) -> str:
    """What the openai SDK costs against the endpoint itself, per call, in CPU."""
    sdk, plain = level.arms["openai_sdk"], level.arms["aiohttp"]
    sdk_cpu, plain_cpu = sdk.helper_cpu_s / sdk.calls, plain.helper_cpu_s / plain.calls
    return (
        "headline client: a plain aiohttp client posting Chat Completions, which does what the "
        "worker's own engine client does (so the client's cost cancels against the direct arm) "
        f"and spends {plain_cpu * 1000:.2f} ms of CPU per call at {level.level} jobs; the openai"
        f" SDK spends {sdk_cpu * 1000:.2f} ms, against the endpoint's own "
        f"{level.endpoint_cpu_per_call * 1000:.2f} ms: its figures are reported beside "
        "(`openai_sdk`), its own time included"
    )


def describe_level(level: Level) -> str:
    direct = level.arms["direct"]
    lines = [
        f"{level.level:>4} jobs in flight per arm ({direct.jobs} jobs x "
        f"{direct.calls // direct.jobs} calls, ~{level.think * 1000:.0f} ms between a job's "
        f"calls): direct p50 {percentile(direct.latencies, 0.5) * 1000:7.2f} ms  p99 "
        f"{percentile(direct.latencies, 0.99) * 1000:8.2f} ms; endpoint CPU "
        f"{level.endpoint_cpu_per_call * 1000:.2f} ms/call beyond the direct call's"
    ]
    for client in CLIENTS:
        arm, o = level.arms[client], overhead(level.arms[client], direct)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in o["parts_p50_ms"].items())
        lines.append(
            f"      endpoint ({client:>10}) p50 {percentile(arm.latencies, 0.5) * 1000:7.2f} ms  "
            f"p99 {percentile(arm.latencies, 0.99) * 1000:8.2f} ms  overhead p50 "
            f"{o['p50_ms']:7.2f} ms ({o['ratio_p50']:.2f}x)  p99 {o['p99_ms']:8.2f} ms "
            f"({o['ratio_p99']:.2f}x)  client CPU {arm.helper_cpu_s / arm.calls * 1000:.2f} "
            "ms/call"
        )
        lines.append(f"        parts p50 (ms): {parts}")
    return "\n".join(lines)


def describe_saturated(saturated: Saturated) -> str:
    f = saturated.figures()
    return (
        f"{f['jobs_in_flight']:>4} jobs calling back to back (saturated, {f['calls']} calls): "
        f"direct {f['direct_calls_per_s']} calls/s (p50 {f['direct_p50_ms']:.1f} ms), endpoint "
        f"{f['endpoint_calls_per_s']} calls/s (p50 {f['endpoint_p50_ms']:.1f} ms): "
        f"{f['throughput_ratio']:.2f}x the calls; endpoint CPU "
        f"{f['endpoint_cpu_ms_per_call']:.2f} ms/call beyond the direct call's"
    )


def describe_mini(runs: list[dict[str, Any]]) -> str:
    lines = ["mini-swe-agent against a job's endpoint (TCP):"]
    for run in runs:
        lines.append(
            f"  {run['task']:>9} ({run['actions']:>8}): {run['exit_status']}, check "
            f"{'passed' if run['check_passed'] else 'FAILED'}, {run['endpoint_calls']} calls, "
            f"{run['segments']} segment(s): {', '.join(run['segment_reasons'])}"
        )
    return "\n".join(lines)


def level_entry(level: Level, sizes: Sizes, recorded: list[list[dict[str, Any]]]) -> dict[str, Any]:
    direct = level.arms["direct"]
    entry: dict[str, Any] = {
        "client": HEADLINE_CLIENT,
        **overhead(level.arms[HEADLINE_CLIENT], direct),
        "endpoint_cpu_ms_per_call": ms(level.endpoint_cpu_per_call),
        "jobs": direct.jobs,
        "think_ms_mean": round(level.think * 1000, 1),
        "direct": latency_figures(direct),
    }
    for name in CLIENTS:
        entry[f"endpoint_{name}"] = latency_figures(level.arms[name])
    for name in CLIENTS:
        if name != HEADLINE_CLIENT:
            entry[name] = overhead(level.arms[name], direct)
    entry["requests_differing_from_direct"] = sum(
        requests_differing(level.arms[name], recorded) for name in CLIENTS
    )
    return entry


def results_of(outcome: Outcome, sizes: Sizes, quick: bool, seconds: float) -> dict[str, Any]:
    head = outcome.levels[sizes.headline]
    notes = [client_note(head)]
    by_level = {
        str(level): level_entry(each, sizes, outcome.recorded)
        for level, each in outcome.levels.items()
    }
    endpoint_arms = [
        arm
        for level in (outcome.warm_up, outcome.saturated.endpoint, *outcome.levels.values())
        for name, arm in level.arms.items()
        if name != "direct"
    ]
    differing_ids = sum(a.differing_ids for a in endpoint_arms)
    generated = sum(a.generated_ids for a in endpoint_arms)
    segment_counts: Counter[str] = Counter()
    for arm in endpoint_arms:
        segment_counts.update(arm.segments)
    mini = outcome.mini
    segments_p50: float | None = None
    reasons: dict[str, int] | None = None
    if mini is None:
        notes.append(f"mini-swe-agent not run: {outcome.mini_missing}")
    else:
        differing_ids += sum(r["differing_ids"] for r in mini)
        generated += sum(r["generated_ids"] for r in mini)
        segments_p50 = statistics.median(r["segments"] for r in mini)
        reasons = dict(Counter(reason for r in mini for reason in r["segment_reasons"]))
    if quick:
        notes.append(
            f"--quick: {', '.join(map(str, sizes.levels))} jobs in flight (a full run: "
            f"{', '.join(map(str, FULL.levels))}), {sizes.calls_per_job} calls per job "
            f"({FULL.calls_per_job}), {sizes.mini_tasks} mini-swe-agent task(s) per format "
            f"({FULL.mini_tasks})"
        )
    headline = by_level[str(sizes.headline)]
    return {
        "bench": "proxy",
        "quick": quick,
        "proxy_overhead_by_concurrency": by_level,
        "proxy_overhead_p50_ms": headline["p50_ms"],
        "headline_client": HEADLINE_CLIENT,
        "differing_ids": differing_ids,
        "generated_ids_checked": generated,
        "segments_per_job_p50": segments_p50,
        "segment_reasons": reasons,
        "cpu_ms_per_call": headline["endpoint_cpu_ms_per_call"],
        "client_cpu_ms_per_call": {
            name: headline[f"endpoint_{name}"]["helper_cpu_ms_per_call"] for name in CLIENTS
        },
        "saturated": outcome.saturated.figures(),
        "aims": {
            "overhead_p50_le_2ms_at_100_jobs": headline["p50_ms"] <= 2.0,
            "no_differing_ids": differing_ids == 0,
        },
        "bench_job_segment_reasons": dict(segment_counts),
        "mini_swe_agent": mini,
        "notes": notes,
        "conditions": {
            "levels": list(sizes.levels),
            "jobs_per_level": {str(lv): max(lv, sizes.min_jobs) for lv in sizes.levels},
            "calls_per_job": sizes.calls_per_job,
            "max_tokens": sizes.max_tokens,
            "headline_level": sizes.headline,
            "offered_calls_per_s_per_arm": sizes.rate,
            "between_calls": "each job waits level / offered_calls_per_s_per_arm seconds on "
            "average (uniform 0.5x-1.5x; its first call spread over one such wait) before each "
            "call, its harness running a tool; the same waits in every arm; `saturated`: none",
            "arms": "per level, side by side: the endpoint driven by a plain aiohttp client, "
            "by the openai SDK, and the direct calls, each arm from a process of its own; "
            "`saturated`: the endpoint (aiohttp), then the direct calls, alone",
            "engine": "development server, scripted and unscored (UnscoredScriptEngine), "
            "one backend in a BackendPool on an embedded valkey",
            "endpoint": "this process: one aiohttp app per job on its own Unix socket "
            "(serve_unix), HarnessSession + RoutedPolicy(offload=True), the trajectory saved "
            "to the job store after each call",
            "harness": "openai SDK (AsyncOpenAI over httpx2's Unix transport, max_retries 0) "
            "or a plain aiohttp client (UnixConnector)",
            "direct": "VLLMClient.complete (routing.clients.make_client), replaying the engine "
            "requests the endpoint made for the same jobs",
            "mini_swe_agent": None
            if mini is None
            else {
                "version": package_version_in(HARNESS_VENV, "mini-swe-agent"),
                "tasks": sizes.mini_tasks,
                "action_formats": list(MINI_FORMATS),
                "step_limit": MINI_STEP_LIMIT,
            },
            "python": platform.python_version(),
            "openai": metadata.version("openai"),
            "aiohttp": metadata.version("aiohttp"),
            "cpus": os.cpu_count(),
            "load_average_1min": [round(outcome.load_at_start, 2), round(os.getloadavg()[0], 2)],
        },
        "seconds": round(seconds, 1),
        "seconds_by_phase": outcome.phases,
    }


def package_version_in(venv: Path, name: str) -> str | None:
    """The version of distribution `name` installed in the virtualenv `venv`."""
    pattern = f"python*/site-packages/{name.replace('-', '_')}-*.dist-info"
    found = list((venv / "lib").glob(pattern))
    return metadata.PathDistribution(found[0]).version if found else None


def draw(results: dict[str, Any], path: Path) -> Path | None:
    """Latency by jobs in flight (direct and both endpoint arms, p50 and p99), the endpoint's
    overhead over direct per client, and where the headline client's endpoint call spends the
    time the direct call does not (p50 of each part: a stall of the shared machine would
    swamp the means)."""
    by_level = results["proxy_overhead_by_concurrency"]
    levels = [int(k) for k in by_level]
    ticks = range(len(levels))

    def figure(plt: Any) -> Any:
        fig, (lat, over, parts) = plt.subplots(1, 3, figsize=(15, 4.4))
        arms = [("direct", "direct engine call", "o-", "tab:gray")]
        arms += [
            (f"endpoint_{c}", f"endpoint, {c}", marker, colour)
            for c, marker, colour in zip(
                CLIENTS, ("s-", "^--"), ("tab:blue", "tab:orange"), strict=True
            )
        ]
        for key, label, style, colour in arms:
            for q, alpha in (("p50", 1.0), ("p99", 0.35)):
                values = [by_level[str(lv)][key][f"{q}_ms"] for lv in levels]
                lat.plot(levels, values, style, color=colour, alpha=alpha, label=f"{label} {q}")
        lat.set_xscale("log")
        lat.set_yscale("log")
        lat.set_ylabel("latency per call (ms)")
        lat.set_title("per-call latency")
        width = 0.38
        for i, client in enumerate(CLIENTS):
            p50 = [overhead_of(by_level[str(lv)], client)["p50_ms"] for lv in levels]
            xs = [x + (i - 0.5) * width for x in ticks]
            over.bar(xs, p50, width, label=client, color=("tab:blue", "tab:orange")[i])
            for x, value in zip(xs, p50, strict=True):
                over.annotate(
                    f"{value:.2f}", (x, value), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8,
                )  # fmt: skip
        over.axhline(2.0, color="tab:red", linestyle=":", label="aim: 2 ms at 100 jobs")
        over.set_ylabel("endpoint p50 - direct p50 (ms)")
        over.set_title("overhead per call, p50")
        bottom = [0.0] * len(levels)
        for part in PART_NAMES[1:]:
            values = [by_level[str(lv)]["parts_p50_ms"][part] for lv in levels]
            parts.bar(list(ticks), values, 0.6, bottom=bottom, label=part.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        parts.set_ylabel("ms per call (p50 of each part, stacked)")
        parts.set_title(f"endpoint call beyond the engine ({results['headline_client']})")
        for ax in (over, parts):
            ax.set_xticks(list(ticks), [str(lv) for lv in levels])
        for ax in (lat, over, parts):
            ax.set_xlabel("jobs in flight")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        fig.suptitle("Harness endpoint against a direct engine call (development server)")
        return fig

    return write_figure(path, figure)


def overhead_of(entry: dict[str, Any], client: str) -> dict[str, Any]:
    return entry if entry["client"] == client else entry[client]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under about a minute")
    parser.add_argument("--model", type=Path, help="the tiny model's directory (made if missing)")
    parser.add_argument(
        "--rate", type=float, help="calls per second each arm's jobs offer together (30)"
    )
    parser.add_argument(
        "--levels", help="jobs in flight at each level, comma separated (1,100,500; quick 1,20,100)"
    )
    parser.add_argument("--helper", action="store_true", help=argparse.SUPPRESS)
    add_figure_option(parser, "proxy")
    args = parser.parse_args(argv)
    if args.helper:
        asyncio.run(serve_helper())
        return 0
    sizes = QUICK if args.quick else FULL
    if args.rate:
        sizes = dataclasses.replace(sizes, rate=args.rate)
    if args.levels:
        levels = tuple(int(x) for x in args.levels.split(",") if x.strip())
        sizes = dataclasses.replace(sizes, levels=levels)
    started = time.perf_counter()
    model_dir = make_tiny_model((args.model or get_settings().tiny_model_dir).resolve())
    with tempfile.TemporaryDirectory(prefix="rollserve-bench-proxy-") as tmp:
        outcome = asyncio.run(bench(Path(tmp), model_dir, sizes))
    if outcome.mini is not None:
        print(describe_mini(outcome.mini), flush=True)
    results = results_of(outcome, sizes, args.quick, time.perf_counter() - started)
    figure = draw(results, args.figure)
    results["figure"] = str(figure) if figure else None
    print_json(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
