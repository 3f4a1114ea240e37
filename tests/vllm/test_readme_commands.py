"""The documented commands for serving the tiny model with vLLM work as written (only the port
is changed, to a free one): the block under "vLLM on a CPU machine" in docs/operating.md is run
with bash from the repository root, and the server it starts answers a completion."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest

from broker.processes import free_port, spawn, stop_group
from deploy.engine import wait_served
from tests.support.wait import wait_until

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "operating.md"
SECTION = "### vLLM on a CPU machine (`make vllm`)"


def readme_block() -> str:
    """The first shell block of the guide's vLLM section."""
    text = GUIDE.read_text()
    section = text[text.index(SECTION) :]
    match = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the vLLM section has no shell block"
    return match.group(1)


def test_the_readme_serves_the_tiny_model_with_vllm_as_written(tmp_path: Path) -> None:
    block = readme_block()
    assert block.startswith("make vllm\n") and "--port 8000" in block
    port = free_port()
    script = tmp_path / "readme.sh"
    script.write_text("set -e\n" + block.replace("--port 8000", f"--port {port}"))
    log = tmp_path / "readme.log"
    proc = spawn(["bash", str(script)], cwd=str(ROOT), log_path=str(log))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_served(url, proc, log, 600)
        answer = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": ".rollserve/tiny-qwen3",
                "prompt": [151644, 872, 198],
                "max_tokens": 4,
                "return_token_ids": True,
                "logprobs": 0,
            },
            timeout=300,
        )
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0
    finally:
        stop_group(proc, timeout=30)
    assert proc.poll() is not None

    def group_gone() -> bool:
        return subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 1

    wait_until(group_gone, 30, "every process the guide's commands started to end")
