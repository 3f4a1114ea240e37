"""Restarts the children of a stack that die, with capped exponential backoff.

A thread polls the stack's children; each death is logged (which child, its exit code or
signal, the attempt) and the child is started again after a delay that doubles with every
death in a row, up to a cap. A child that keeps dying soon after each start is reported at
error level and retried at the cap, never in a tight loop; one that ran for a while starts
over at the shortest delay.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    """How long to wait before restarting a child that died."""

    first: float = 0.5
    """Seconds before the first restart after a death."""
    cap: float = 30.0
    """Longest wait between restarts."""
    stable_after: float = 60.0
    """A child that ran this long before dying counts as healthy: its next wait is `first`."""
    loud_after: int = 5
    """Deaths in a row (each soon after its start) after which the child is reported as
    failing at error level."""

    def delay(self, attempt: int) -> float:
        """Seconds before restart number `attempt` (1, 2, ...) of a run of quick deaths."""
        return float(min(self.cap, self.first * 2 ** max(0, attempt - 1)))


def describe_exit(code: int) -> str:
    """`exit code 1` or `signal SIGKILL` for a Popen return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


@dataclass
class _ChildState:
    started: float
    attempt: int = 0
    due: float | None = None
    """When the pending restart is due; None while the child runs."""


@dataclass
class Supervisor:
    """Watches children through two callbacks and restarts the dead ones.

    `dead()` names the children that have ended, with their return codes; `restart(name)`
    reaps what is left of one and starts it again (it may raise: that counts as another
    death). `pause()` stops all restarts and waits for one under way to finish; call it
    before stopping the children, so nothing comes back during shutdown.
    """

    dead: Callable[[], dict[str, int]]
    restart: Callable[[str], None]
    backoff: Backoff = field(default_factory=Backoff)
    interval: float = 0.25
    """Seconds between polls."""
    _states: dict[str, _ChildState] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _paused: bool = field(default=False, init=False)
    _stopping: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    restarts: int = field(default=0, init=False)
    """Restarts made so far (all children)."""

    def start(self) -> None:
        """Start watching (in a daemon thread); a second call does nothing."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="stack-supervisor", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """No restart from now on; returns once a restart under way has finished."""
        with self._lock:
            self._paused = True

    def stop(self) -> None:
        """Pause and end the thread; safe to call twice."""
        self.pause()
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self._tick()
            except Exception:  # a bug here must not end supervision
                log.exception("supervisor: checking the children failed")

    def _tick(self) -> None:
        now = time.monotonic()
        for name, code in self.dead().items():
            state = self._states.setdefault(name, _ChildState(started=0.0))
            if state.due is None:
                self._schedule(name, state, describe_exit(code), now)
        for name, state in self._states.items():
            if state.due is None or state.due > time.monotonic():
                continue
            with self._lock:
                if self._paused:
                    return
                try:
                    self.restart(name)
                except Exception as exc:
                    state.started = time.monotonic()
                    self._schedule(name, state, f"restart failed: {exc}", state.started)
                    continue
            state.started, state.due = time.monotonic(), None
            self.restarts += 1
            log.warning("supervisor: restarted %s (attempt %d)", name, state.attempt)

    def _schedule(self, name: str, state: _ChildState, how: str, now: float) -> None:
        quick = state.started > 0 and now - state.started < self.backoff.stable_after
        state.attempt = state.attempt + 1 if quick else 1
        wait = self.backoff.delay(state.attempt)
        state.due = now + wait
        if state.attempt >= self.backoff.loud_after:
            log.error(
                "supervisor: %s keeps dying (%s; %d deaths in a row, each within %.0fs of its "
                "start); restart attempt %d in %.1fs -- see its log",
                name, how, state.attempt, self.backoff.stable_after, state.attempt, wait,
            )  # fmt: skip
        else:
            log.warning(
                "supervisor: %s died (%s); restart attempt %d in %.1fs",
                name, how, state.attempt, wait,
            )  # fmt: skip
