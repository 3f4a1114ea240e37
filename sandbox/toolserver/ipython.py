"""A persistent IPython kernel driven directly through jupyter_client's client API.

No Jupyter server and no HTTP gateway: the tool server owns an `AsyncKernelManager` and
talks to the kernel over ZeroMQ `ipc` sockets in a private directory, so a cell costs one
request on the shell channel and the output messages on IOPub. jupyter_client is imported
on the first call, which keeps the tool server's start-up fast when no cell is ever run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sandbox.toolserver.output import DEFAULT_OUTPUT_LIMIT, CappedBuffer, clean_terminal_output
from sandbox.toolserver.processes import exit_waiter

if TYPE_CHECKING:
    from jupyter_client.asynchronous.client import AsyncKernelClient
    from jupyter_client.manager import AsyncKernelManager

Status = Literal["ok", "error", "timeout"]

# History in SQLite costs a write per cell and may not be writable inside a sandbox.
_KERNEL_ARGUMENTS = ["--HistoryManager.enabled=False"]
_KERNEL_DIED = "[The kernel died while running this cell. It will be restarted on the next call.]"


@dataclass(frozen=True)
class IPythonResult:
    output: str
    """stdout, stderr, results and displays as text, and the traceback of an error."""
    status: Status
    restarted: bool
    """A new kernel was started during this call (the old one had died, or ignored an
    interrupt after a timeout): earlier variables and imports are gone."""
    truncated: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "status": self.status,
            "restarted": self.restarted,
            "truncated": self.truncated,
        }


class KernelError(Exception):
    """The kernel could not be started."""


class _Transcript:
    """Text of the IOPub messages that answer one execute request, bounded in memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffer = CappedBuffer(limit)
        self.msg_id: str | None = None
        self.idle = False

    def add(self, text: str) -> None:
        self.buffer.feed(text.encode("utf-8", errors="surrogatepass"))

    def __call__(self, msg: dict[str, Any]) -> None:
        self.msg_id = msg["parent_header"].get("msg_id", self.msg_id)
        kind = msg["header"]["msg_type"]
        content = msg["content"]
        if kind == "stream":
            self.add(content.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            text = content.get("data", {}).get("text/plain")
            if text:
                self.add(text if text.endswith("\n") else text + "\n")
        elif kind == "error":
            self.add("\n".join(content.get("traceback", [])) + "\n")
        elif kind == "clear_output":
            self.buffer = CappedBuffer(self.limit)
        elif kind == "status" and content.get("execution_state") == "idle":
            self.idle = True

    def render(self) -> tuple[str, bool]:
        data, truncated = self.buffer.render()
        return clean_terminal_output(data), truncated


class IPythonKernel:
    """One kernel; cells run one at a time. A dead kernel is replaced on the next call."""

    def __init__(
        self,
        workdir: Path,
        *,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 60.0,
        interrupt_grace: float = 2.0,
    ) -> None:
        self.workdir = workdir
        self.output_limit = output_limit
        self.env = dict(os.environ if env is None else env)
        self.start_timeout = start_timeout
        self.interrupt_grace = interrupt_grace
        self._manager: AsyncKernelManager | None = None
        self._client: AsyncKernelClient | None = None
        self._died: asyncio.Future[None] | None = None
        self._lock = asyncio.Lock()
        self._scratch: Path | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        provisioner = self._manager.provisioner if self._manager is not None else None
        pid = getattr(provisioner, "pid", None)
        return int(pid) if pid is not None else None

    async def run(self, code: str, timeout: float) -> IPythonResult:
        """Execute one cell; on timeout the kernel is interrupted (restarted if that fails)."""
        async with self._lock:
            if self._closed:
                raise KernelError("the kernel is closed")
            restarted = False
            if self._manager is None:
                await self._start()
            elif self._died is None or self._died.done():
                await self._restart()
                restarted = True
            client, died = self._client, self._died
            assert client is not None and died is not None
            transcript = _Transcript(self.output_limit)
            execution = asyncio.ensure_future(
                client.execute_interactive(
                    code,
                    allow_stdin=False,
                    stop_on_error=False,
                    timeout=timeout,
                    output_hook=transcript,
                )
            )
            watched: set[asyncio.Future[Any]] = {execution, died}
            try:
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                execution.cancel()
                raise
            status: Status
            if execution.done():
                try:
                    reply = execution.result()
                except TimeoutError:
                    status = "timeout"
                    if not await self._interrupt(transcript):
                        await self._restart()
                        restarted = True
                else:
                    status = "ok" if reply["content"].get("status") == "ok" else "error"
            else:
                execution.cancel()
                with contextlib.suppress(BaseException):
                    await execution
                transcript.add(("\n" if transcript.buffer.total else "") + _KERNEL_DIED)
                status = "error"
            output, truncated = transcript.render()
            return IPythonResult(output, status, restarted, truncated)

    async def restart(self) -> bool:
        """Replace a running kernel with a fresh one; False if none was running."""
        async with self._lock:
            if self._manager is None or self._closed:
                return False
            await self._restart()
            return True

    async def close(self) -> None:
        """Kill the kernel and remove its files; later calls fail with KernelError."""
        self._closed = True
        await self._shutdown()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    # Kernel lifecycle ---------------------------------------------------------------------

    async def _start(self) -> None:
        from jupyter_client.manager import AsyncKernelManager

        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix=".rollserve-kernel-"))
        self._scratch.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        # The home directory may be read-only inside a sandbox: keep IPython's state private.
        env.update(
            IPYTHONDIR=str(self._scratch / "ipython"),
            JUPYTER_PLATFORM_DIRS="1",
            MPLBACKEND="Agg",
            PYDEVD_DISABLE_FILE_VALIDATION="1",
        )
        manager = AsyncKernelManager(
            kernel_name="python3",
            transport="ipc",
            ip=str(self._scratch / "kernel"),
            connection_file=str(self._scratch / "kernel.json"),
        )
        self._manager = manager
        try:
            await manager.start_kernel(
                cwd=str(self.workdir),
                env=env,
                extra_arguments=_KERNEL_ARGUMENTS,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            client = manager.client()
            client.start_channels()
            self._client = client
            await client.wait_for_ready(timeout=self.start_timeout)
        except Exception as exc:
            await self._shutdown()
            raise KernelError(f"the IPython kernel did not start: {exc}") from exc
        pid = self.pid
        assert pid is not None
        self._died = exit_waiter(pid)

    async def _restart(self) -> None:
        await self._shutdown()
        await self._start()

    async def _shutdown(self) -> None:
        manager, client, died = self._manager, self._client, self._died
        self._manager = self._client = self._died = None
        if died is not None:
            died.cancel()
        if client is not None:
            with contextlib.suppress(Exception):
                client.stop_channels()
        if manager is not None:
            with contextlib.suppress(Exception):
                await manager.shutdown_kernel(now=True)

    async def _interrupt(self, transcript: _Transcript) -> bool:
        """Interrupt the running cell and wait for the kernel to go idle; False if it won't."""
        manager, client, died = self._manager, self._client, self._died
        assert manager is not None and client is not None and died is not None
        if transcript.msg_id is None or died.done():
            return False  # the kernel never started the cell, or is gone
        with contextlib.suppress(Exception):
            await manager.interrupt_kernel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.interrupt_grace
        while not transcript.idle:
            remaining = deadline - loop.time()
            if remaining <= 0 or died.done():
                return False
            try:
                msg = await client.get_iopub_msg(timeout=remaining)
            except Exception:
                return False
            if msg["parent_header"].get("msg_id") == transcript.msg_id:
                transcript(msg)
        return True
