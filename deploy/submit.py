"""What `rollserve submit` and `rollserve status` do, apart from parsing their arguments.

`submit` reads a JSONL file of tasks (checked whole before anything is sent), submits them as
one batch, shows a progress bar while the finished trajectories stream back, writes them to
an output JSONL file and ends with a reward summary. `status` renders the gateway's stats and
backends.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from api.client import RolloutClient, RolloutServiceError, detail_items
from core.schemas import Backend, JobStatus, Stats, Trajectory

MAX_REPORTED_PROBLEMS = 10
"""Bad lines listed in one SubmitInputError; the rest are counted."""

STAGE_ORDER: tuple[str, ...] = ("init", "run", "eval")

RECONNECTS = 5
"""Consecutive reconnections of the results stream that bring nothing before giving up."""


class SubmitInputError(ValueError):
    """The tasks cannot be submitted as given; the message names the file and line.

    ``problems`` holds one ``"file:line: what is wrong"`` string per bad line.
    """

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        shown = self.problems[:MAX_REPORTED_PROBLEMS]
        message = "\n".join(shown)
        if len(self.problems) > len(shown):
            message += f"\n(and {len(self.problems) - len(shown)} more bad lines)"
        super().__init__(message)


# ------------------------------------------------------------------------------ reading


def read_tasks_numbered(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The tasks of a JSONL file and the 1-based line number each came from.

    Blank lines are skipped. Every other line must be a JSON object with a non-empty string
    ``data_source``; if any line is not, SubmitInputError lists every bad line (so nothing is
    submitted from a file with a mistake in it).
    """
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise SubmitInputError([f"{name}: no such file"]) from None
    except IsADirectoryError:
        raise SubmitInputError([f"{name}: is a directory, not a JSONL file"]) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = raw[: exc.start].count(b"\n") + 1
        raise SubmitInputError([f"{name}:{bad}: not UTF-8 text"]) from None

    tasks: list[dict[str, Any]] = []
    lines: list[int] = []
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        problem = None
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            problem = f"not valid JSON: {exc.msg} (column {exc.colno})"
        else:
            problem = _task_problem(value)
        if problem is not None:
            problems.append(f"{name}:{number}: {problem}")
        else:
            tasks.append(value)
            lines.append(number)
    if problems:
        raise SubmitInputError(problems)
    if not tasks:
        raise SubmitInputError([f"{name}: no tasks (the file has no non-blank line)"])
    return tasks, lines


def read_tasks(path: Path) -> list[dict[str, Any]]:
    """The tasks of a JSONL file, each checked; see `read_tasks_numbered`."""
    return read_tasks_numbered(path)[0]


def _task_problem(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"not a JSON object (found {_json_kind(value)}); each line must be one task"
    if "data_source" not in value:
        return 'no "data_source" (the handler that runs the task, e.g. "math")'
    source = value["data_source"]
    if not isinstance(source, str) or not source.strip():
        return f'"data_source" must be a non-empty string (found {json.dumps(source)})'
    return None


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null"


# ------------------------------------------------------------------------------ summary


@dataclass
class TaskRow:
    """The samples of one task (one group)."""

    instance_id: str
    data_source: str
    rewards: list[float | None]
    """Per sample, in sample order; None where the job ended without a reward."""
    mean: float | None
    """Mean of the rewards that exist; None when there are none."""


@dataclass
class BatchSummary:
    """What came back for one batch.

    ``mean_reward`` and the per-source means are over the jobs that have a reward. A sample
    counts as solved when its reward is above 0.
    """

    batch_id: str
    total: int
    """Jobs submitted."""
    by_status: dict[str, int]
    mean_reward: float | None
    per_source: dict[str, tuple[int, float | None]]
    """data_source → (jobs, mean reward)."""
    per_task: list[TaskRow]
    out: Path | None = None
    elapsed: float = 0.0
    group_size: int = 1
    received: int = field(default=0)

    @property
    def solved_any(self) -> int:
        """Tasks with at least one solved sample (pass@k with k = group size)."""
        return sum(any(r is not None and r > 0 for r in row.rewards) for row in self.per_task)

    @property
    def solved_all(self) -> int:
        """Tasks whose every sample is solved."""
        return sum(
            bool(row.rewards) and all(r is not None and r > 0 for r in row.rewards)
            for row in self.per_task
        )

    @property
    def informative(self) -> int:
        """Groups whose rewards (those that exist) are not all equal: what GRPO/DAPO learn from."""
        return sum(len({r for r in row.rewards if r is not None}) > 1 for row in self.per_task)


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return math.fsum(present) / len(present) if present else None


def summarize(
    batch_id: str,
    trajectories: Sequence[Trajectory],
    total: int,
    job_order: Sequence[str] = (),
    group_size: int = 1,
) -> BatchSummary:
    """Summarize finished trajectories; tasks are ordered as their jobs are in ``job_order``."""
    position = {job_id: i for i, job_id in enumerate(job_order)}
    by_status = Counter(str(t.status) for t in trajectories)

    groups: dict[str, list[Trajectory]] = {}
    for t in sorted(trajectories, key=lambda t: position.get(t.job_id, len(position))):
        groups.setdefault(t.group_id, []).append(t)
    rows = []
    for members in groups.values():
        members.sort(key=lambda t: t.sample_index)
        rewards = [t.reward for t in members]
        rows.append(
            TaskRow(
                instance_id=members[0].instance_id,
                data_source=members[0].data_source,
                rewards=rewards,
                mean=_mean(rewards),
            )
        )

    per_source_rewards: dict[str, list[float | None]] = {}
    for t in trajectories:
        per_source_rewards.setdefault(t.data_source, []).append(t.reward)
    per_source = {
        source: (len(rewards), _mean(rewards))
        for source, rewards in sorted(per_source_rewards.items())
    }
    return BatchSummary(
        batch_id=batch_id,
        total=total,
        by_status=dict(by_status),
        mean_reward=_mean(t.reward for t in trajectories),
        per_source=per_source,
        per_task=rows,
        group_size=group_size,
        received=len(trajectories),
    )


# ------------------------------------------------------------------------------ submitting


_TASK_PATH = re.compile(r"^tasks\.(\d+)(?:\.(\S+?))?$")
_TASK_TEXT = re.compile(r"^tasks\.(\d+)(?:\.(\S+?))?:\s*(.*)$", re.DOTALL)


def input_error_from_422(
    error: RolloutServiceError, line_numbers: Sequence[int] | None, source: str | None
) -> SubmitInputError:
    """A 422 of `POST /v1/batches` told in terms of the JSONL file.

    An error about ``tasks.<i>.<field>`` is reported against the line task ``i`` came from
    (``tasks.jsonl:7: data_source: ...``); any other (a sampling or agent field) as the
    server named it.
    """
    problems = []
    for path, msg in detail_items(error.detail):
        index: int | None = None
        field_path: str | None = None
        if (m := _TASK_PATH.match(path)) is not None:
            index, field_path = int(m.group(1)), m.group(2)
        elif not path and (m := _TASK_TEXT.match(msg)) is not None:
            index, field_path, msg = int(m.group(1)), m.group(2), m.group(3)
        if index is None:
            problems.append(f"{path}: {msg}" if path else msg)
            continue
        where = f"task {index}"
        if line_numbers is not None and 0 <= index < len(line_numbers):
            line = line_numbers[index]
            where = f"{source}:{line}" if source else f"line {line}"
        problems.append(f"{where}: {field_path}: {msg}" if field_path else f"{where}: {msg}")
    return SubmitInputError(problems or [str(error)])


def _counts_text(counts: Counter[str], rewards: list[float]) -> str:
    parts = [f"[green]{counts.get('completed', 0)} completed[/]"]
    parts.append(f"[red]{counts.get('failed', 0)} failed[/]")
    for status in ("cancelled", "timed_out"):
        if counts.get(status):
            parts.append(f"[yellow]{counts[status]} {status.replace('_', ' ')}[/]")
    if rewards:
        parts.append(f"mean reward {math.fsum(rewards) / len(rewards):.3f}")
    return " · ".join(parts)


def submit_and_collect(
    client: RolloutClient,
    tasks: list[dict[str, Any]],
    *,
    group_size: int,
    out: Path,
    sampling: dict[str, Any] | None = None,
    agent: dict[str, Any] | None = None,
    console: Console | None = None,
    line_numbers: list[int] | None = None,
    source: str | None = None,
) -> BatchSummary:
    """Submit ``tasks`` as one batch, stream every finished trajectory to ``out``, summarize.

    Each trajectory is written as one JSON line as it arrives, to a hidden ``.<out>.partial``
    file beside ``out`` that is renamed to ``out`` once every job is in; on any error (or
    Ctrl-C) the partial file is removed and ``out`` is left as it was. A 422 from the gateway
    raises SubmitInputError naming the JSONL line (``line_numbers[i]`` is task i's line,
    ``source`` the file name). A results stream cut short is reopened (trajectories are
    de-duplicated by job id); jobs still missing once the batch is done are fetched one by one.
    Other gateway failures raise RolloutServiceError; the batch keeps running on the service.
    """
    console = console or Console()
    started = time.monotonic()
    try:
        accepted = client.submit_batch(tasks, group_size=group_size, sampling=sampling, agent=agent)
    except RolloutServiceError as exc:
        if exc.status_code == 422:
            raise input_error_from_422(exc, line_numbers, source) from exc
        raise
    total = len(accepted.jobs)
    console.print(
        f"batch [bold]{accepted.batch_id}[/]: {len(tasks)} tasks x {group_size} = {total} jobs"
    )

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    received: list[Trajectory] = []
    try:
        with partial.open("w", encoding="utf-8") as sink:
            _collect(client, accepted.batch_id, accepted.jobs, sink, received, console)
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise

    summary = summarize(
        accepted.batch_id, received, total, job_order=accepted.jobs, group_size=group_size
    )
    summary.out = out
    summary.elapsed = time.monotonic() - started
    return summary


def _collect(
    client: RolloutClient,
    batch_id: str,
    jobs: Sequence[str],
    sink: TextIO,
    received: list[Trajectory],
    console: Console,
) -> None:
    """Stream the batch's results into ``sink`` until every job in ``jobs`` is in."""
    pending = set(jobs)
    seen: set[str] = set()
    counts: Counter[str] = Counter()
    rewards: list[float] = []
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        bar = progress.add_task("jobs", total=len(jobs), counts=_counts_text(counts, rewards))

        def take(trajectory: Trajectory) -> None:
            if trajectory.job_id in seen:
                return
            seen.add(trajectory.job_id)
            pending.discard(trajectory.job_id)
            sink.write(trajectory.model_dump_json() + "\n")
            sink.flush()
            received.append(trajectory)
            counts[str(trajectory.status)] += 1
            if trajectory.reward is not None:
                rewards.append(trajectory.reward)
            progress.update(bar, completed=len(received), counts=_counts_text(counts, rewards))

        idle = 0
        while pending:
            before = len(seen)
            try:
                for trajectory in client.iter_batch_results(batch_id):
                    take(trajectory)
            except RolloutServiceError as exc:
                if exc.status_code is not None:
                    raise
                # The connection broke; reopened below.
            if not pending:
                break
            if client.batch_progress(batch_id).done:
                for job_id in sorted(pending):
                    take(client.get_rollout(job_id))
                break
            idle = 0 if len(seen) > before else idle + 1
            if idle > RECONNECTS:
                raise RolloutServiceError(
                    None,
                    f"the results stream of batch {batch_id} keeps ending with "
                    f"{len(pending)} jobs unfinished",
                )
            time.sleep(min(0.25 * 2**idle, 5.0))


# ------------------------------------------------------------------------------ rendering


def _fmt_reward(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def _fmt_mean(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def render_summary(summary: BatchSummary, console: Console, max_rows: int = 40) -> None:
    """Print the rewards of a batch: per task (up to ``max_rows``), per data source, overall.

    The closing lines give the jobs per status, the mean reward, how many tasks have at
    least one solved sample (pass@k), how many have all samples solved, and how many groups
    are informative (rewards not all equal).
    """
    tasks = Table(title=f"batch {summary.batch_id}: rewards per task", title_justify="left")
    tasks.add_column("#", justify="right", style="dim")
    tasks.add_column("instance_id", overflow="fold")
    tasks.add_column("data_source")
    tasks.add_column("rewards")
    tasks.add_column("mean", justify="right")
    for i, row in enumerate(summary.per_task[:max_rows]):
        shown = " ".join(_fmt_reward(r) for r in row.rewards[:16])
        if len(row.rewards) > 16:
            shown += f" … (+{len(row.rewards) - 16})"
        tasks.add_row(str(i), row.instance_id, row.data_source, shown, _fmt_mean(row.mean))
    if len(summary.per_task) > max_rows:
        hidden = len(summary.per_task) - max_rows
        where = f" (all in {summary.out})" if summary.out else ""
        tasks.add_row("…", f"{hidden} more tasks{where}", "", "", "")
    console.print(tasks)

    sources = Table(title="per data source", title_justify="left")
    sources.add_column("data_source")
    sources.add_column("jobs", justify="right")
    sources.add_column("mean reward", justify="right")
    for source, (n, source_mean) in summary.per_source.items():
        sources.add_row(source, str(n), _fmt_mean(source_mean))
    console.print(sources)

    statuses: list[str] = [s.value for s in JobStatus if summary.by_status.get(s.value)]
    statuses += sorted(set(summary.by_status) - set(statuses))
    status_text = ", ".join(f"{summary.by_status[s]} {s}" for s in statuses) or "none"
    n_tasks = len(summary.per_task)
    k = summary.group_size
    mean = "—" if summary.mean_reward is None else f"{summary.mean_reward:.4f}"
    console.print(f"jobs: {summary.received}/{summary.total} ({status_text})")
    console.print(f"mean reward: [bold]{mean}[/]")
    console.print(
        f"pass@{k}: {summary.solved_any}/{n_tasks} tasks with a solved sample · "
        f"all {k} solved: {summary.solved_all}/{n_tasks} · "
        f"informative groups: {summary.informative}/{n_tasks}"
    )
    if summary.out is not None:
        console.print(f"trajectories: {summary.out} ({summary.elapsed:.1f} s)")


def render_status(stats: Stats, backends: list[Backend], console: Console) -> None:
    """Print the fleet: queues with waiting/busy/workers, jobs per status, throughput, backends."""
    queues = Table(title="queues", title_justify="left")
    queues.add_column("queue")
    queues.add_column("waiting", justify="right")
    queues.add_column("busy", justify="right")
    queues.add_column("workers", justify="right")
    present: set[str] = {*stats.queues, *stats.busy, *stats.workers}
    names = [n for n in STAGE_ORDER if n in present]
    names += sorted(present - set(names))
    for name in names:
        workers = stats.workers.get(name, 0)
        queues.add_row(
            name,
            str(stats.queues.get(name, 0)),
            str(stats.busy.get(name, 0)),
            str(workers) if workers else "[red]0[/]",
        )
    console.print(queues)

    statuses: list[str] = [s.value for s in JobStatus if s.value in stats.jobs]
    statuses += sorted(set(stats.jobs) - set(statuses))
    jobs = ", ".join(f"{stats.jobs[s]} {s}" for s in statuses) or "none yet"
    console.print(f"jobs: {jobs}")
    console.print(
        f"throughput: {stats.throughput_per_s:.2f} jobs/s · "
        f"{stats.completed_last_minute} completed in the last minute"
    )

    if not backends:
        console.print(
            "[yellow]no inference backend registered[/]: `rollserve up` starts the development "
            "one, or register a server with POST /v1/backends"
        )
        return
    table = Table(title="backends", title_justify="left")
    table.add_column("id")
    table.add_column("kind")
    table.add_column("model")
    table.add_column("url", overflow="fold")
    table.add_column("policy", justify="right")
    table.add_column("in flight", justify="right")
    for backend in backends:
        table.add_row(
            backend.id,
            backend.kind,
            backend.model,
            backend.url,
            "—" if backend.policy_version is None else str(backend.policy_version),
            str(backend.in_flight),
        )
    console.print(table)
