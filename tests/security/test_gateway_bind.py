"""The gateway binds an address beyond loopback only with ROLLSERVE_API_TOKEN set: `rollserve
gateway` and `rollserve up` (the one-machine stack) refuse it before starting anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.settings import Settings
from deploy import cli
from deploy.stack import Stack, StackOptions, gateway_bind_refusal

ROOT = Path(__file__).resolve().parents[2]
OPEN = ["0.0.0.0", "::", "", "192.0.2.7", "10.1.2.3", "gateway.example"]
LOOPBACK = ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"]


@pytest.mark.parametrize("host", OPEN)
def test_a_non_loopback_address_without_a_token_is_refused_naming_the_token(host: str) -> None:
    refusal = gateway_bind_refusal(host, Settings(api_token=None))
    assert refusal is not None and "ROLLSERVE_API_TOKEN" in refusal
    assert gateway_bind_refusal(host, Settings(api_token="s3cret")) is None


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_needs_no_token(host: str) -> None:
    assert gateway_bind_refusal(host, Settings(api_token=None)) is None


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    return {**env, **extra}


def rollserve(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def test_rollserve_gateway_on_every_interface_without_a_token_exits_saying_why(
    tmp_path: Path,
) -> None:
    done = rollserve(["gateway", "--host", "0.0.0.0", "--port", "1"], clean_env(), tmp_path)
    assert done.returncode != 0
    assert "ROLLSERVE_API_TOKEN" in done.stderr and "Traceback" not in done.stderr


def test_rollserve_up_with_a_public_host_and_no_token_exits_before_starting_anything(
    tmp_path: Path,
) -> None:
    env = clean_env(ROLLSERVE_HOST="0.0.0.0", ROLLSERVE_DATA_DIR=str(tmp_path / "data"))
    done = rollserve(["up"], env, tmp_path)
    assert done.returncode != 0
    assert "ROLLSERVE_API_TOKEN" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()  # no Redis, no worker, no gateway was started


def test_the_gateway_command_refuses_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.build_parser().parse_args(["gateway", "--host", "10.0.0.1"])
    assert cli.cmd_gateway(args, Settings(api_token=None)) == 2
    assert "ROLLSERVE_API_TOKEN" in capsys.readouterr().err


def test_the_stack_refuses_before_making_its_data_dir(tmp_path: Path) -> None:
    settings = Settings(host="0.0.0.0", api_token=None, data_dir=tmp_path / "data")
    stack = Stack(settings, StackOptions(workers={}))
    with pytest.raises(RuntimeError, match="ROLLSERVE_API_TOKEN"):
        stack.start()
    assert not stack.children and stack.redis is None
    assert not (tmp_path / "data").exists()
