"""The embedded Redis: a password no other process sees, loopback only, a memory cap."""

from __future__ import annotations

import stat
from pathlib import Path

import pydantic
import pytest
import redis

from broker.embedded import CONFIG_FILE, PASSWORD_FILE, EmbeddedRedis, redact_url
from core.settings import Settings, maxmemory_bytes, total_memory


def listening_addresses(port: int) -> set[str]:
    """Local addresses of sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(address)
    return found


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_test_redis_refuses_clients_without_its_password(redis_server: EmbeddedRedis) -> None:
    assert redis_server.port is not None and redis_server.password
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=redis_server.port).set("stolen", 1)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=redis_server.port, password="guess").ping()
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert client.ping()
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert int(client.config_get("maxmemory")["maxmemory"]) > 0
    finally:
        client.close()
    assert redis_server.url == (f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0")
    assert listening_addresses(redis_server.port) == {"0100007F"}  # 127.0.0.1 only


def test_the_password_is_in_no_command_line_and_in_files_only_the_owner_reads(
    redis_server: EmbeddedRedis,
) -> None:
    password = redis_server.password
    assert password and redis_server.pid is not None
    cmdline = Path(f"/proc/{redis_server.pid}/cmdline").read_bytes()
    assert b"valkey-server" in cmdline
    assert password.encode() not in cmdline
    for name in (PASSWORD_FILE, CONFIG_FILE):
        path = redis_server.data_dir / name
        assert mode(path) == 0o600, name
        assert password in path.read_text()
    assert mode(redis_server.data_dir) == 0o700
    assert password not in redis_server.redacted_url
    assert redis_server.redacted_url == f"redis://:**@127.0.0.1:{redis_server.port}/0"


def test_a_restart_keeps_the_password_and_tightens_a_loose_file(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis") as first:
        password = first.password
    (tmp_path / "redis" / PASSWORD_FILE).chmod(0o644)
    with EmbeddedRedis(tmp_path / "redis") as second:
        assert second.password == password
        assert mode(tmp_path / "redis" / PASSWORD_FILE) == 0o600
        assert redis.Redis.from_url(second.url).ping()


def test_a_malformed_password_file_is_refused_by_name(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    data.mkdir()
    (data / PASSWORD_FILE).write_text("short\n")
    with pytest.raises(ValueError, match=PASSWORD_FILE):
        EmbeddedRedis(data).start()


def test_the_embedded_redis_never_binds_beyond_loopback(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "192.168.1.10", "::"):
        with pytest.raises(ValueError, match="loopback"):
            EmbeddedRedis(tmp_path, host=host)


def test_memory_caps_read_as_redis_spells_them_or_a_share_of_ram() -> None:
    assert maxmemory_bytes("4gb") == 4 * 1024**3
    assert maxmemory_bytes("512MB") == 512 * 1024**2
    assert maxmemory_bytes("1000") == 1000
    assert maxmemory_bytes("0") == 0
    assert maxmemory_bytes("25%") == total_memory() // 4
    for bad in ("lots", "-1gb", "150%", "4 parsecs", ""):
        with pytest.raises(ValueError):
            maxmemory_bytes(bad)
    with pytest.raises(pydantic.ValidationError, match="redis_maxmemory"):
        Settings(redis_maxmemory="lots")
    assert Settings().redis_maxmemory == "25%"


def test_the_cap_reaches_the_server(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis", maxmemory="96mb") as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory") == {"maxmemory": str(96 * 1024**2)}
        client.close()


def test_urls_are_masked_for_logs() -> None:
    assert redact_url("redis://:pw@h:1/0") == "redis://:**@h:1/0"
    assert redact_url("redis://user:pw@h:1/0") == "redis://user:**@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
