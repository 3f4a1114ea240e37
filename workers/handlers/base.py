"""What a task handler is: the contract between a task's `data_source` and the agent loop.

A handler turns a task dict (as the trainer sent it) into the first chat messages, decides
after every assistant turn whether the episode is over, and grades the finished episode.
Handler instances are shared by every job of a worker process and may be called from several
threads at once, so they keep no per-job state; what they read of the configuration (sandbox
backend and directory, time limits) comes from the settings they are given.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from core.settings import Settings, get_settings

if TYPE_CHECKING:
    from sandbox.base import SandboxSpec


class TaskValidationError(ValueError):
    """A task a handler cannot run; `field` names the offending field (dotted inside the task)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class StepResult:
    """What the agent loop does after one assistant turn."""

    done: bool
    """The episode ends after this assistant turn."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """Chat messages to append before the next model call (empty when `done`)."""
    stop_reason: str | None = None
    """Why the episode ended: "answer" when an answer was given."""


@dataclass
class Grade:
    """The reward of a finished episode and how it was reached."""

    reward: float
    details: dict[str, Any]
    """JSON-serialisable: the extracted answer, the gold answer, the method, the reason."""


class ToolSession(Protocol):
    """The job's tool server, as grading sees it (one call at a time)."""

    def call(self, tool: str, **args: Any) -> dict[str, Any]: ...


class Handler(ABC):
    """One kind of task. Subclasses set `name` and implement the four abstract methods."""

    name: ClassVar[str]
    needs_sandbox: ClassVar[bool] = False
    """INIT starts a sandbox (`sandbox_spec`) with a tool server for the agent."""
    grades_in_sandbox: ClassVar[bool] = False
    """EVAL grades in the job's own sandbox, so EVAL runs on that sandbox's host; otherwise
    the sandbox is stopped at the end of RUN (after `collect_outcome`) and EVAL runs anywhere."""

    _settings: Settings | None = None

    def __init__(self, *, settings: Settings | None = None) -> None:
        """`settings`: what the handler reads its configuration from (None: the process's)."""
        self._settings = settings

    @property
    def settings(self) -> Settings:
        """The settings the handler was made with; for one made without (the registry's,
        a plugin's), the process's `ROLLSERVE_*` settings as they are when it asks."""
        return self._settings if self._settings is not None else get_settings()

    @abstractmethod
    def validate(self, task: dict[str, Any]) -> None:
        """Raise `TaskValidationError` naming the field if `task` cannot be run; else return."""

    @abstractmethod
    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat messages the first model call sees (`task` has passed `validate`)."""

    def sandbox_spec(self, task: dict[str, Any], job_id: str) -> SandboxSpec | None:
        """The sandbox INIT starts for the job (when `needs_sandbox`); None for no sandbox."""
        return None

    def prepare(self, task: dict[str, Any], tools: ToolSession) -> None:
        """Set the sandbox up for the task once its tool server is ready (INIT)."""
        return None

    def tools(self, task: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Tool schemas (OpenAI function format) offered to the model; None for no tools."""
        return None

    def warm_up(self) -> None:
        """Load what grading needs ahead of the first job; a worker calls it once, before
        its pool forks, so every pool process starts warm."""
        return None

    @abstractmethod
    def step(self, task: dict[str, Any], assistant_text: str, turn: int) -> StepResult:
        """Decide what follows the assistant turn `assistant_text` (`turn` counts from 0)."""

    def collect_outcome(self, task: dict[str, Any], tools: ToolSession) -> dict[str, Any]:
        """What the episode produced in its sandbox (e.g. a `patch`), taken at the end of RUN
        while the sandbox still runs; JSON-serialisable; it reaches `grade` and the trainer."""
        return {}

    @abstractmethod
    def grade(
        self,
        task: dict[str, Any],
        assistant_texts: list[str],
        tools: ToolSession | None = None,
        outcome: dict[str, Any] | None = None,
        *,
        job_id: str,
    ) -> Grade:
        """Grade an episode from every assistant turn's text in order (possibly none), and the
        `outcome` collected at the end of RUN; with `grades_in_sandbox` the job's tool server
        comes as `tools`. A box started to grade in carries `job_id`, the job's id, so the
        reaper takes it if the grader dies (see `workers.handlers.gradingbox`)."""


# ----------------------------------------------------------------------------- text helpers


# Chat-template control tokens such as <|im_end|>: servers keep them in the text when asked
# not to skip special tokens, and they are never part of an answer.
_CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>")


def visible_text(text: str) -> str:
    """The part of an assistant turn outside its reasoning block, without control tokens.

    Text after the last `</think>` when there is one; when a `<think>` block was opened and
    never closed (the turn was cut off while reasoning), only the text before it.
    """
    text = _CONTROL_TOKEN.sub("", text)
    close = text.rfind("</think>")
    if close >= 0:
        return text[close + len("</think>") :]
    opened = text.find("<think>")
    return text[:opened] if opened >= 0 else text


@dataclass(frozen=True)
class Boxed:
    """One `\\boxed{...}` (or `\\fbox{...}`) in a text: where it starts and what it holds."""

    start: int
    content: str


_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)\s*")


def find_boxed(text: str) -> list[Boxed]:
    """Every balanced `\\boxed{...}` / `\\fbox{...}` in `text`, in order of appearance.

    Also accepts the brace-less form `\\boxed 5` (up to the next space or `$`). A box whose
    braces never close is ignored.
    """
    found: list[Boxed] = []
    for match in _BOX_COMMAND.finditer(text):
        start, pos = match.start(), match.end()
        if pos < len(text) and text[pos] == "{":
            depth = 0
            for end in range(pos, len(text)):
                if text[end] == "{" and text[end - 1] != "\\":
                    depth += 1
                elif text[end] == "}" and text[end - 1] != "\\":
                    depth -= 1
                    if depth == 0:
                        found.append(Boxed(start, text[pos + 1 : end].strip()))
                        break
        elif match.group().endswith(" "):
            bare = re.match(r"[^\s$]+", text[pos:])
            if bare:
                found.append(Boxed(start, bare.group()))
    return found


def required_text(task: Mapping[str, Any], key: str) -> str:
    """`task[key]` as a non-blank string, or a `TaskValidationError` naming `key`."""
    if key not in task or task[key] is None:
        raise TaskValidationError(key, "is required")
    return _text_field(task, key)


def first_text(task: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    """The first of `keys` present in `task`, as a non-blank string; the error names the key
    that is wrong, or the first key (with the others as alternatives) when none is present."""
    for key in keys:
        if task.get(key) is not None:
            return _text_field(task, key)
    others = ", ".join(keys[1:])
    raise TaskValidationError(keys[0], f"is required (or {others})" if others else "is required")


def _text_field(task: Mapping[str, Any], key: str) -> str:
    value = task[key]
    if not isinstance(value, str):
        raise TaskValidationError(key, f"must be a string, not {type(value).__name__}")
    if not value.strip():
        raise TaskValidationError(key, "must not be blank")
    return value
