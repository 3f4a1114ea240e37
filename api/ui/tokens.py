"""The token record of a trajectory as the viewer shows it, segment by segment
(`core.flatten.sequences`): every id of a segment's `prompt_ids` and `response_ids`, whether
the loss counts it (generated) or not (prompt, template, observation), its logprob, the policy
version of the turn it belongs to and, when the job's tokenizer can be loaded in the gateway,
its text."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from core.flatten import segments_and_turns, sequences
from core.schemas import SEGMENT_REASONS, Backend, ModelTurn, Trajectory
from routing.sglang import TokenizerRefused, check_tokenizer_name

log = logging.getLogger(__name__)


@dataclass
class Token:
    index: int
    id: int
    generated: bool
    logprob: float | None
    policy_version: int | None
    turn: int | None
    """Index of the turn the id came from (None when the turns do not match the record)."""
    text: str | None = None


@dataclass
class SegmentView:
    """One segment as the viewer heads it."""

    number: int
    """1 for the trajectory's first segment."""
    reason: str
    why: str
    """The reason in words (`core.schemas.SEGMENT_REASONS`)."""
    first_turn: int
    prompt: int
    response: int
    generated: int

    @property
    def total(self) -> int:
        return self.prompt + self.response


def segment_views(trajectory: Trajectory) -> list[SegmentView]:
    """The trajectory's segments, in order, as the viewer heads them."""
    return [
        SegmentView(
            number=number,
            reason=part.reason,
            why=SEGMENT_REASONS.get(part.reason, part.reason),
            first_turn=part.first_turn,
            prompt=len(part.prompt_ids),
            response=len(part.response_ids),
            generated=sum(1 for m in part.loss_mask if m == 1),
        )
        for number, part in enumerate(sequences(trajectory), start=1)
    ]


def turn_of_positions(
    trajectory: Trajectory, segment: int = 1
) -> list[tuple[int | None, int | None]] | None:
    """For each id of the segment's `prompt_ids + response_ids` (`segment` 1: the first):
    (turn index, policy version), from its turns; None when they do not add up to its record.
    Only the segment's first model call brings its prompt: a later call's `prompt_ids` are
    the observations before it, already counted (`core.flatten`)."""
    part, turns = segments_and_turns(trajectory)[segment - 1]
    spans: list[tuple[int | None, int | None]] = []
    for offset, turn in enumerate(turns):
        index = part.first_turn + offset
        if isinstance(turn, ModelTurn):
            prompt = len(turn.prompt_ids) if offset == 0 else 0
            spans += [(index, turn.policy_version)] * (prompt + len(turn.output_ids))
        else:
            spans += [(index, None)] * len(turn.observation_ids)
    if len(spans) != len(part.prompt_ids) + len(part.response_ids):
        return None
    return spans


def token_slice(trajectory: Trajectory, start: int, count: int, segment: int = 1) -> list[Token]:
    """Tokens `start` to `start + count` of a segment's record (`segment` 1: the first; its
    prompt first, then its response)."""
    part = sequences(trajectory)[segment - 1]
    prompt = len(part.prompt_ids)
    ids = part.prompt_ids + part.response_ids
    spans = turn_of_positions(trajectory, segment)
    tokens = []
    for index in range(max(0, start), min(len(ids), start + count)):
        r = index - prompt
        generated = r >= 0 and r < len(part.loss_mask) and part.loss_mask[r] == 1
        logprob = part.logprobs[r] if 0 <= r < len(part.logprobs) else None
        turn, version = spans[index] if spans else (None, trajectory.policy_version)
        tokens.append(Token(index, ids[index], generated, logprob, version, turn))
    return tokens


def shade(logprob: float | None) -> float:
    """Opacity of a generated token's shading: 1 for a certain token, fading as the logprob
    falls (0.15 at -10 and below)."""
    if logprob is None:
        return 0.0
    return round(max(0.15, min(1.0, 1.0 + logprob / 10.0 * 0.85)), 3)


def tokenizer_source(
    backend: Backend | None, known: Sequence[Path] = (), roots: Sequence[Path] = ()
) -> str | None:
    """A local tokenizer directory of the job's backend: its `tokenizer` or `model` when that
    is a directory under one of `roots` (`routing.sglang.tokenizer_roots`: a registration
    never makes the gateway read a directory the operator did not allow), else one of the
    `known` model directories (the development server's tiny model) whose name is the
    backend's model name."""
    if backend is None:
        return None
    for name in (backend.tokenizer, backend.model):
        if name and os.path.isabs(name) and Path(name).is_dir():
            try:
                return check_tokenizer_name(name, roots)
            except TokenizerRefused:
                continue
    for directory in known:
        if directory.name == backend.model and directory.is_dir():
            return str(directory)
    return None


@lru_cache(maxsize=4)
def load_tokenizer(source: str) -> Any:
    """The tokenizer in a local directory, or None when transformers cannot load it here."""
    try:
        from routing.hf_tokenizer import load_tokenizer

        return load_tokenizer(source, local_files_only=True)
    except Exception:  # not installed in the gateway's environment, or not a tokenizer
        log.info("the console cannot load the tokenizer at %s; showing ids only", source)
        return None


def decode(tokens: list[Token], tokenizer: Any) -> None:
    """Fill in each token's text with `tokenizer` (one id at a time, as it was generated)."""
    for token in tokens:
        token.text = tokenizer.decode([token.id])
