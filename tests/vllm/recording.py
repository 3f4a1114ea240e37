"""An HTTP proxy in front of a vLLM server that keeps every request and answer it forwards: what
the stack sent and exactly what the engine answered, for comparing with the trajectories.

It reads each request whole and answers once the engine has answered, so a client that closes
its connection does not abort the engine's request: register vLLM itself, not this proxy, where
aborts are tested.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

FORWARDED_HEADERS = ("content-type", "x-request-id", "authorization")


@dataclass(frozen=True)
class Exchange:
    """One request forwarded to the engine and its answer (bodies parsed as JSON, else None)."""

    method: str
    path: str
    request: Any
    status: int
    answer: Any


class RecordingProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.lock = threading.Lock()
        self.http = httpx.Client(timeout=600.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, exchange: Exchange) -> None:
        with self.lock:
            self.exchanges.append(exchange)

    def recorded(self, path: str) -> list[Exchange]:
        """The exchanges of `path`, in the order their answers came."""
        with self.lock:
            return [e for e in self.exchanges if e.path == path]


def _json(data: bytes) -> Any:
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


class _Handler(BaseHTTPRequestHandler):
    server: RecordingProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k: v for k, v in self.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            answer = self.server.http.request(
                self.command, self.server.upstream + self.path, content=body, headers=headers
            )
        except httpx.HTTPError:
            self.send_error(502)
            return
        self.server.record(
            Exchange(
                self.command, self.path, _json(body), answer.status_code, _json(answer.content)
            )
        )
        self.send_response(answer.status_code)
        kind = answer.headers.get("content-type")
        if kind:
            self.send_header("content-type", kind)
        self.send_header("content-length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    do_GET = _forward
    do_POST = _forward
    do_DELETE = _forward


@contextmanager
def recording_proxy(upstream: str) -> Iterator[RecordingProxy]:
    """A `RecordingProxy` in front of `upstream` (http://host:port), stopped on exit."""
    proxy = RecordingProxy(upstream)
    thread = threading.Thread(target=proxy.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=10)
        proxy.http.close()
