"""`rollserve up --engine vllm` as an operator runs it: a real vLLM started as part of the stack,
registered, serving a job; Ctrl-C stops it and every engine process it spawned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from api.client import RolloutClient
from broker.processes import free_port
from core.schemas import JobStatus, Trajectory
from tests.support.procs import processes_mentioning
from tests.support.wait import wait_until

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_up_with_the_vllm_engine_serves_a_job_and_ctrl_c_stops_every_engine_process(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = tmp_path / "data"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    env.update(ROLLSERVE_DATA_DIR=str(data), ROLLSERVE_PORT=str(port))
    log = (tmp_path / "up.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", "--engine", "vllm", "--model",
         str(tiny_model_dir)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        said = lambda: (tmp_path / "up.log").read_text()  # noqa: E731

        def ready() -> bool:
            assert proc.poll() is None, said()
            return "ready " in said()

        wait_until(ready, 600, "rollserve up --engine vllm to say ready")
        assert "vllm         http://127.0.0.1:" in said()
        [backend] = httpx.get(f"http://127.0.0.1:{port}/v1/backends", timeout=10).json()
        assert (backend["kind"], backend["model"], backend["state"]) == (
            "vllm",
            tiny_model_dir.name,
            "healthy",
        )
        # Loopback is not trust: the engine asks for its key on every route but its liveness
        # probe, the development-mode ones that load weights included; the key is never shown.
        assert backend["api_key_set"] is True and "api_key" not in backend
        vllm = backend["url"]
        assert httpx.get(f"{vllm}/health", timeout=10).status_code == 200
        for method, path, body in [
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"model": tiny_model_dir.name, "prompt": "hi"}),
            ("POST", "/v1/completions", {"model": tiny_model_dir.name, "prompt": "hi"}),
            ("POST", "/collective_rpc", {"method": "rollserve_load_weights", "args": ["/"]}),
            ("POST", "/pause", None),
            ("GET", "/metrics", None),
        ]:
            refused = httpx.request(method, f"{vllm}{path}", json=body, timeout=10)
            assert refused.status_code == 401, (path, refused.status_code, refused.text)
        with RolloutClient(f"http://127.0.0.1:{port}", timeout=300) as client:
            traj = client.submit_rollout(
                {"data_source": "math", "problem": "What is 2+2?", "answer": "4"},
                sampling={"max_tokens": 8, "seed": 0},
                agent={"max_turns": 2},
                wait=True,
                timeout=300,
            )
        assert isinstance(traj, Trajectory) and traj.status is JobStatus.completed, traj
        assert {t.backend_id for t in traj.turns if t.type == "model"} == {backend["id"]}
        engine = processes_mentioning(str(data / "vllm"))
        assert len(engine) >= 2, "vLLM runs an API server and an engine process"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
        log.close()
    assert code == 0, said()
    wait_until(lambda: processes_mentioning(str(data)) == [], 30, "every process to exit")
