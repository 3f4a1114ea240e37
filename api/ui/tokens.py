"""The token record of a trajectory as the viewer shows it: every id of `prompt_ids` and
`response_ids`, whether the loss counts it (generated) or not (prompt, template, observation),
its logprob, the policy version of the turn it belongs to and, when the job's tokenizer can
be loaded in the gateway, its text."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from core.schemas import Backend, ModelTurn, Trajectory

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


def turn_of_positions(trajectory: Trajectory) -> list[tuple[int | None, int | None]] | None:
    """For each id of `prompt_ids + response_ids`: (turn index, policy version), from the
    turns; None when the turns do not add up to the flattened record."""
    spans: list[tuple[int | None, int | None]] = []
    for index, turn in enumerate(trajectory.turns):
        if isinstance(turn, ModelTurn):
            spans += [(index, turn.policy_version)] * (len(turn.prompt_ids) + len(turn.output_ids))
        else:
            spans += [(index, None)] * len(turn.observation_ids)
    if len(spans) != len(trajectory.prompt_ids) + len(trajectory.response_ids):
        return None
    return spans


def token_slice(trajectory: Trajectory, start: int, count: int) -> list[Token]:
    """Tokens `start` to `start + count` of the record (prompt first, then the response)."""
    prompt = len(trajectory.prompt_ids)
    ids = trajectory.prompt_ids + trajectory.response_ids
    spans = turn_of_positions(trajectory)
    tokens = []
    for index in range(max(0, start), min(len(ids), start + count)):
        r = index - prompt
        generated = r >= 0 and r < len(trajectory.loss_mask) and trajectory.loss_mask[r] == 1
        logprob = trajectory.logprobs[r] if 0 <= r < len(trajectory.logprobs) else None
        turn, version = spans[index] if spans else (None, trajectory.policy_version)
        tokens.append(Token(index, ids[index], generated, logprob, version, turn))
    return tokens


def shade(logprob: float | None) -> float:
    """Opacity of a generated token's shading: 1 for a certain token, fading as the logprob
    falls (0.15 at -10 and below)."""
    if logprob is None:
        return 0.0
    return round(max(0.15, min(1.0, 1.0 + logprob / 10.0 * 0.85)), 3)


def tokenizer_source(backend: Backend | None, known: Sequence[Path] = ()) -> str | None:
    """A local tokenizer directory of the job's backend: its `tokenizer` or `model` when that
    is a directory, else one of the `known` model directories (the development server's tiny
    model) whose name is the backend's model name."""
    if backend is None:
        return None
    for name in (backend.tokenizer, backend.model):
        if name and Path(name).is_dir():
            return name
    for directory in known:
        if directory.name == backend.model and directory.is_dir():
            return str(directory)
    return None


@lru_cache(maxsize=4)
def load_tokenizer(source: str) -> Any:
    """The tokenizer in a local directory, or None when transformers cannot load it here."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception:  # not installed in the gateway's environment, or not a tokenizer
        log.info("the console cannot load the tokenizer at %s; showing ids only", source)
        return None


def decode(tokens: list[Token], tokenizer: Any) -> None:
    """Fill in each token's text with `tokenizer` (one id at a time, as it was generated)."""
    for token in tokens:
        token.text = tokenizer.decode([token.id])
