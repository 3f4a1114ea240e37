"""A persistent interactive bash behind a pseudo-terminal (ptyprocess).

How a call works: the command is sent as one line, ``eval $'<command>'; printf <sentinel>``,
where the sentinel carries a fresh random token and ``$?``. The shell runs with echo and
output post-processing off, so what comes back is the command's own output followed by the
sentinel, which marks the end and gives the exit code. Because the whole command is one
line that bash has read before running it, a program that reads standard input (``cat``,
``python3``) waits on the terminal instead of swallowing the sentinel; it is then stopped by
the call's timeout. The sentinel is written to ``/dev/tty`` so that a command redirecting
the shell's own output (``exec >log``) cannot hide it.

A line holds at most 4095 bytes in the terminal's canonical mode, so longer commands are
written to a private file and read with the ``read`` builtin instead; the shell evaluates
the same string either way.

On a timeout the session sends Ctrl-C; if the foreground job survives it (an interactive
program catches SIGINT) the job's process group is killed; then a probe sentinel checks
that the shell answers. Only if it does not is the shell replaced, losing its working
directory and environment (``reset`` in the result says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shlex
import shutil
import signal
import tempfile
import termios
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ptyprocess import PtyProcess

from sandbox.toolserver.output import DEFAULT_OUTPUT_LIMIT, CappedBuffer, clean_terminal_output
from sandbox.toolserver.processes import children, descendants, exit_waiter, kill_all, stat

# A typed line must fit the terminal's 4096-byte canonical-mode buffer with room to spare.
_INLINE_LIMIT = 4000
_ANY_SENTINEL = re.compile(rb"\x1eRS[0-9a-f]+:-?\d+\x1e")
_ENV_OVERRIDES = {
    "TERM": "dumb",
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "MANPAGER": "cat",
    "SYSTEMD_PAGER": "",
    "PS1": "",
    "PS2": "",
    "PS0": "",
}
_ENV_REMOVED = ("PROMPT_COMMAND", "BASH_ENV", "ENV", "HISTFILE")
_SETUP = "PS1=''; PS2=''; PS0=''; unset PROMPT_COMMAND HISTFILE; set +o history"
_SIGKILLED = 128 + signal.SIGKILL
KILLED_NOTE = "[exit 137: the command was killed (SIGKILL); the box's memory limit?]"
"""Added to the output of a command that ended by SIGKILL: most often the kernel's OOM kill at
the box's memory limit, which the tool server, inside the box, cannot tell from a `kill -9`."""


def _ansi_c_table() -> dict[int, str | None]:
    table: dict[int, str | None] = {code: f"\\x{code:02x}" for code in range(0x20)}
    table.update({0x7F: "\\x7f", ord("\\"): "\\\\", ord("'"): "\\'", 0: None})
    table.update({ord("\n"): "\\n", ord("\t"): "\\t", ord("\r"): "\\r"})
    return table


# Inside $'...' every control character is escaped, so the typed line holds nothing the
# terminal's line discipline would act on (Ctrl-C, Ctrl-D, Ctrl-U, ...). NUL cannot be in a
# bash string and is dropped.
_ANSI_C = _ansi_c_table()


@dataclass(frozen=True)
class BashResult:
    output: str
    """What the command wrote to the terminal, escape sequences removed, capped."""
    exit_code: int | None
    """`$?` after the command; the shell's exit status if it exited; None on timeout."""
    timed_out: bool
    truncated: bool
    """The middle of the output was cut (a marker in `output` says how much)."""
    reset: bool
    """The shell was replaced: working directory, variables and jobs are gone."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "truncated": self.truncated,
            "reset": self.reset,
        }


class BashError(Exception):
    """The shell could not be started."""


_ECHO = termios.ECHO | termios.ECHOE | termios.ECHOK | termios.ECHONL | termios.ECHOCTL


def _quiet_terminal(fd: int) -> None:
    """Settings the session relies on: no echo of typed input, no CR added before LF, and
    line-by-line input with Ctrl-C delivering SIGINT.

    Applied at start and again before every command, since a command may change them
    (`stty echo`, or a full-screen program killed before it could restore the terminal).
    On Linux a pty master's termios calls act on the terminal itself, so the server can do
    this from its side.
    """
    try:
        attrs = termios.tcgetattr(fd)
    except termios.error:
        return  # the terminal is gone; the caller finds out when it writes
    if attrs[1] & termios.OPOST or attrs[3] & _ECHO or ~attrs[3] & (termios.ICANON | termios.ISIG):
        attrs[1] &= ~termios.OPOST
        attrs[3] = (attrs[3] & ~_ECHO) | termios.ICANON | termios.ISIG
        termios.tcsetattr(fd, termios.TCSANOW, attrs)


def _prepare_child() -> None:
    """In the shell's process before exec: quiet terminal, default signal dispositions.

    Python ignores SIGPIPE and SIGXFSZ, and exec would pass that on to every command (an
    ignored SIGPIPE turns `yes | head` into "Broken pipe" errors).
    """
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    _quiet_terminal(0)


_Outcome = Literal["done", "exited", "timeout"]


class BashSession:
    """One interactive bash; calls run one at a time, in the order they arrive."""

    def __init__(
        self,
        workdir: Path,
        *,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        shell: str = "/bin/bash",
        env: Mapping[str, str] | None = None,
        interrupt_grace: float = 0.5,
        probe_timeout: float = 2.0,
        start_timeout: float = 10.0,
    ) -> None:
        self.workdir = workdir
        self.output_limit = output_limit
        self.shell = shell
        base = dict(os.environ if env is None else env)
        for name in _ENV_REMOVED:
            base.pop(name, None)
        base.update(_ENV_OVERRIDES)
        self.env = base
        self.interrupt_grace = interrupt_grace
        self.probe_timeout = probe_timeout
        self.start_timeout = start_timeout
        self._proc: PtyProcess | None = None
        self._exited: asyncio.Future[None] | None = None
        self._pending = b""
        self._lock = asyncio.Lock()
        self._scratch = Path(tempfile.mkdtemp(prefix=".rollserve-bash-"))
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        """Start the shell (if not running) and wait until it answers."""
        async with self._lock:
            if self._proc is None and not self._closed:
                await self._spawn()

    async def run(self, command: str, timeout: float) -> BashResult:
        """Run `command` in the shell; return within about `timeout` seconds plus recovery."""
        async with self._lock:
            if self._closed:
                raise BashError("the shell session is closed")
            reset = False
            if self._proc is None:
                await self._spawn()
            elif self._exited is not None and self._exited.done():
                await self._respawn()
                reset = True
            buffer = CappedBuffer(self.output_limit)
            if self._pending:
                buffer.feed(self._pending)
                self._pending = b""
            token = secrets.token_hex(8)
            exit_code: int | None = None
            timed_out = False
            try:
                assert self._proc is not None
                _quiet_terminal(self._proc.fd)
                await self._type(self._command_line(command, token))
                outcome, exit_code = await self._read_until(token, buffer, timeout)
            except OSError:  # the terminal refuses input: the shell is gone or wedged
                outcome = "exited"
            if outcome == "exited":
                exit_code = await self._exit_status()
                await self._respawn()
                reset = True
            elif outcome == "timeout":
                timed_out = True
                if not await self._recover(buffer):
                    await self._respawn()
                    reset = True
            output, truncated = self._render(buffer)
            if exit_code == _SIGKILLED:
                output = f"{output.rstrip()}\n{KILLED_NOTE}".lstrip("\n")
            return BashResult(output, exit_code, timed_out, truncated, reset)

    async def reset(self) -> None:
        """Replace the shell with a fresh one (and kill everything the old one started)."""
        async with self._lock:
            if self._closed:
                raise BashError("the shell session is closed")
            await self._respawn()

    async def close(self) -> None:
        """Kill the shell and its jobs; later calls fail with BashError."""
        self._closed = True
        self._kill()
        shutil.rmtree(self._scratch, ignore_errors=True)

    # Shell lifecycle ----------------------------------------------------------------------

    async def _spawn(self) -> None:
        self._scratch.mkdir(parents=True, exist_ok=True)
        proc = PtyProcess.spawn(
            [self.shell, "--noprofile", "--norc", "--noediting", "-i"],
            cwd=str(self.workdir),
            env=self.env,
            preexec_fn=_prepare_child,
            dimensions=(50, 200),
        )
        # Teardown kills the shell first, so closing need not wait for it.
        proc.delayafterclose = 0
        proc.delayafterterminate = 0
        os.set_blocking(proc.fd, False)
        self._proc = proc
        self._exited = exit_waiter(proc.pid)
        self._pending = b""
        token = secrets.token_hex(8)
        buffer = CappedBuffer(self.output_limit)
        try:
            await self._type(f"{_SETUP}; {self._sentinel(token)}\n".encode())
            outcome, _ = await self._read_until(token, buffer, self.start_timeout)
        except OSError as exc:
            self._kill()
            raise BashError(f"could not start {self.shell}: {exc}") from exc
        if outcome != "done":
            output, _ = self._render(buffer)
            self._kill()
            raise BashError(f"{self.shell} did not become ready ({outcome}): {output[-500:]!r}")

    async def _respawn(self) -> None:
        self._kill()
        await self._spawn()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if self._exited is not None:
            self._exited.cancel()
            self._exited = None
        if proc is None:
            return
        # The shell's descendants, and the jobs of its session that were orphaned and
        # adopted by this process (a subreaper) when their parent exited.
        victims = {proc.pid, *descendants(proc.pid)}
        adopted = []
        for pid in children(os.getpid()):
            info = stat(pid)
            if info is not None and info[3] == proc.pid and pid != proc.pid:
                adopted.append(pid)
                victims.update([pid, *descendants(pid)])
        kill_all(sorted(victims), signal.SIGKILL)
        for pid in adopted:  # children of this process now: collect them
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        with contextlib.suppress(Exception):
            proc.wait()
        with contextlib.suppress(Exception):
            proc.close(force=True)

    async def _exit_status(self) -> int | None:
        """Exit status of a shell that is exiting (128 + signal if killed), None if it isn't.

        The terminal can hang up while the shell lives on (it closed its own descriptors),
        so this waits briefly for the exit rather than blocking in waitpid.
        """
        proc, exited = self._proc, self._exited
        if proc is None or exited is None:
            return None
        try:
            await asyncio.wait_for(asyncio.shield(exited), 1.0)
        except TimeoutError:
            return None
        try:
            proc.wait()
        except Exception:
            return None
        if proc.signalstatus is not None:
            return 128 + int(proc.signalstatus)
        return None if proc.exitstatus is None else int(proc.exitstatus)

    # Talking to the shell -----------------------------------------------------------------

    @staticmethod
    def _sentinel(token: str) -> str:
        return f"printf '\\036RS%s:%d\\036' {token} \"$?\" >/dev/tty"

    def _command_line(self, command: str, token: str) -> bytes:
        done = self._sentinel(token)
        line = f"eval $'{command.translate(_ANSI_C)}'; {done}\n".encode()
        if len(line) <= _INLINE_LIMIT:
            return line
        script = self._scratch / "command"
        # An agent may have emptied /tmp; the directory is cheap to recreate.
        self._scratch.mkdir(parents=True, exist_ok=True)
        script.write_text(command.replace("\0", ""))
        read = f"IFS= read -r -d '' __rollserve_cmd < {shlex.quote(str(script))}"
        return f'{read}; eval "$__rollserve_cmd"; {done}\n'.encode()

    async def _type(self, data: bytes) -> None:
        """Write to the terminal; raises OSError if the shell does not take input in 1 s."""
        assert self._proc is not None
        fd = self._proc.fd
        deadline = time.monotonic() + 1.0
        view = memoryview(data)
        while view:
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.001)
                continue
            view = view[written:]

    async def _read_until(
        self, token: str, buffer: CappedBuffer, timeout: float
    ) -> tuple[_Outcome, int | None]:
        """Collect output into `buffer` until the sentinel with `token`, exit or timeout."""
        assert self._proc is not None and self._exited is not None
        loop = asyncio.get_running_loop()
        fd = self._proc.fd
        marker = b"\x1eRS" + token.encode() + b":"
        result: asyncio.Future[tuple[_Outcome, int | None]] = loop.create_future()

        def finish(outcome: _Outcome, code: int | None = None) -> None:
            if not result.done():
                result.set_result((outcome, code))

        def on_readable() -> None:
            while not result.done():
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    return
                except OSError:  # EIO: nothing holds the terminal open any more
                    chunk = b""
                if not chunk:
                    finish("exited")
                    return
                buffer.feed(chunk)
                data = buffer.data
                begin = data.find(marker, max(0, len(data) - len(chunk) - 64))
                if begin < 0:
                    continue
                digits = begin + len(marker)
                end = data.find(b"\x1e", digits)
                if end < 0:
                    continue  # the rest of the sentinel is still on its way
                code = int(data[digits:end])
                rest = buffer.trim_end(begin)
                # Whatever followed the sentinel (job notices) belongs to the next call.
                self._pending = rest[end + 1 - begin :]
                finish("done", code)

        def on_exit(_: asyncio.Future[None]) -> None:
            # Output written just before the exit is still in the terminal buffer.
            on_readable()
            finish("exited")

        loop.add_reader(fd, on_readable)
        timer = loop.call_later(max(timeout, 0.0), finish, "timeout")
        exited = self._exited
        exited.add_done_callback(on_exit)
        try:
            on_readable()  # the answer may already be waiting
            return await result
        finally:
            timer.cancel()
            exited.remove_done_callback(on_exit)
            loop.remove_reader(fd)

    async def _recover(self, buffer: CappedBuffer) -> bool:
        """After a timeout: interrupt, kill a foreground job that survives, probe the shell."""
        proc = self._proc
        assert proc is not None
        try:
            await self._type(b"\x03")
            if not await self._shell_in_foreground(self.interrupt_grace):
                with contextlib.suppress(OSError):
                    foreground = os.tcgetpgrp(proc.fd)
                    if foreground != proc.pid:
                        os.killpg(foreground, signal.SIGKILL)
                if not await self._shell_in_foreground(self.interrupt_grace):
                    return False
            token = secrets.token_hex(8)
            _quiet_terminal(proc.fd)
            await self._type(f"{self._sentinel(token)}\n".encode())
            outcome, _ = await self._read_until(token, buffer, self.probe_timeout)
        except OSError:
            return False
        return outcome == "done"

    async def _shell_in_foreground(self, grace: float) -> bool:
        """Wait up to `grace` seconds for the shell to own the terminal again."""
        proc = self._proc
        assert proc is not None and self._exited is not None
        deadline = time.monotonic() + grace
        while True:
            if self._exited.done():
                return False
            try:
                if os.tcgetpgrp(proc.fd) == proc.pid:
                    return True
            except OSError:
                return True  # cannot tell; let the probe decide
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)

    def _render(self, buffer: CappedBuffer) -> tuple[str, bool]:
        data, truncated = buffer.render()
        if b"\x1e" in data:
            data = _ANY_SENTINEL.sub(b"", data)  # sentinels of interrupted calls printed late
        return clean_terminal_output(data), truncated
