"""Backend assignment for multi-turn agent jobs: a seeded discrete-event fleet simulation.

No servers are started: this is a model of a fleet of inference backends serving the model
calls of multi-turn agent jobs, run once per assignment policy on the same jobs (the same
random draws), so that the policies differ in nothing but where requests go.

The fleet. `--backends` servers (8 by default); `--big` of them (2) have `--big-factor` (2x)
capacity — think two GPUs with tensor parallelism: twice the batch slots, the prefix cache
and the prefill chunk, prefill cost and the per-request and per-KV-token decode costs halved,
so at twice the load a step takes as long — and a capacity-blind policy underuses them. A
backend models vLLM-style continuous batching with chunked prefill as a fluid (event-driven,
not step-by-step) model:

- at most `max_batch x capacity` requests run; the rest wait FIFO at the backend;
- each engine step decodes one token for every running request past its prefill, and
  computes up to `chunk x capacity` prompt tokens of the oldest request still in prefill;
- step time = [decoders present] (decode_step + per_request x n + per_kv_token x sum of
  their contexts) + [prefill present] chunk x prefill_per_token. Decode is memory bound
  (weights once per step, then every context's KV), prefill compute bound: a long uncached
  prompt slows every request on that backend while it is being computed (the interference
  vLLM users see as ITL spikes), and a cached prefix is not computed at all;
- the prefix cache is an LRU of token prefixes with a fixed capacity in tokens
  (`cache_tokens x capacity`): one shared system-prompt entry and one entry per job holding
  the job's context as last computed there. A prompt's hit is the system prefix plus the
  job's cached context (a prefix of the new prompt, since each turn's prompt is the whole
  context so far); when a request is admitted its prompt is inserted, when it finishes its
  output too, and the least recently used entries are trimmed from their tails (as block
  eviction would) until the cache fits. Running requests' KV beyond that is not modelled,
  and a decoder's context counts at its length as of the last event on its backend.

The defaults are meant as the costs of a 32B-class dense model on H100-class hardware:
a 20 ms decode step is reading ~64 GB of weights at ~3.3 TB/s, 0.08 us per KV token is its
~256 kB of KV per token at that bandwidth, 0.1 ms per prefill token is ~64 GFLOP a token at
~650 TFLOP/s. The prefix cache, 64k tokens per unit of capacity (~16 GB of KV), holds about
two thirds of the live working set (the contexts of the jobs in progress; the ratio is
printed), so eviction matters. Every figure is a flag (`--help`); none was tuned per policy.

The jobs. A shared system prompt plus a task prompt (uniform in a range), then T model calls
(T log-normal, clipped to 1..30, so a few jobs run many times longer than most); each call
decodes D tokens, then a tool call takes some seconds of wall time off the backend and appends
an observation of O tokens (D, O and the tool time log-normal). A job stops early if its next
prompt would exceed the context window. `--slots` worker slots pull jobs from one queue (all
jobs are queued at time 0), so throughput = slots / mean job time, less the tail.

The policies (a backend is chosen per job at its start when sticky, else per request):

- `round-robin`: request i goes to backend i mod N (capacity-blind, not sticky);
- `prorl-heap`: ProRL Agent's min-heap of backends keyed by assignments ever made: the job
  takes the top, its key is incremented and never decremented; sticky for the whole job;
- `least-loaded`: each request goes to the backend minimising (in-flight + 1) / capacity,
  in-flight = running + waiting there (not sticky);
- `consistent-hash`: the job's id on a hash ring with 64 x capacity virtual nodes per
  backend (capacity-weighted, sticky by construction, blind to load);
- `rollserve`: sticky least-loaded on current load — at job start the backend minimising
  (jobs holding it + 1) / capacity, ties to the lowest id; the count drops when the job ends;
- `rollserve-unweighted`: the same with every capacity taken as 1, which is what
  routing/pool.py does today (its heap score is the plain count of jobs holding a backend).

Measured, per policy: throughput (jobs / simulated makespan, the drain of the last jobs
included, as a trainer waiting for the whole batch sees it) and its ratio to round-robin's in
the same run; "steady" throughput (jobs finished while the queue still had jobs / the time it
ran dry: all slots busy, no drain); prefix-cache hit rate (cached prompt tokens / all prompt
tokens, the system prompt included); load imbalance = max / mean over backends of the
time-averaged in-flight requests (running + waiting) per unit of capacity (1.00 is perfectly
even); job time (first request queued to last token, tool time included), mean and p99; and
the uncached prompt tokens computed.

    .venv/bin/python bench/routing.py [--quick] [--json PATH] [--seed N] [...]

`--quick` runs 4 backends (one big), 64 slots and 300 jobs: a second or so instead of ~10 s.
The last line printed is one JSON object with every figure and the parameters. A baseline
policy that fails is recorded as `{"failed": "..."}` (ratios against round-robin are null if
it is round-robin); rollserve's own policies are still run and reported. The figure
(`--figure PATH`, default bench/figures/routing.png) shows each policy's throughput against
round-robin's and its prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import hashlib
import heapq
import json
import math
import random
import sys
import textwrap
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a script, this directory would come first on sys.path, and this script would shadow
# the `routing` package: the repository comes first instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.plot import add_figure_option, compare_bars, write_figure
from bench.support.report import finite, has_failed, print_json, run_baseline

SYSTEM_KEY = -1
"""Cache key of the system prompt shared by every job."""

EPS = 1e-6
"""Tokens of work below which a phase counts as finished (float round-off)."""


@dataclass(frozen=True)
class Params:
    """Everything that shapes a run; all of it is printed and written to the JSON."""

    seed: int = 0
    jobs: int = 2000
    slots: int = 128
    backends: int = 8
    big: int = 2
    big_factor: float = 2.0
    # Per backend of capacity 1.
    max_batch: int = 32
    cache_tokens: int = 64_000
    prefill_ms_per_token: float = 0.1
    prefill_chunk: int = 2048
    decode_step_ms: float = 20.0
    decode_ms_per_request: float = 0.2
    decode_us_per_kv_token: float = 0.08
    # Jobs.
    system_tokens: int = 1200
    task_tokens_min: int = 500
    task_tokens_max: int = 2500
    turns_median: float = 6.0
    turns_sigma: float = 0.8
    max_turns: int = 30
    decode_median: float = 300.0
    decode_sigma: float = 0.8
    observation_median: float = 500.0
    observation_sigma: float = 1.0
    tool_median_s: float = 3.0
    tool_sigma: float = 0.8
    max_context: int = 32_768

    def capacities(self) -> list[float]:
        """Capacity of each backend; the big ones take the highest ids (no tie-break edge)."""
        return [
            self.big_factor if index >= self.backends - self.big else 1.0
            for index in range(self.backends)
        ]


QUICK = {"jobs": 300, "slots": 64, "backends": 4, "big": 1}
"""Overrides for --quick: a smaller fleet, fewer jobs, same per-backend model."""


# Jobs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    prompt: int
    decode: int
    tool_s: float
    """Tool time after this call (0 after the last)."""


@dataclass(frozen=True)
class Job:
    index: int
    key: str
    turns: tuple[Turn, ...]


def lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> float:
    return min(high, max(low, rng.lognormvariate(math.log(median), sigma)))


def make_jobs(params: Params) -> list[Job]:
    """The job set, drawn once from the seed; every policy runs the same jobs."""
    rng = random.Random(params.seed)
    p = params
    jobs = []
    for index in range(p.jobs):
        key = f"{rng.getrandbits(64):016x}"
        wanted = round(lognormal(rng, p.turns_median, p.turns_sigma, 1, p.max_turns))
        context = p.system_tokens + rng.randint(p.task_tokens_min, p.task_tokens_max)
        turns: list[Turn] = []
        for k in range(wanted):
            decode = round(lognormal(rng, p.decode_median, p.decode_sigma, 16, 2048))
            observation = round(lognormal(rng, p.observation_median, p.observation_sigma, 16, 4096))
            tool_s = lognormal(rng, p.tool_median_s, p.tool_sigma, 0.2, 60.0)
            decode = min(decode, p.max_context - context)
            last = k == wanted - 1 or context + decode + observation + 16 > p.max_context
            turns.append(Turn(context, decode, 0.0 if last else tool_s))
            if last:
                break
            context += decode + observation
        jobs.append(Job(index, key, tuple(turns)))
    return jobs


# Backends ---------------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    job: int
    turn: int
    prompt: int
    decode: int
    prefill_left: float = 0.0
    decode_left: float = 0.0
    prefilling: bool = True


class Backend:
    """One inference server: continuous batching with chunked prefill and an LRU prefix cache."""

    def __init__(self, index: int, capacity: float, params: Params) -> None:
        self.index = index
        self.capacity = capacity
        self.system_tokens = params.system_tokens
        self.max_batch = max(1, round(params.max_batch * capacity))
        self.cache_capacity = round(params.cache_tokens * capacity)
        self.chunk = params.prefill_chunk * capacity
        self.prefill_s_per_token = params.prefill_ms_per_token / 1000 / capacity
        self.step_s = params.decode_step_ms / 1000
        self.per_request_s = params.decode_ms_per_request / 1000 / capacity
        self.per_kv_s = params.decode_us_per_kv_token / 1e6 / capacity
        self.cache: OrderedDict[int, int] = OrderedDict()
        self.cached_total = 0
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.clock = 0.0
        self.version = 0
        self.load_integral = 0.0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.decode_tokens = 0

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.waiting)

    # The cache.

    def _put(self, key: int, tokens: int) -> None:
        self.cached_total += tokens - self.cache.get(key, 0)
        self.cache[key] = tokens
        self.cache.move_to_end(key)
        while self.cached_total > self.cache_capacity:
            oldest, size = next(iter(self.cache.items()))
            over = self.cached_total - self.cache_capacity
            if size <= over:
                del self.cache[oldest]
                self.cached_total -= size
            else:
                self.cache[oldest] = size - over  # trimmed from the tail; keeps its place
                self.cached_total -= over

    def _hit(self, request: Request) -> int:
        system = self.cache.get(SYSTEM_KEY, 0)
        if system < self.system_tokens:
            return system
        own = self.cache.get(request.job, 0)
        return min(request.prompt - 1, self.system_tokens + own)  # the last token is computed

    # The engine.

    def _rates(self) -> tuple[float, float]:
        """Prompt tokens per second for the prefill head, tokens per second per decoder."""
        decoders = [r for r in self.running if not r.prefilling]
        prefill = len(decoders) < len(self.running)
        step = 0.0
        if decoders:
            kv = sum(r.prompt + r.decode - r.decode_left for r in decoders)
            step += self.step_s + self.per_request_s * len(decoders) + self.per_kv_s * kv
        if prefill:
            step += self.chunk * self.prefill_s_per_token
        if step == 0.0:
            return 0.0, 0.0
        return (self.chunk / step if prefill else 0.0), (1.0 / step if decoders else 0.0)

    def advance(self, now: float) -> None:
        """Run the engine from its clock to `now` (no state change in between)."""
        elapsed = now - self.clock
        if elapsed <= 0:
            return
        self.load_integral += self.in_flight * elapsed
        prefill_rate, decode_rate = self._rates()
        head = True
        for request in self.running:
            if request.prefilling:
                if head:
                    request.prefill_left -= prefill_rate * elapsed
                    head = False
            else:
                request.decode_left -= decode_rate * elapsed
        self.clock = now

    def next_event(self) -> float | None:
        prefill_rate, decode_rate = self._rates()
        soonest = math.inf
        head = True
        for request in self.running:
            if request.prefilling:
                if head:
                    soonest = min(soonest, max(0.0, request.prefill_left) / prefill_rate)
                    head = False
            else:
                soonest = min(soonest, max(0.0, request.decode_left) / decode_rate)
        return None if soonest == math.inf else self.clock + soonest

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting.popleft()
            hit = self._hit(request)
            self.prompt_tokens += request.prompt
            self.cached_tokens += hit
            request.prefill_left = request.prompt - hit
            request.decode_left = request.decode
            self._put(SYSTEM_KEY, self.system_tokens)
            self._put(request.job, request.prompt - self.system_tokens)
            self.running.append(request)

    def arrive(self, request: Request, now: float) -> None:
        self.advance(now)
        self.waiting.append(request)
        self._admit()

    def wake(self, now: float) -> list[Request]:
        """Advance to `now`; return the requests that finished decoding."""
        self.advance(now)
        finished = []
        for request in self.running:
            if request.prefilling:
                if request.prefill_left <= EPS:
                    request.prefilling = False
                else:
                    break  # only the head makes progress
        for request in self.running:
            if not request.prefilling and request.decode_left <= EPS:
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if r not in finished]
            for request in finished:
                self.decode_tokens += request.decode
                self._put(request.job, request.prompt + request.decode - self.system_tokens)
            self._admit()
        return finished


# Policies ---------------------------------------------------------------------------------


class Policy:
    """Chooses backends. Sticky policies choose once per job, the others once per request.

    `trace`, when a list, receives (what the policy looked at, its choice) per decision.
    """

    name = ""
    sticky = True

    def __init__(self, backends: list[Backend], trace: bool = False) -> None:
        self.backends = backends
        self.trace: list[tuple[tuple[float, ...], int]] | None = [] if trace else None

    def _record(self, seen: tuple[float, ...], chosen: int) -> int:
        if self.trace is not None:
            self.trace.append((seen, chosen))
        return chosen

    def assign(self, job: Job) -> int:
        """The backend a sticky job keeps."""
        raise NotImplementedError

    def route(self, job: Job) -> int:
        """The backend of one request of a non-sticky policy."""
        raise NotImplementedError

    def release(self, job: Job, backend: int) -> None:
        """The job has ended."""


class RoundRobin(Policy):
    name = "round-robin"
    sticky = False

    def __init__(self, backends: list[Backend], trace: bool = False) -> None:
        super().__init__(backends, trace)
        self.counter = 0

    def route(self, job: Job) -> int:
        chosen = self.counter % len(self.backends)
        self.counter += 1
        return self._record((float(self.counter - 1),), chosen)


class ProRLHeap(Policy):
    """Min-heap on assignments ever made: incremented on assignment, never decremented."""

    name = "prorl-heap"

    def __init__(self, backends: list[Backend], trace: bool = False) -> None:
        super().__init__(backends, trace)
        self.heap = [(0, b.index) for b in backends]
        heapq.heapify(self.heap)
        self.counts = [0] * len(backends)

    def assign(self, job: Job) -> int:
        count, chosen = heapq.heappop(self.heap)
        heapq.heappush(self.heap, (count + 1, chosen))
        self.counts[chosen] = count + 1
        return self._record(tuple(float(c) for c in self.counts), chosen)


class LeastLoaded(Policy):
    """Each request to the backend minimising (in-flight + 1) / capacity, ties to lowest id."""

    name = "least-loaded"
    sticky = False

    def route(self, job: Job) -> int:
        loads = tuple(float(b.in_flight) for b in self.backends)
        chosen = min(
            range(len(self.backends)),
            key=lambda i: ((loads[i] + 1) / self.backends[i].capacity, i),
        )
        return self._record(loads, chosen)


def ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class ConsistentHash(Policy):
    """The job id on a ring with 64 x capacity virtual nodes per backend."""

    name = "consistent-hash"
    vnodes = 64

    def __init__(self, backends: list[Backend], trace: bool = False) -> None:
        super().__init__(backends, trace)
        points = sorted(
            (ring_hash(f"backend-{b.index}-{v}"), b.index)
            for b in backends
            for v in range(round(self.vnodes * b.capacity))
        )
        self.points = [point for point, _ in points]
        self.owners = [owner for _, owner in points]

    def assign(self, job: Job) -> int:
        at = bisect.bisect(self.points, ring_hash(job.key)) % len(self.points)
        return self._record((), self.owners[at])


class Rollserve(Policy):
    """Sticky least-loaded on current load: jobs holding a backend, released when they end."""

    name = "rollserve"
    weighted = True

    def __init__(self, backends: list[Backend], trace: bool = False) -> None:
        super().__init__(backends, trace)
        self.holding = [0] * len(backends)

    def assign(self, job: Job) -> int:
        caps = [b.capacity if self.weighted else 1.0 for b in self.backends]
        chosen = min(range(len(caps)), key=lambda i: ((self.holding[i] + 1) / caps[i], i))
        seen = tuple(float(h) for h in self.holding)
        self.holding[chosen] += 1
        return self._record(seen, chosen)

    def release(self, job: Job, backend: int) -> None:
        self.holding[backend] -= 1


class RollserveUnweighted(Rollserve):
    name = "rollserve-unweighted"
    weighted = False


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (RoundRobin, ProRLHeap, LeastLoaded, ConsistentHash, Rollserve, RollserveUnweighted)
}
OURS = (Rollserve.name, RollserveUnweighted.name)
"""rollserve's policies (the rest are baselines, whose failure is recorded, not raised)."""


# The simulation ---------------------------------------------------------------------------


@dataclass
class Result:
    policy: str
    jobs: int
    makespan_s: float
    throughput_jobs_per_s: float
    steady_jobs_per_s: float
    """Jobs finished while the queue still had jobs, per second until it ran dry (no drain)."""
    hit_rate: float
    imbalance: float
    job_time_mean_s: float
    job_time_p99_s: float
    prompt_tokens: int
    uncached_prompt_tokens: int
    decode_tokens: int
    load_per_capacity: list[float]
    live_context_tokens: float
    """Time-averaged sum of the contexts of the jobs in progress (the fleet's working set)."""
    cache_over_working_set: float
    """Fleet cache / (live contexts + one system prompt per backend)."""
    completions: list[int] = field(repr=False)
    """Per job index, how many times it finished (1 each when all is well)."""
    backend_of_job: list[list[int]] = field(repr=False)
    """Per job index, the backend of each of its requests."""

    def summary(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        del data["completions"], data["backend_of_job"]
        return data


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Simulation:
    """One policy over one job set: worker slots, backends, tool calls, all in simulated time."""

    def __init__(self, params: Params, jobs: list[Job], policy: str, trace: bool = False):
        self.params = params
        self.jobs = jobs
        self.backends = [Backend(i, c, params) for i, c in enumerate(params.capacities())]
        self.policy = POLICIES[policy](self.backends, trace)
        self.events: list[tuple[float, int, int, int, int]] = []
        self.sequence = 0
        self.queue = deque(jobs)
        self.drained_at = 0.0
        self.held: dict[int, int] = {}
        self.started: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.completions = [0] * len(jobs)
        self.backend_of_job: list[list[int]] = [[] for _ in jobs]
        self.context = [0] * len(jobs)
        self.live = 0
        self.live_integral = 0.0
        self.clock = 0.0

    def _set_context(self, job: int, tokens: int) -> None:
        """The job's context is now `tokens` long (0 once it has ended)."""
        self.live += tokens - self.context[job]
        self.context[job] = tokens

    def _push(self, when: float, kind: int, a: int, b: int) -> None:
        heapq.heappush(self.events, (when, self.sequence, kind, a, b))
        self.sequence += 1

    def _schedule(self, backend: Backend) -> None:
        backend.version += 1
        when = backend.next_event()
        if when is not None:
            self._push(when, 0, backend.index, backend.version)

    def _start_job(self, now: float) -> None:
        if not self.queue:
            return
        job = self.queue.popleft()
        if not self.queue:
            self.drained_at = now
        self.started[job.index] = now
        if self.policy.sticky:
            self.held[job.index] = self.policy.assign(job)
        self._submit(now, job, 0)

    def _submit(self, now: float, job: Job, turn: int) -> None:
        index = self.held[job.index] if self.policy.sticky else self.policy.route(job)
        self.backend_of_job[job.index].append(index)
        spec = job.turns[turn]
        self._set_context(job.index, spec.prompt - self.params.system_tokens)
        backend = self.backends[index]
        backend.arrive(Request(job.index, turn, spec.prompt, spec.decode), now)
        self._schedule(backend)

    def _done(self, now: float, request: Request) -> None:
        job = self.jobs[request.job]
        self._set_context(job.index, request.prompt + request.decode - self.params.system_tokens)
        if request.turn + 1 < len(job.turns):
            self._push(now + job.turns[request.turn].tool_s, 1, job.index, request.turn + 1)
            return
        self._set_context(job.index, 0)
        self.finished[job.index] = now
        self.completions[job.index] += 1
        self.policy.release(job, self.backend_of_job[job.index][-1])
        self._start_job(now)

    def run(self) -> Result:
        for _ in range(min(self.params.slots, len(self.jobs))):
            self._start_job(0.0)
        while self.events:
            now, _, kind, a, b = heapq.heappop(self.events)
            self.live_integral += self.live * (now - self.clock)
            self.clock = now
            if kind == 0:
                backend = self.backends[a]
                if b != backend.version:
                    continue  # superseded by a later change on that backend
                finished = backend.wake(now)
                self._schedule(backend)
                for request in finished:
                    self._done(now, request)
            else:
                self._submit(now, self.jobs[a], b)
        return self._result()

    def _result(self) -> Result:
        makespan = max(self.finished.values())
        for backend in self.backends:
            backend.advance(makespan)
        per_capacity = [b.load_integral / makespan / b.capacity for b in self.backends]
        times = [self.finished[i] - self.started[i] for i in self.finished]
        live = self.live_integral / makespan
        fleet_cache = sum(b.cache_capacity for b in self.backends)
        prompt = sum(b.prompt_tokens for b in self.backends)
        cached = sum(b.cached_tokens for b in self.backends)
        return Result(
            policy=self.policy.name,
            jobs=len(self.finished),
            makespan_s=makespan,
            throughput_jobs_per_s=len(self.finished) / makespan,
            steady_jobs_per_s=(
                sum(end <= self.drained_at for end in self.finished.values()) / self.drained_at
                if self.drained_at > 0
                else math.nan
            ),
            hit_rate=cached / prompt,
            imbalance=max(per_capacity) / (sum(per_capacity) / len(per_capacity)),
            job_time_mean_s=sum(times) / len(times),
            job_time_p99_s=percentile(times, 99),
            prompt_tokens=prompt,
            uncached_prompt_tokens=prompt - cached,
            decode_tokens=sum(b.decode_tokens for b in self.backends),
            load_per_capacity=per_capacity,
            live_context_tokens=live,
            cache_over_working_set=fleet_cache
            / (live + self.params.system_tokens * len(self.backends)),
            completions=self.completions,
            backend_of_job=self.backend_of_job,
        )


def simulate(params: Params, policy: str, jobs: list[Job] | None = None) -> Result:
    return Simulation(params, jobs if jobs is not None else make_jobs(params), policy).run()


def workload(jobs: list[Job]) -> dict[str, float]:
    prompts = [turn.prompt for job in jobs for turn in job.turns]
    return {
        "mean_calls_per_job": len(prompts) / len(jobs),
        "mean_prompt_tokens": sum(prompts) / len(prompts),
        "max_prompt_tokens": max(prompts),
        "max_calls_per_job": max(len(job.turns) for job in jobs),
    }


# Report -----------------------------------------------------------------------------------


def run_policies(params: Params, names: list[str], jobs: list[Job]) -> dict[str, Any]:
    """Each policy's `Result`, in order; a baseline policy that fails gets its failure entry."""
    runs: dict[str, Any] = {}
    for name in names:
        measure = functools.partial(simulate, params, name, jobs)
        runs[name] = measure() if name in OURS else run_baseline(name, measure)
    return runs


def draw(results: dict[str, Any], path: Path) -> Path | None:
    """Throughput per policy against round-robin's, and its prefix-cache hit rate."""
    runs = results["results"]

    def value(name: str, key: str, scale: float = 1.0) -> float | None:
        entry = runs[name]
        return None if has_failed(entry) else scale * entry[key]

    def figure(plt: Any) -> Any:
        fig, (speed, hits) = plt.subplots(1, 2, figsize=(12, 4.2))
        ours = "rollserve" if "rollserve" in runs else None
        compare_bars(
            speed,
            [(name, value(name, "throughput_jobs_per_s")) for name in runs],
            unit="jobs/s",
            reference="round-robin",
            highlight=ours,
        )
        speed.set_title("throughput (jobs / makespan), ratio to round-robin")
        compare_bars(
            hits, [(name, value(name, "hit_rate", 100)) for name in runs], unit="%", highlight=ours
        )
        hits.set_title("prefix-cache hit rate")
        fleet = f"{len(results['capacities'])} backends, capacities {results['capacities']}"
        jobs = results["params"]["jobs"]
        fig.suptitle(f"Backend assignment policies, simulated fleet: {jobs} jobs on {fleet}")
        return fig

    return write_figure(path, figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller fleet, a few seconds")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    add_figure_option(parser, "routing")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated, from: " + ", ".join(POLICIES),
    )
    defaults = Params()
    for item in dataclasses.fields(Params):
        flag = "--" + item.name.replace("_", "-")
        parser.add_argument(flag, type=type(getattr(defaults, item.name)), default=None)
    options = parser.parse_args(argv)

    overrides: dict[str, Any] = dict(QUICK) if options.quick else {}
    for item in dataclasses.fields(Params):
        value = getattr(options, item.name)
        if value is not None:
            overrides[item.name] = value
    params = dataclasses.replace(defaults, **overrides)
    names = [name.strip() for name in options.policies.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {list(POLICIES)}")

    began = time.perf_counter()
    jobs = make_jobs(params)
    shape = workload(jobs)
    runs = run_policies(params, names, jobs)
    elapsed = time.perf_counter() - began
    results: list[Result] = [r for r in runs.values() if isinstance(r, Result)]
    baseline = next((r for r in results if r.policy == "round-robin"), None)

    def versus(result: Result) -> float | None:
        if baseline is None:
            return None
        return result.throughput_jobs_per_s / baseline.throughput_jobs_per_s

    ratios = [r.cache_over_working_set for r in results] or [math.nan]
    print(f"\nbench/routing.py{' --quick' if options.quick else ''}: a simulated fleet")
    print("  parameters:")
    pairs = [f"{item.name}={getattr(params, item.name)}" for item in dataclasses.fields(Params)]
    print(
        textwrap.fill(", ".join(pairs), width=96, initial_indent="    ", subsequent_indent="    ")
    )
    print(
        f"  capacities {params.capacities()}\n  {shape['mean_calls_per_job']:.1f} model calls per "
        f"job on average (max {shape['max_calls_per_job']}); prompts mean "
        f"{shape['mean_prompt_tokens']:,.0f}, max {shape['max_prompt_tokens']:,} tokens"
    )
    print(
        f"  fleet prefix cache / live working set (time-averaged contexts in progress): "
        f"{min(ratios):.2f}-{max(ratios):.2f} across policies"
    )
    print(
        "  imbal. = max/mean over backends of time-averaged in-flight requests per capacity"
        "\n  hit % = cached / all prompt tokens; job time = first request to last token"
        "\n  jobs/s = jobs / makespan; steady = jobs/s until the queue ran dry (no drain)"
    )
    print(
        f"\n  {'policy':<22}{'jobs/s':>8}{'vs RR':>7}{'steady':>8}{'hit %':>7}{'imbal.':>8}"
        f"{'mean job s':>12}{'p99 job s':>11}{'uncached Mtok':>15}"
    )
    for name, r in runs.items():
        if has_failed(r):
            print(f"  {name:<22}  {r['failed']}")
            continue
        ratio = versus(r)
        print(
            f"  {r.policy:<22}{r.throughput_jobs_per_s:>8.4f}"
            f"{'' if ratio is None else f'{ratio:.3f}x':>7}{r.steady_jobs_per_s:>8.4f}"
            f"{100 * r.hit_rate:>7.1f}{r.imbalance:>8.2f}{r.job_time_mean_s:>12.1f}"
            f"{r.job_time_p99_s:>11.1f}{r.uncached_prompt_tokens / 1e6:>15.2f}"
        )
    print(f"\nelapsed {elapsed:.1f} s (wall clock, all policies)\n")

    output = {
        "bench": "routing",
        "quick": options.quick,
        "params": dataclasses.asdict(params),
        "capacities": params.capacities(),
        "workload": shape,
        "imbalance_metric": "max/mean over backends of time-averaged in-flight requests "
        "(running + waiting) divided by capacity",
        "results": {
            name: r if has_failed(r) else {**r.summary(), "throughput_vs_round_robin": versus(r)}
            for name, r in runs.items()
        },
        "elapsed_s": elapsed,
    }
    figure = draw(output, options.figure)
    output["figure"] = str(figure) if figure else None
    if options.json is not None:
        options.json.write_text(json.dumps(finite(output), indent=2, allow_nan=False) + "\n")
    print_json(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
