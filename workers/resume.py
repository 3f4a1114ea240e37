"""Going on with an episode from its last saved turn, after the worker that ran it stopped.

The agent loop saves the trajectory after every model call and after every environment reply
(`workers.agent.run_episode`'s `on_turn`). A worker that takes RUN over from a dead one and
finds turns saved — in the sandbox the job still has, when it has one — rebuilds the loop's
state from them: the ids (`TrajectoryBuilder.restored`), the conversation the next call
continues, the count of calls made. It then goes on: no saved call is made again, and no saved
tool call runs again. Only a last model call whose tool calls may have run without their
results being saved is dropped and made again (what those tools did, if they ran, stays in the
box), as is a last call cut by its `max_tokens` (its bound is not saved); a last call without
tool calls (an answer the handler reads, or calls too malformed to run) is kept and only read
again.

The chat messages are rebuilt from the saved texts, each environment reply as one message (a
turn's tool results joined, as its saved text has them). Messages are rendered only when the
template cannot continue the sequence, and that starts a new segment: the ids trained on stay
exactly the ids the model saw. An episode that began a segment of its own (a rerendered
conversation, or `agent.compaction`'s summary) is not resumed: it starts again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from core.schemas import EnvTurn, ModelTurn, Resume, Trajectory
from workers.conversation import Conversation, Templater
from workers.toolcalls import parse_tool_calls
from workers.trajectory import TrajectoryBuilder

log = logging.getLogger(__name__)


@dataclass
class Restored:
    """The agent loop's state at its last saved turn."""

    builder: TrajectoryBuilder
    reply: dict[str, Any]
    """The last saved call's answer, as the assistant message the conversation continues."""
    messages: list[dict[str, Any]]
    """The messages the loop goes on from: the last call's, with the reply to it when one
    was saved."""
    first_turn: int
    """The index of the next model call (of `pending`, when there is one)."""
    pending: ModelTurn | None
    """A saved last model call whose environment reply is still to be made."""
    resume: Resume
    stored: Trajectory
    """The trajectory as it was saved."""

    def conversation(
        self, templater: Templater, tools: list[dict[str, Any]] | None
    ) -> Conversation:
        """The conversation that recorded the saved turns, going on with `templater`."""
        return Conversation.restored(templater, self.builder, self.messages, tools, self.reply)


def restore(
    stored: Trajectory,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    attempt: int = 0,
) -> Restored | None:
    """The loop's state after the turns of `stored` (an episode begun with `messages` and
    `tools`), or None when nothing can be kept: no model call was saved, or the saved turns
    are not an episode of the built-in loop in one segment."""
    turns = list(stored.turns)
    dropped = 0
    if turns and isinstance(turns[-1], ModelTurn):
        last = turns[-1]
        if last.tool_calls or last.finish_reason == "length":
            turns.pop()
            dropped = 1
    if not any(isinstance(t, ModelTurn) for t in turns):
        return None
    if any(isinstance(t, ModelTurn) and t.segment_start is not None for t in turns):
        return None
    try:
        builder = TrajectoryBuilder.restored(turns)
    except ValueError as exc:
        log.warning("job %s's saved turns cannot be gone on with: %s", stored.job_id, exc)
        return None
    builder.malformed_tool_calls = sum(
        len(parse_tool_calls(t.text).errors) for t in turns if isinstance(t, ModelTurn) and tools
    )
    history = list(messages)
    reply: dict[str, Any] = {}
    last_model: ModelTurn | None = None
    for turn in turns:
        if isinstance(turn, ModelTurn):
            last_model = turn
            reply = {"role": "assistant", "content": turn.text}
            continue
        assert isinstance(turn, EnvTurn) and last_model is not None
        answered_calls = bool(tools) and bool(
            last_model.tool_calls or parse_tool_calls(last_model.text).errors
        )
        history = [*history, reply, {"role": "tool" if answered_calls else "user",
                                     "content": turn.text}]  # fmt: skip
    pending = turns[-1] if isinstance(turns[-1], ModelTurn) else None
    calls = builder.model_turns
    return Restored(
        builder=builder,
        reply=reply,
        messages=history,
        first_turn=calls - 1 if pending is not None else calls,
        pending=pending,
        resume=Resume(
            turn=len(turns),
            dropped_turns=dropped,
            reprefill_ids=builder.sequence_length,
            attempt=attempt,
        ),
        stored=stored,
    )
