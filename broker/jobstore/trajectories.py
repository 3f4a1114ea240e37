"""Trajectories in the job store: written turn by turn while a job runs, moved to the results
store when it ends.

A running job's trajectory is three keys: its head (`{p}traj:{id}`, the small fields as JSON:
status, stop reason, outcome, timing...), its turns (`{p}turns:{id}`, a list with one JSON
entry per turn) and their digests (`{p}sums:{id}`, 8 bytes per turn). A save sends the
digests of all its turns but the JSON only of those the store lacks; `lua/lib.lua`'s
`sync_turns` keeps the stored turns whose digests match, cuts the rest and appends the new
ones. Each turn is so written once — again only if it changed or the episode started over;
a model turn's `turn_seconds`, set after its reply is added, is kept in the head — and what a
job writes to Redis grows with its length, not with its length squared. The flattened arrays
(`prompt_ids`, `response_ids`, `loss_mask`, `logprobs`) are never stored while the job runs:
they are derived from the turns (`core.flatten`) when the trajectory is read, and once at the
end for the results store.

At the end the final trajectory goes to the results store (`broker.resultstore`) as one JSON
line, and Redis keeps only the job's record with the line's location (`lua/offload.lua`). Once the
trajectory was delivered — `GET /v1/rollouts/{id}` returned it finished, or a batch's result
stream went past it — the record lives `stub_ttl` seconds more (`lua/deliver.lua`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import Any

from pydantic import TypeAdapter, ValidationError
from redis.commands.core import Script

from broker.jobstore.base import TERMINAL, StoreBase, text
from core.flatten import derivable, fill_flat
from core.schemas import ModelTurn, Trajectory, Turn

log = logging.getLogger(__name__)

TURN: TypeAdapter[Turn] = TypeAdapter(Turn)

FLAT = {"prompt_ids", "response_ids", "loss_mask", "logprobs", "segments"}
"""The flattened arrays: derived from the turns, not stored while the job runs."""

TURN_SECONDS = "turn_seconds"
"""The head's list of the model turns' `turn_seconds`, in order."""

KNOWN_JOBS = 1024
"""Jobs whose turns a store object remembers as written (the oldest is forgotten first)."""

OFFLOAD_GRACE = 30.0
"""Seconds after a job's end before a reader moves its trajectory to the results store in
place of a finisher that died before it could (the finisher normally does it at once)."""


def digest(entry: bytes) -> bytes:
    """The 8-byte digest of a turn's JSON entry."""
    return hashlib.blake2b(entry, digest_size=8).digest()


class _Written:
    """What this process last wrote of one job's turns: the turn objects and their digests."""

    __slots__ = ("sums", "turns")

    def __init__(self, turns: list[Any], sums: list[bytes]) -> None:
        self.turns = turns
        self.sums = sums


class Trajectories(StoreBase):
    """Saving trajectories turn by turn, reading them back, and moving finished ones out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._written: OrderedDict[str, _Written] = OrderedDict()

    def _known(self) -> OrderedDict[str, _Written]:
        return self._written

    # ------------------------------------------------------------------ encoding
    @staticmethod
    def head_json(trajectory: Trajectory) -> str:
        """The trajectory's small fields as JSON; with its flattened arrays only when they
        are not those of its turns (a trajectory not made by the agent loop's builder), and
        the model turns' `turn_seconds`, which are set after a turn is saved and so are kept
        here rather than in the turns' entries (a turn entry is then written once)."""
        exclude = {"turns", *FLAT} if derivable(trajectory) else {"turns"}
        head = trajectory.model_dump_json(exclude=exclude)
        seconds = [t.turn_seconds for t in trajectory.turns if isinstance(t, ModelTurn)]
        if not seconds:
            return head
        return f'{head[:-1]},"{TURN_SECONDS}":{json.dumps(seconds)}}}'

    @staticmethod
    def entry(turn: Any) -> bytes:
        """A turn's entry in the list of turns: its JSON, a model turn's without its
        `turn_seconds` (in the head)."""
        if isinstance(turn, ModelTurn):
            return turn.model_dump_json(exclude={"turn_seconds"}).encode()
        return bytes(turn.model_dump_json().encode())

    def _encode(self, job_id: str, turns: list[Any]) -> tuple[list[bytes], dict[int, bytes]]:
        """The digests of all `turns`, and the JSON entries computed on the way. A turn this
        process wrote before, as the same object and not the last one written, keeps its
        digest unserialised: only the last turn of a save may change afterwards."""
        known = self._known().get(job_id)
        sums: list[bytes] = []
        entries: dict[int, bytes] = {}
        for i, turn in enumerate(turns):
            if known is not None and i < len(known.turns) - 1 and known.turns[i] is turn:
                sums.append(known.sums[i])
                continue
            entries[i] = self.entry(turn)
            sums.append(digest(entries[i]))
        return sums, entries

    def _sync(
        self,
        script: Script,
        keys: list[str],
        args: list[Any],
        job_id: str,
        trajectory: Trajectory,
        tail: list[Any] | None = None,
    ) -> list[Any]:
        """Run `script` (save_partial or finish) with the arguments `args`, the trajectory's
        head, `tail`, then the digests of its turns, the index of the first turn sent and the
        turns from there on (those the store lacks); sends more turns if the script asks."""
        turns = list(trajectory.turns)
        sums, entries = self._encode(job_id, turns)
        known = self._known().get(job_id)
        if known is not None:
            start = 0
            while start < min(len(known.sums), len(sums)) and known.sums[start] == sums[start]:
                start += 1
        else:  # a guess: the usual save adds a turn and may replace the one before it
            start = max(0, len(turns) - 2)
        head = self.head_json(trajectory)
        while True:
            sent = [entries.get(i) or self.entry(turns[i]) for i in range(start, len(turns))]
            result = script(
                keys=keys, args=[*args, head, *(tail or []), b"".join(sums), start, *sent]
            )
            if int(result[0]) == 2 and int(result[1]) < start:
                start = int(result[1])  # the store holds fewer of these turns than guessed
                continue
            break
        cache = self._known()
        if int(result[0]) == 1:
            cache[job_id] = _Written(turns, sums)
            cache.move_to_end(job_id)
            while len(cache) > KNOWN_JOBS:
                cache.popitem(last=False)
        else:
            cache.pop(job_id, None)
        return list(result)

    # ------------------------------------------------------------------ writes
    def save_partial(self, job_id: str, trajectory: Trajectory) -> bool:
        """Store the trajectory so far, unless the job has finished meanwhile: the turns the
        store lacks (and the last one, if it changed) and the head, never the flattened
        arrays (see the module docstring)."""
        result = self._sync(
            self._save_partial,
            [self._job(job_id), self._traj(job_id), self._turns(job_id), self._sums(job_id)],
            [TERMINAL, self.ttl],
            job_id,
            trajectory,
        )
        return int(result[0]) == 1

    def offload(self, job_id: str, trajectory: Trajectory, finished_at: float) -> str | None:
        """Move an ended job's final trajectory to the results store: written there as one
        JSON line (with its flattened arrays), then dropped from Redis but for the record,
        which points to it. Returns the location, or None when the results store failed (the
        trajectory stays in Redis, and a later read moves it) or another caller moved it."""
        self._known().pop(job_id, None)
        final = trajectory.model_copy()
        if derivable(final):
            fill_flat(final)
        try:
            location = self.results.put(
                job_id, final.batch_id, final.model_dump_json().encode(), finished_at
            )
        except Exception:  # the results store is down or full: Redis keeps it meanwhile
            log.exception("job %s: its trajectory stays in Redis (results store failed)", job_id)
            return None
        moved = self._offload(
            keys=[self._job(job_id), self._traj(job_id), self._turns(job_id), self._sums(job_id)],
            args=[location, TERMINAL, self.stub_ttl],
        )
        return location if int(moved) == 1 else None

    def delivered(self, job_id: str) -> None:
        """The job's finished trajectory was delivered: its record (a stub pointing to the
        results store) lives `stub_ttl` seconds more. Nothing for a job that has not ended."""
        self._deliver(keys=[self._job(job_id)], args=[TERMINAL, self.stub_ttl])

    # ------------------------------------------------------------------ reads
    def stored_trajectory(self, job_id: str) -> Trajectory | None:
        """The trajectory as Redis holds it (head and turns, the flattened arrays derived), or
        None when it holds none (never saved, or moved to the results store)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.get(self._traj(job_id))
        pipe.lrange(self._turns(job_id), 0, -1)
        head, entries = pipe.execute()
        if head is None:
            return None
        fields = json.loads(head)
        seconds = fields.pop(TURN_SECONDS, [])
        trajectory = Trajectory.model_validate(fields)
        if entries:
            trajectory.turns = [TURN.validate_json(e) for e in entries]
            models = (t for t in trajectory.turns if isinstance(t, ModelTurn))
            for turn, value in zip(models, seconds, strict=False):
                turn.turn_seconds = value
        if trajectory.turns and not any(getattr(trajectory, name) for name in FLAT):
            fill_flat(trajectory)
        return trajectory

    def stored_result(self, job_id: str, location: str | None) -> Trajectory | None:
        """The finished trajectory from the results store: at `location`, else found by id."""
        raw = self.results.read(location) if location else None
        if raw is None:
            raw = self.results.find(job_id)
        if raw is None:
            return None
        try:
            return Trajectory.model_validate_json(raw)
        except ValidationError:
            log.warning("job %s: its line in the results store does not parse", job_id)
            return None

    # ------------------------------------------------------------------ measurements
    def stored_bytes(self, job_id: str) -> int:
        """Bytes of Redis memory the job takes now: its record and its trajectory's keys
        (`MEMORY USAGE`, exact)."""
        keys = (self._job(job_id), self._traj(job_id), self._turns(job_id), self._sums(job_id))
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.memory_usage(key, samples=0)
        return sum(int(n or 0) for n in pipe.execute())

    def written_bytes(self, job_id: str) -> int:
        """Bytes of trajectory the job has written to Redis so far: turn entries, digests and
        heads, as the scripts counted them (0 for an unknown job)."""
        return int(text(self.r.hget(self._job(job_id), "bytes_written") or 0))


def offload_due(status_terminal: bool, finished_at: float | None, has_result: bool) -> bool:
    """Whether a reader should move an ended job's trajectory to the results store itself:
    its finisher has not, `OFFLOAD_GRACE` seconds after the end."""
    return (
        status_terminal
        and not has_result
        and finished_at is not None
        and time.time() - finished_at > OFFLOAD_GRACE
    )
