"""Builds the token record of one job: turns as they happen, flattened for the loss."""

from __future__ import annotations

from typing import Any

from core.flatten import Flat
from core.schemas import EnvTurn, ModelTurn, Segment, Trajectory


class _Open:
    """One segment being built: its flat arrays and where it began."""

    def __init__(self, prompt_ids: list[int], reason: str, first_turn: int) -> None:
        self.flat = Flat(list(prompt_ids), [], [], [])
        self.reason = reason
        self.first_turn = first_turn

    def as_segment(self, turns: list[ModelTurn | EnvTurn]) -> Segment:
        """The segment, its policy versions read from its model turns (`turns`: its own)."""
        return Segment(
            reason=self.reason,
            first_turn=self.first_turn,
            prompt_ids=list(self.flat.prompt_ids),
            response_ids=list(self.flat.response_ids),
            loss_mask=list(self.flat.loss_mask),
            logprobs=list(self.flat.logprobs),
            policy_versions=[t.policy_version for t in turns if isinstance(t, ModelTurn)],
        )


class TrajectoryBuilder:
    """Appends ids only: a segment's prompt, then model outputs and observations in order.

    `sequence` is exactly what the next model call receives: the current segment's prompt and
    every id after it. `response_ids`, `loss_mask` and `logprobs` are the current segment's
    and stay aligned (mask 1 and a logprob on generated ids, mask 0 and None elsewhere).
    `start_segment` begins a new segment whose prompt the next model call gets whole.
    """

    def __init__(self, prompt_ids: list[int]) -> None:
        self.turns: list[ModelTurn | EnvTurn] = []
        self._segments = [_Open(prompt_ids, "start", 0)]
        self._pending_prompt: list[int] = list(prompt_ids)
        self._pending_reason: str | None = None
        self.llm_seconds = 0.0
        self.tool_seconds = 0.0
        self.malformed_tool_calls = 0

    @classmethod
    def restored(cls, turns: list[ModelTurn | EnvTurn]) -> TrajectoryBuilder:
        """The builder that recorded `turns` (a saved episode's, first one a model call),
        rebuilt by recording them again; `ValueError` when they are not such a record."""
        if not turns or not isinstance(turns[0], ModelTurn):
            raise ValueError("a saved episode begins with a model call")
        builder = cls(turns[0].prompt_ids)
        for turn in turns:
            if isinstance(turn, EnvTurn):
                builder.add_env_turn(turn.observation_ids, turn.text, turn.tool_seconds)
                continue
            if turn.segment_start is not None:
                builder.start_segment(turn.prompt_ids, turn.segment_start)
            if builder._pending_prompt != turn.prompt_ids:
                raise ValueError(f"turn {len(builder.turns)}'s prompt does not follow the turns")
            again = builder.add_model_turn(
                turn.output_ids,
                turn.logprobs,
                turn.text,
                turn.finish_reason,
                turn.llm_seconds,
                turn.tool_calls,
                backend_id=turn.backend_id,
                policy_version=turn.policy_version,
            )
            again.turn_seconds = turn.turn_seconds
        return builder

    @property
    def _current(self) -> Flat:
        return self._segments[-1].flat

    @property
    def prompt_ids(self) -> list[int]:
        return self._current.prompt_ids

    @property
    def response_ids(self) -> list[int]:
        return self._current.response_ids

    @property
    def loss_mask(self) -> list[int]:
        return self._current.loss_mask

    @property
    def logprobs(self) -> list[float | None]:
        return self._current.logprobs

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def sequence_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def total_response_length(self) -> int:
        """Ids after the prompt, over every segment (what `agent.max_total_tokens` bounds)."""
        return sum(len(s.flat.response_ids) for s in self._segments)

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    @property
    def assistant_texts(self) -> list[str]:
        return [t.text for t in self.turns if isinstance(t, ModelTurn)]

    @property
    def model_turns(self) -> int:
        return sum(1 for t in self.turns if isinstance(t, ModelTurn))

    def start_segment(self, prompt_ids: list[int], reason: str) -> None:
        """Begin a new segment whose prompt is `prompt_ids` (why: `reason`, one of
        `core.schemas.SEGMENT_REASONS`). Before any model call, the first segment's prompt is
        replaced instead."""
        if not self.turns:
            self._segments = [_Open(prompt_ids, "start", 0)]
            self._pending_prompt = list(prompt_ids)
            return
        self._segments.append(_Open(prompt_ids, reason, len(self.turns)))
        self._pending_prompt = list(prompt_ids)
        self._pending_reason = reason

    def add_model_turn(
        self,
        output_ids: list[int],
        logprobs: list[float],
        text: str,
        finish_reason: str | None,
        llm_seconds: float,
        tool_calls: list[dict[str, Any]] | None = None,
        *,
        backend_id: str | None = None,
        policy_version: int | None = None,
    ) -> ModelTurn:
        if len(output_ids) != len(logprobs):
            raise ValueError(f"{len(output_ids)} output ids but {len(logprobs)} logprobs")
        turn = ModelTurn(
            prompt_ids=self._pending_prompt,
            output_ids=list(output_ids),
            logprobs=list(logprobs),
            finish_reason=finish_reason,
            text=text,
            tool_calls=tool_calls or [],
            llm_seconds=llm_seconds,
            backend_id=backend_id,
            policy_version=policy_version,
            segment_start=self._pending_reason,
        )
        self._pending_prompt = []
        self._pending_reason = None
        self.turns.append(turn)
        current = self._segments[-1]
        current.flat.response_ids.extend(output_ids)
        current.flat.loss_mask.extend([1] * len(output_ids))
        current.flat.logprobs.extend(logprobs)
        self.llm_seconds += llm_seconds
        return turn

    def add_env_turn(
        self, observation_ids: list[int], text: str, tool_seconds: float = 0.0
    ) -> EnvTurn:
        turn = EnvTurn(observation_ids=list(observation_ids), text=text, tool_seconds=tool_seconds)
        self.turns.append(turn)
        self._pending_prompt = self._pending_prompt + list(observation_ids)
        self._current.response_ids.extend(observation_ids)
        self._current.loss_mask.extend([0] * len(observation_ids))
        self._current.logprobs.extend([None] * len(observation_ids))
        self.tool_seconds += tool_seconds
        return turn

    def fill(self, trajectory: Trajectory) -> Trajectory:
        """Copy the token record into `trajectory` (ids and status fields are the caller's)."""
        first = self._segments[0].flat
        trajectory.turns = list(self.turns)
        trajectory.prompt_ids = list(first.prompt_ids)
        trajectory.response_ids = list(first.response_ids)
        trajectory.loss_mask = list(first.loss_mask)
        trajectory.logprobs = list(first.logprobs)
        # A segment begun but not yet called (no turn of its own) is not part of the record.
        later = [s for s in self._segments[1:] if s.first_turn < len(self.turns)]
        ends = [s.first_turn for s in later[1:]] + [len(self.turns)] * bool(later)
        trajectory.segments = [
            s.as_segment(self.turns[s.first_turn : end]) for s, end in zip(later, ends, strict=True)
        ]
        trajectory.timing.llm = self.llm_seconds
        trajectory.timing.tools = self.tool_seconds
        trajectory.tool_calls = sum(len(t.tool_calls) for t in self.turns if t.type == "model")
        trajectory.malformed_tool_calls = self.malformed_tool_calls
        return trajectory
