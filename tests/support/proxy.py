"""A TCP proxy that cuts every connection after a few lines of the answer: a network that
breaks streams mid-way, for testing clients that resume them."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

LINE_END = b"}\n"
"""How a JSON line of an NDJSON body ends."""


class CuttingProxy:
    """Forwards loopback connections to `upstream`; each answer is cut (both sockets closed)
    a few bytes into the line after its `lines`-th JSON line, so the client also holds a
    partial line when the connection breaks. `connections` counts the connections served."""

    def __init__(self, upstream: tuple[str, int], lines: int) -> None:
        self.upstream = upstream
        self.lines = lines
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def _accept(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._sockets += [client, upstream]
            self._spawn(self._forward, client, upstream, False)
            self._spawn(self._forward, upstream, client, True)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        with self._lock:
            self._threads.append(thread)

    def _forward(self, source: socket.socket, sink: socket.socket, cut: bool) -> None:
        seen = 0
        tail = b""
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if cut:
                    window = tail + data
                    ends = [i for i in range(len(window)) if window.startswith(LINE_END, i)]
                    if seen + len(ends) >= self.lines:
                        stop = ends[self.lines - seen - 1] + len(LINE_END) + 10 - len(tail)
                        sink.sendall(data[: max(stop, 0)])
                        break
                    seen += len(ends)
                    tail = window[-(len(LINE_END) - 1) :]
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in threads:
            thread.join(timeout=10)
        assert not any(t.is_alive() for t in threads), "a proxy thread did not stop"


@contextmanager
def cutting_proxy(upstream_url: str, lines: int) -> Iterator[CuttingProxy]:
    """A `CuttingProxy` in front of `upstream_url` (http://host:port), stopped on exit."""
    host, port = upstream_url.removeprefix("http://").rsplit(":", 1)
    proxy = CuttingProxy((host, int(port)), lines)
    acceptor = threading.Thread(target=proxy._accept, daemon=True)
    acceptor.start()
    try:
        yield proxy
    finally:
        proxy.close()
        acceptor.join(timeout=10)
        assert not acceptor.is_alive(), "the proxy did not stop"
