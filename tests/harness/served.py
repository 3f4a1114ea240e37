"""The harness endpoint served for real, on a loopback port or a Unix socket, on an event loop
of its own thread (so the SDKs' sync clients talk to it as a harness would), in front of a
fake `Endpoint` that answers scripted results and records the requests it got."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from workers.harness.server import make_app, serve_tcp, serve_unix, stop_server
from workers.harness.wire import ChatRequest, ChatResult

KEY = "sk-job-key-for-tests"
MODEL = "policy-model"


class FakeEndpoint:
    """Answers each request with the next scripted result (or raises the next scripted
    error); a plain "Hello." when nothing is scripted. Keeps every request it got."""

    def __init__(self) -> None:
        self.model = MODEL
        self.requests: list[ChatRequest] = []
        self.script: list[ChatResult | BaseException] = []

    def will_answer(self, **fields: Any) -> ChatResult:
        defaults: dict[str, Any] = {
            "id": "abc123",
            "model": MODEL,
            "content": "Hello.",
            "prompt_tokens": 12,
            "completion_tokens": 3,
            "created": 1_700_000_000,
        }
        result = ChatResult(**{**defaults, **fields})
        self.script.append(result)
        return result

    def will_fail(self, error: BaseException) -> None:
        self.script.append(error)

    @property
    def last(self) -> ChatRequest:
        return self.requests[-1]

    async def generate(self, request: ChatRequest) -> ChatResult:
        self.requests.append(request)
        step = self.script.pop(0) if self.script else None
        if isinstance(step, BaseException):
            raise step
        if step is None:
            return ChatResult(id="default", model=MODEL, content="Hello.", created=1)
        return step


class ServedApp:
    """`make_app` over one fake endpoint, served on its own thread until `stop`."""

    def __init__(self, endpoint: FakeEndpoint, *, unix_path: str | None, max_body: int) -> None:
        self.endpoint = endpoint
        self.unix_path = unix_path
        self.max_body = max_body
        self.url = ""
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),))

    async def _find(self, key: str) -> FakeEndpoint | None:
        return self.endpoint if key == KEY else None

    async def _serve(self) -> None:
        try:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            app = make_app(self._find, max_body_bytes=self.max_body)
            if self.unix_path is not None:
                runner = await serve_unix(app, self.unix_path)
                self.url = "http://localhost"
            else:
                runner = await serve_tcp(app, "127.0.0.1", 0)
                self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._ready.set()
        await self._stop.wait()
        await stop_server(runner)

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(timeout=30), "the server did not start"
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the server thread did not stop"
