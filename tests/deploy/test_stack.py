"""The one-machine stack launcher: idempotent start, clean stop."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from broker.processes import free_port
from core.settings import Settings
from deploy.stack import DevBackendOptions, Stack, StackOptions
from tests.support.procs import processes_mentioning

pytestmark = pytest.mark.full


def test_entering_a_started_stack_starts_nothing_twice(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", port=free_port())
    stack = Stack(settings, StackOptions(workers={}, dev_backend=None)).start()
    children, redis_url = dict(stack.children), stack.redis_url
    with stack as same:
        assert same is stack
        assert stack.children == children and stack.redis_url == redis_url
        assert httpx.get(f"{stack.gateway_url}/healthz").json()["redis"] is True
    assert processes_mentioning(str(tmp_path / "data")) == []
    stack.stop()  # a second stop is harmless


def test_a_started_stack_is_ready_guards_flower_and_shows_no_secret(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data_dir = tmp_path / "data"
    token = "flower-and-gateway-token"
    settings = Settings(data_dir=data_dir, port=free_port(), api_token=token)
    options = StackOptions(
        dev_backend=DevBackendOptions(model_dir=tiny_model_dir),
        flower=True,
        flower_port=free_port(),
    )
    with Stack(settings, options) as stack:
        # start() returned only once /readyz said ready; it needs no token.
        answer = httpx.get(f"{stack.gateway_url}/readyz", timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"ready": True, "missing": []}

        flower = f"http://127.0.0.1:{options.flower_port}/"
        assert httpx.get(flower, timeout=10).status_code == 401
        assert httpx.get(flower, auth=("rollserve", "wrong"), timeout=10).status_code == 401
        assert httpx.get(flower, auth=("rollserve", token), timeout=10).status_code == 200

        assert stack.redis is not None and stack.redis.password
        secrets = [stack.redis.password.encode(), token.encode()]
        pids = processes_mentioning(str(data_dir))
        assert len(pids) >= 6  # redis, dev backend, gateway, flower, three workers (+ children)
        for pid in pids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert not [s for s in secrets if s in cmdline], cmdline
    assert (data_dir / "flower" / "flowerconfig.py").stat().st_mode & 0o077 == 0
    for log_file in [*(data_dir / "logs").iterdir(), data_dir / "redis" / "valkey.log"]:
        text = log_file.read_bytes()
        assert not [s for s in secrets if s in text], log_file
    assert processes_mentioning(str(data_dir)) == []


def test_flower_beyond_loopback_without_a_token_is_refused(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", port=free_port())
    options = StackOptions(workers={}, flower=True, flower_address="0.0.0.0")
    with pytest.raises(RuntimeError, match="without ROLLSERVE_API_TOKEN it has no auth"):
        Stack(settings, options).start()
    assert processes_mentioning(str(tmp_path / "data")) == []


def test_flower_without_a_token_asks_for_a_kept_random_password(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    settings = Settings(data_dir=data_dir, port=free_port())
    options = StackOptions(workers={}, flower=True, flower_port=free_port())
    with Stack(settings, options) as stack:
        password = stack.flower_password()
        flower = f"http://127.0.0.1:{options.flower_port}/"
        assert httpx.get(flower, timeout=10).status_code == 401
        assert httpx.get(flower, auth=("rollserve", ""), timeout=10).status_code == 401
        assert httpx.get(flower, auth=("rollserve", password), timeout=10).status_code == 200
    assert stack.flower_password_file.stat().st_mode & 0o077 == 0
    # the same password on the next start, so an operator's saved login keeps working
    assert Stack(settings, options).flower_password() == password
    assert processes_mentioning(str(data_dir)) == []
