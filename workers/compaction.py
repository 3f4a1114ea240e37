"""What the agent loop keeps to compact its context (`core.schemas.Compaction`).

When the replies to a turn would take the sequence past the threshold, the loop appends them
with the summary instruction and asks the policy for a summary (a model turn like any other:
its ids and logprobs are recorded and trained on), then renders a new prompt from the task's first
messages, the summary (as a user message) and the most recent turns, and goes on from it as a
new segment (reason `compaction`). Every segment holds exactly the ids its calls were sent and
generated, so nothing trained on was re-encoded. The recent turns kept are as many as
`keep_turns` allows while the new prompt stays under the threshold (none, if even the task
and the summary do not); a segment that would not fit the model's context ends the episode
`context_length`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from core.schemas import Compaction

COMPACTION = "compaction"
"""The reason of a segment the loop's compaction begins (`core.schemas.SEGMENT_REASONS`)."""
SUMMARY_PREFIX = "A summary of your work on this task so far, in your own words:\n\n"
"""What precedes the summary in the message that carries it into the new segment."""


class Compactor:
    """The turns since the last compaction and when the next one is due."""

    def __init__(self, plan: Compaction, first_messages: list[dict[str, Any]]) -> None:
        self.plan = plan
        self.first_messages = list(first_messages)
        self.exchanges: list[list[dict[str, Any]]] = []
        """Each model turn since the last compaction: its reply and the replies to it."""

    def due(self, builder_like: Any, more: int) -> bool:
        """Whether to compact instead of appending `more` ids of replies: the sequence would
        pass the threshold, and a turn was taken since the last compaction (so a task too
        long for the threshold cannot loop)."""
        return bool(self.exchanges) and builder_like.sequence_length + more >= self.plan.threshold

    def note(self, exchange: list[dict[str, Any]]) -> None:
        self.exchanges.append(exchange)

    def candidates(self, summary: str) -> Iterator[list[dict[str, Any]]]:
        """The new segment's messages, keeping `keep_turns` recent turns, then fewer."""
        carried = {"role": "user", "content": SUMMARY_PREFIX + summary.strip()}
        keep = min(self.plan.keep_turns, len(self.exchanges))
        for kept in range(keep, -1, -1):
            recent = [m for ex in self.exchanges[len(self.exchanges) - kept :] for m in ex]
            yield [*self.first_messages, carried, *(recent if kept else [])]

    def compacted(self) -> None:
        self.exchanges = []
