"""Routing on two real vLLM engines: rollserve's sticky least-loaded pool against round-robin.

The real-engine check of `bench/routing.py`'s simulation. Two vLLM servers (the CPU build
from `make vllm`, serving the tiny Qwen3 model) take the same multi-turn workload twice, in
one run: once routed per request in turn over both engines (round-robin), once by rollserve's
backend pool (`routing.pool.BackendPool` on a real Redis: a job acquires the least-loaded
backend per capacity and keeps it until it ends). The requests go through rollserve's own
vLLM client (`/v1/completions`, token ids in and out).

The workload, drawn once from the seed: every job shares one system prompt (an agent's
instructions and tool descriptions), has a task of its own, and runs a log-normal number of
turns; between turns a tool answers after a pause and its observation is appended to the
prompt, so each prompt extends the last one — the prefix a sticky job finds in its engine's
cache. Prompts run from about 600 to 1,900 tokens (vLLM caches prefixes in 128-token blocks).
Each arm sends its requests under a `cache_salt` of its own, so neither reuses what the other
cached.

The figures come from the engines' own `/metrics`, read before and after each arm:
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (prompt tokens looked up
and found), their difference as the prompt tokens the engines had to prefill, preemptions,
and the mean time to first token. Each engine's KV cache is sized (`--num-gpu-blocks-override`)
to hold the contexts in progress about once and a half: round-robin spreads every job over
both engines, so each engine needs room for all of them.

    .venv/bin/python bench/routing_vllm.py [--quick]

It needs `make vllm`; without it the run says why and its JSON carries `{"failed": ...}`.
The figure (`--figure PATH`, default bench/figures/routing_vllm.png) shows both arms' engine
figures, rollserve's as ratios to round-robin's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.support.engines import Engine, EngineUnavailable, start_engines, stop_engines  # noqa: E402
from bench.support.plot import add_figure_option, compare_bars, write_figure  # noqa: E402
from bench.support.report import print_json  # noqa: E402
from broker.embedded import EmbeddedRedis  # noqa: E402
from core.schemas import BackendSpec  # noqa: E402
from core.settings import get_settings  # noqa: E402
from routing.devserver.tiny import make_tiny_model  # noqa: E402
from routing.pool import BackendPool  # noqa: E402
from routing.vllm import VLLMClient  # noqa: E402

BLOCK = 128
"""Tokens per KV-cache block of vLLM's CPU build (prefix caching reuses whole blocks)."""

FIRST_ID, LAST_ID = 1_000, 150_000
"""Range of the ids drawn for prompts and observations: ordinary vocabulary, no specials."""

SERIES = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
)


@dataclass(frozen=True)
class Params:
    """What shapes a run; printed and written to the JSON."""

    seed: int = 0
    jobs: int = 48
    concurrency: int = 8
    system_tokens: int = 384
    task_tokens: tuple[int, int] = (128, 384)
    turns_median: float = 5.0
    max_turns: int = 9
    decode_tokens: tuple[int, int] = (8, 24)
    observation_median: float = 96.0
    tool_seconds_median: float = 0.3
    max_context: int = 1_920
    blocks_per_engine: int = 0
    """KV blocks per engine; 0: one and a half times the contexts in progress (`sized_blocks`)."""


QUICK = {"jobs": 16, "concurrency": 4}


@dataclass(frozen=True)
class Turn:
    observation: tuple[int, ...]
    decode: int
    tool_seconds: float


@dataclass(frozen=True)
class Job:
    key: str
    prompt: tuple[int, ...]
    turns: tuple[Turn, ...]


def lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> float:
    return min(high, max(low, rng.lognormvariate(math.log(median), sigma)))


def ids(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ID, LAST_ID) for _ in range(count))


def make_jobs(p: Params) -> list[Job]:
    """The job set, drawn once from the seed; both arms run these jobs."""
    rng = random.Random(p.seed)
    system = ids(rng, p.system_tokens)
    jobs = []
    for index in range(p.jobs):
        prompt = system + ids(rng, rng.randint(*p.task_tokens))
        wanted = round(lognormal(rng, p.turns_median, 0.5, 2, p.max_turns))
        context, turns = len(prompt), []
        for _ in range(wanted):
            decode = rng.randint(*p.decode_tokens)
            seen = round(lognormal(rng, p.observation_median, 0.6, 16, 320))
            if context + decode + seen + max(p.decode_tokens) > p.max_context:
                break
            turns.append(
                Turn(ids(rng, seen), decode, lognormal(rng, p.tool_seconds_median, 0.5, 0.05, 2.0))
            )
            context += decode + seen
        # The last turn: the model answers and no tool follows.
        turns.append(Turn((), rng.randint(*p.decode_tokens), 0.0))
        jobs.append(Job(f"job-{index:04d}", prompt, tuple(turns)))
    return jobs


def sized_blocks(p: Params, jobs: list[Job]) -> int:
    """KV blocks per engine: one and a half times the mean context of its jobs in progress."""
    total = sum(len(j.prompt) + sum(len(t.observation) + t.decode for t in j.turns) for j in jobs)
    mean_final = total / len(jobs)
    in_progress = p.concurrency / 2 * math.ceil(mean_final / BLOCK)
    return max(int(1.5 * in_progress), 2 * math.ceil(p.max_context / BLOCK) + 2)


# Engines ----------------------------------------------------------------------------------


def metrics(url: str) -> dict[str, float]:
    """The series of `SERIES`, each summed over its labels."""
    totals = dict.fromkeys(SERIES, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def settled(url: str) -> dict[str, float]:
    """`metrics` once two readings 0.3 s apart agree (an engine records a step just after it
    answers)."""
    last = metrics(url)
    for _ in range(30):
        time.sleep(0.3)
        now = metrics(url)
        if now == last:
            return now
        last = now
    return last


# Arms -------------------------------------------------------------------------------------


@dataclass
class ArmResult:
    name: str
    wall_s: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)
    moves: int = 0
    engine: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        e = self.engine
        queries, hits = e["vllm:prefix_cache_queries_total"], e["vllm:prefix_cache_hits_total"]
        count = e["vllm:time_to_first_token_seconds_count"]
        per = list(self.requests.values())
        return {
            "wall_s": round(self.wall_s, 2),
            "requests_per_engine": self.requests,
            "load_imbalance": round(max(per) / (sum(per) / len(per)), 3) if per else None,
            "jobs_moved": self.moves,
            "prompt_tokens": int(e["vllm:prompt_tokens_total"]),
            "prefix_cache_queries": int(queries),
            "prefix_cache_hits": int(hits),
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "prefill_tokens": int(queries - hits),
            "preemptions": int(e["vllm:num_preemptions_total"]),
            "ttft_mean_ms": round(1e3 * e["vllm:time_to_first_token_seconds_sum"] / count, 1)
            if count
            else None,
        }


Chooser = Callable[[str], Awaitable[str]]
Arm = Callable[[], Coroutine[Any, Any, ArmResult]]


async def run_arm(
    name: str,
    jobs: list[Job],
    engines: list[Engine],
    p: Params,
    choose: Chooser,
    done: Callable[[str], None],
) -> ArmResult:
    """Every job through the engines, `p.concurrency` at a time, each request sent where
    `choose(job_key)` says; `done(job_key)` when a job ends."""
    result = ArmResult(name, requests={e.name: 0 for e in engines})
    clients = {e.name: VLLMClient(e.url, e.model, timeout=600) for e in engines}
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def worker() -> None:
        while not queue.empty():
            job = queue.get_nowait()
            prompt, last = list(job.prompt), None
            for index, turn in enumerate(job.turns):
                chosen = await choose(job.key)
                result.moves += last is not None and chosen != last
                last = chosen
                result.requests[chosen] += 1
                out = await clients[chosen].complete(
                    prompt, max_tokens=turn.decode, seed=index, cache_salt=f"bench-{name}"
                )
                prompt += out.output_ids
                if turn.tool_seconds:
                    await asyncio.sleep(turn.tool_seconds)
                prompt += turn.observation
            done(job.key)

    began = time.monotonic()
    try:
        await asyncio.gather(*(worker() for _ in range(p.concurrency)))
    finally:
        for client in clients.values():
            await client.aclose()
    result.wall_s = time.monotonic() - began
    return result


def measure(name: str, engines: list[Engine], run: Arm) -> ArmResult:
    before = {e.name: settled(e.url) for e in engines}
    result = asyncio.run(run())
    after = {e.name: settled(e.url) for e in engines}
    result.engine = {k: sum(after[e.name][k] - before[e.name][k] for e in engines) for k in SERIES}
    return result


def round_robin(engines: list[Engine]) -> tuple[Chooser, Callable[[str], None]]:
    cycle = itertools.cycle([e.name for e in engines])

    async def choose(job_key: str) -> str:
        return next(cycle)

    return choose, lambda job_key: None


def rollserve_pool(
    engines: list[Engine], client: redis.Redis
) -> tuple[Chooser, Callable[[str], None]]:
    """rollserve's backend pool: sticky least-loaded per capacity, one Lua script per route."""
    pool = BackendPool(client, prefix="bench:")
    for engine in engines:
        pool.register(BackendSpec(url=engine.url, model=engine.model, id=engine.name))

    async def choose(job_key: str) -> str:
        return pool.route(job_key).backend_id

    return choose, pool.release


async def warm(engines: list[Engine]) -> None:
    """The first requests of a fresh engine are slow (about 25 s): send them before measuring."""
    rng = random.Random(99)
    for engine in engines:
        async with VLLMClient(engine.url, engine.model, timeout=600) as client:
            for _ in range(2):
                await client.complete(list(ids(rng, 300)), max_tokens=8, seed=0, cache_salt="warm")


def compare(params: Params, jobs: list[Job], blocks: int) -> dict[str, Any]:
    """Both arms on two fresh engines: the figures, or `{"failed": ...}` without vLLM."""
    work = Path(tempfile.mkdtemp(prefix="rs-bench-routing-vllm-"))
    engines: list[Engine] = []
    store = EmbeddedRedis(work / "redis")
    try:
        model_dir = make_tiny_model(get_settings().tiny_model_dir.resolve())
        try:
            blocks_arg = ["--num-gpu-blocks-override", str(blocks)]
            engines = start_engines(model_dir, work, ["vllm-a", "vllm-b"], blocks_arg)
        except EngineUnavailable as exc:
            print(f"cannot run two vLLM engines: {exc}", file=sys.stderr)
            return {"failed": str(exc)[:500]}
        print("engines ready after " + ", ".join(f"{e.name} {e.ready_s:.0f}s" for e in engines))
        asyncio.run(warm(engines))
        client = redis.Redis.from_url(store.start(), decode_responses=False)
        arms: dict[str, ArmResult] = {}
        rr = round_robin(engines)
        arms["round_robin"] = measure(
            "rr", engines, lambda: run_arm("rr", jobs, engines, params, *rr)
        )
        ours = rollserve_pool(engines, client)
        arms["rollserve"] = measure(
            "rollserve", engines, lambda: run_arm("rollserve", jobs, engines, params, *ours)
        )
    except BaseException:
        print(f"the engines' logs are kept in {work}", file=sys.stderr)
        raise
    finally:
        stop_engines(engines)
        store.stop()
    shutil.rmtree(work, ignore_errors=True)

    summaries = {name: arm.summary() for name, arm in arms.items()}
    report(summaries)
    base, ours_s = summaries["round_robin"], summaries["rollserve"]
    return {
        "engines": len(engines),
        "engine_ready_s": [round(e.ready_s, 1) for e in engines],
        "arms": summaries,
        "hit_rate_round_robin": base["prefix_cache_hit_rate"],
        "hit_rate_rollserve": ours_s["prefix_cache_hit_rate"],
        "prefill_tokens_vs_round_robin": ratio(ours_s["prefill_tokens"], base["prefill_tokens"]),
        "wall_vs_round_robin": ratio(ours_s["wall_s"], base["wall_s"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a short run: {QUICK}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--blocks", type=int, default=0, help="KV blocks per engine (0: sized)")
    add_figure_option(parser, "routing_vllm")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = dict(QUICK) if args.quick else {}
    overrides.update(
        {k: v for k, v in (("jobs", args.jobs), ("concurrency", args.concurrency)) if v}
    )
    params = Params(seed=args.seed, blocks_per_engine=args.blocks, **overrides)
    jobs = make_jobs(params)
    blocks = params.blocks_per_engine or sized_blocks(params, jobs)
    requests = sum(len(j.turns) for j in jobs)
    conditions: dict[str, Any] = {
        "params": asdict(params),
        "blocks_per_engine": blocks,
        "block_tokens": BLOCK,
        "requests": requests,
        "final_context_mean": round(
            sum(len(j.prompt) + sum(len(t.observation) + t.decode for t in j.turns) for j in jobs)
            / len(jobs)
        ),
    }
    print(f"{len(jobs)} jobs, {requests} requests, {params.concurrency} at a time")
    print(f"{blocks} KV blocks of {BLOCK} tokens per engine")

    results = {"benchmark": "routing_vllm", **conditions, **compare(params, jobs, blocks)}
    figure = draw(results, args.figure)
    results["figure"] = str(figure) if figure else None
    print_json(results)
    return 0


PANELS = (
    ("prefix-cache hit rate", "prefix_cache_hit_rate", 100.0, "%"),
    ("prompt tokens prefilled", "prefill_tokens", 1.0, "tokens"),
    ("mean time to first token", "ttft_mean_ms", 1.0, "ms"),
    ("wall time", "wall_s", 1.0, "s"),
)


def draw(results: dict[str, Any], path: Path) -> Path | None:
    """The engines' own figures for both arms, rollserve's as a ratio to round-robin's; no
    figure when the engines could not run."""
    arms: dict[str, dict[str, Any]] = results.get("arms", {})
    labels = {"round_robin": "round-robin", "rollserve": "rollserve"}

    def figure(plt: Any) -> Any:
        if not arms:
            return None
        fig, axes = plt.subplots(1, len(PANELS), figsize=(14, 4))
        for ax, (title, key, scale, unit) in zip(axes, PANELS, strict=True):
            bars = [
                (labels.get(name, name), None if arm[key] is None else scale * arm[key])
                for name, arm in arms.items()
            ]
            compare_bars(ax, bars, unit=unit, reference="round-robin", highlight="rollserve")
            ax.set_title(title)
        jobs = results["params"]["jobs"]
        fig.suptitle(f"Two real vLLM engines (CPU build), {jobs} multi-turn jobs: routing")
        return fig

    return write_figure(path, figure)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


COLUMNS = (
    ("hit rate", "prefix_cache_hit_rate", "{:.1%}"),
    ("prefill tok", "prefill_tokens", "{:,}"),
    ("prompt tok", "prompt_tokens", "{:,}"),
    ("preempt", "preemptions", "{}"),
    ("ttft ms", "ttft_mean_ms", "{}"),
    ("wall s", "wall_s", "{}"),
    ("per engine", "requests_per_engine", "{}"),
)


def report(summaries: dict[str, dict[str, Any]]) -> None:
    print(
        f"{'policy':<12}" + "".join(f"{title:>14}" for title, _, _ in COLUMNS[:-1]) + "  per engine"
    )
    for name, s in summaries.items():
        cells = [fmt.format(s[key]) if s[key] is not None else "-" for _, key, fmt in COLUMNS]
        print(f"{name:<12}" + "".join(f"{c:>14}" for c in cells[:-1]) + f"  {cells[-1]}")


if __name__ == "__main__":
    sys.exit(main())
