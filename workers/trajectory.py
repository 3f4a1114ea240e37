"""Builds the token record of one job: turns as they happen, flattened for the loss."""

from __future__ import annotations

from typing import Any

from core.schemas import EnvTurn, ModelTurn, Trajectory


class TrajectoryBuilder:
    """Appends ids only: the first prompt, then model outputs and observations in order.

    `sequence` is exactly what the next model call receives; `response_ids`, `loss_mask` and
    `logprobs` stay aligned (mask 1 and a logprob on generated ids, mask 0 and None elsewhere).
    """

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float | None] = []
        self.turns: list[ModelTurn | EnvTurn] = []
        self._pending_prompt: list[int] = list(prompt_ids)
        self.llm_seconds = 0.0
        self.tool_seconds = 0.0
        self.malformed_tool_calls = 0

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def sequence_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def assistant_texts(self) -> list[str]:
        return [t.text for t in self.turns if isinstance(t, ModelTurn)]

    @property
    def model_turns(self) -> int:
        return sum(1 for t in self.turns if isinstance(t, ModelTurn))

    def add_model_turn(
        self,
        output_ids: list[int],
        logprobs: list[float],
        text: str,
        finish_reason: str | None,
        llm_seconds: float,
        tool_calls: list[dict[str, Any]] | None = None,
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
        )
        self._pending_prompt = []
        self.turns.append(turn)
        self.response_ids.extend(output_ids)
        self.loss_mask.extend([1] * len(output_ids))
        self.logprobs.extend(logprobs)
        self.llm_seconds += llm_seconds
        return turn

    def add_env_turn(
        self, observation_ids: list[int], text: str, tool_seconds: float = 0.0
    ) -> EnvTurn:
        turn = EnvTurn(observation_ids=list(observation_ids), text=text, tool_seconds=tool_seconds)
        self.turns.append(turn)
        self._pending_prompt = self._pending_prompt + list(observation_ids)
        self.response_ids.extend(observation_ids)
        self.loss_mask.extend([0] * len(observation_ids))
        self.logprobs.extend([None] * len(observation_ids))
        self.tool_seconds += tool_seconds
        return turn

    def fill(self, trajectory: Trajectory) -> Trajectory:
        """Copy the token record into `trajectory` (ids and status fields are the caller's)."""
        trajectory.turns = list(self.turns)
        trajectory.prompt_ids = list(self.prompt_ids)
        trajectory.response_ids = list(self.response_ids)
        trajectory.loss_mask = list(self.loss_mask)
        trajectory.logprobs = list(self.logprobs)
        trajectory.timing.llm = self.llm_seconds
        trajectory.timing.tools = self.tool_seconds
        trajectory.tool_calls = sum(len(t.tool_calls) for t in self.turns if t.type == "model")
        trajectory.malformed_tool_calls = self.malformed_tool_calls
        return trajectory
