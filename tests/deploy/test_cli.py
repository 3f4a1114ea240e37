"""The `rollserve` command as an operator uses it: `up`, `submit`, `status`, and Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.processes import free_port
from tests.support.procs import processes_mentioning
from tests.support.wait import wait_until

pytestmark = pytest.mark.full

ROOT = Path(__file__).resolve().parents[2]


def cli_env(data_dir: Path, tiny_model_dir: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    env.update(
        ROLLSERVE_DATA_DIR=str(data_dir),
        ROLLSERVE_TINY_MODEL_DIR=str(tiny_model_dir),
        ROLLSERVE_URL=f"http://127.0.0.1:{port}",
        ROLLSERVE_DEV_BACKEND_PORT=str(free_port()),
    )
    return env


def rollserve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


class Up:
    def __init__(self, proc: subprocess.Popen[str], env: dict[str, str], data_dir: Path) -> None:
        self.proc, self.env, self.data_dir = proc, env, data_dir
        self.url = env["ROLLSERVE_URL"]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Up]:
    data_dir = tmp_path_factory.mktemp("up")
    port = free_port()
    env = cli_env(data_dir, tiny_model_dir, port)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", "--port", str(port),
         "--script", str(ROOT / "examples" / "demo_script.jsonl")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    running = Up(proc, env, data_dir)

    def ready() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            return httpx.get(f"{running.url}/healthz", timeout=1).json()["backends"] == 1
        except httpx.HTTPError:
            return False

    wait_until(ready, 120, "rollserve up to serve with its backend")
    yield running
    if proc.poll() is None:  # a failed test left it up: stop it the way an operator would
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)


def test_submit_reports_the_bad_line_and_submits_nothing(up: Up, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    good = json.dumps({"data_source": "math", "problem": "1+1?", "answer": "2"})
    tasks.write_text(f"{good}\n\n{good}\n{{oops\n")
    done = rollserve(["submit", str(tasks), "--out", str(tmp_path / "out.jsonl")], up.env)
    assert done.returncode == 2
    assert "tasks.jsonl:4" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()
    jobs = httpx.get(f"{up.url}/v1/stats").json()["jobs"]
    assert sum(jobs.values()) == 0


def test_submit_runs_a_batch_and_writes_every_trajectory(up: Up, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    tasks = ROOT / "examples" / "demo_tasks.jsonl"
    done = rollserve(
        ["submit", str(tasks), "--group-size", "2", "--seed", "0", "--out", str(out)], up.env
    )
    assert done.returncode == 0, done.stderr
    assert "mean reward" in done.stdout
    lines = out.read_text().splitlines()
    assert len(lines) == 12
    assert {json.loads(line)["status"] for line in lines} == {"completed"}


def test_status_shows_queues_and_backends(up: Up) -> None:
    done = rollserve(["status"], up.env)
    assert done.returncode == 0, done.stderr
    assert "dev" in done.stdout and "run" in done.stdout


def test_status_without_a_gateway_says_how_to_start_one(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    done = rollserve(["status"], cli_env(tmp_path, tiny_model_dir, free_port()))
    assert done.returncode == 1
    assert "rollserve up" in done.stderr


def test_up_says_ready_once_readyz_answers_and_masks_the_redis_password(up: Up) -> None:
    assert up.proc.stdout is not None
    fd = up.proc.stdout.fileno()
    os.set_blocking(fd, False)
    printed = b""

    def said_ready() -> bool:
        nonlocal printed
        with contextlib.suppress(BlockingIOError):
            printed += os.read(fd, 65536)
        return b"\nready " in printed

    wait_until(said_ready, 60, "rollserve up to say it is ready")
    assert httpx.get(f"{up.url}/readyz", timeout=10).status_code == 200
    password = (up.data_dir / "redis" / "password").read_text().strip()
    assert password.encode() not in printed
    assert b"redis        redis://:**@127.0.0.1:" in printed


def test_ctrl_c_stops_everything_up_started(up: Up) -> None:
    assert processes_mentioning(str(up.data_dir))  # the stack's processes exist now
    os.killpg(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(timeout=60) == 0
    wait_until(lambda: processes_mentioning(str(up.data_dir)) == [], 10, "every child to exit")


def test_up_with_a_bad_engine_setup_says_what_is_wrong_and_starts_nothing(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = tmp_path / "data"
    env = cli_env(data, tiny_model_dir, free_port())
    env["ROLLSERVE_VLLM_VENV"] = str(tmp_path / "no-vllm")
    script = rollserve(["up", "--engine", "vllm", "--script", "s.jsonl"], env)
    assert script.returncode == 2
    assert "--script is for the development server" in script.stderr
    model = rollserve(["up", "--model", str(tmp_path)], env)
    assert model.returncode == 2
    assert f"--model {tmp_path}: no config.json there" in model.stderr
    missing = rollserve(["up", "--engine", "vllm", "--model", str(tiny_model_dir)], env)
    assert missing.returncode == 1
    assert "cannot start vLLM" in missing.stderr and "make vllm" in missing.stderr
    assert processes_mentioning(str(data)) == []
    engine = rollserve(["up", "--engine", "sglang"], env)
    assert engine.returncode == 2 and "invalid choice: 'sglang'" in engine.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["worker", "init", "--jobs", "8"], "RUN workers only"),
        (["worker", "eval", "--jobs", "8"], "RUN workers only"),
        (["worker", "run", "--jobs", "0"], "at least 1"),
        (["worker", "run", "--jobs", "8", "--concurrency", "2"], "drop --concurrency"),
        (
            ["worker", "run", "--jobs", "8", "--autoscale", "4,1"],
            "drop --concurrency and --autoscale",
        ),
        (["up", "--run-jobs", "0"], "--run-jobs must be at least 1"),
    ],
)
def test_bad_many_jobs_options_are_refused_before_anything_starts(
    args: list[str], named: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    env = cli_env(tmp_path, tiny_model_dir, free_port())
    env["ROLLSERVE_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    done = rollserve(args, env)
    assert done.returncode == 2
    assert named in done.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started
