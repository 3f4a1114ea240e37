"""The documented commands for serving the tiny model with vLLM are the ones rollserve runs:
the block under "vLLM on a CPU machine" in docs/operating.md is read as bash would read it,
its first two commands are run as written (from the repository root), and its `vllm serve`
line must be `deploy.engine`'s command and environment, flag for flag. That command and
environment are what the session's vLLM server (tests/vllm/conftest.py) is started with and
what every test of this directory is served by, so the documented server is the tested one
without a vLLM start of its own."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.engine import PLUGINS, vllm_argv, vllm_env
from deploy.vllm_env import VllmStatus

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "operating.md"
SECTION = "### vLLM on a CPU machine (`make vllm`)"
MODEL = ".rollserve/tiny-qwen3"


def readme_block() -> str:
    """The first shell block of the guide's vLLM section."""
    text = GUIDE.read_text()
    section = text[text.index(SECTION) :]
    match = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the vLLM section has no shell block"
    return match.group(1)


def commands(block: str) -> list[list[str]]:
    """The block's commands as bash splits them (continuation lines joined)."""
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def flags(argv: list[str]) -> dict[str, str | None]:
    """`--name value` and bare `--name` flags of an argv, by name."""
    found: dict[str, str | None] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            found[word] = value
    return found


def test_the_guides_vllm_commands_run_and_serve_as_rollserve_does(
    vllm_install: VllmStatus, tmp_path: Path
) -> None:
    block = readme_block()
    steps = commands(block)
    assert [step[:2] for step in steps[:3]] == [
        ["make", "vllm"],
        [".venv/bin/rollserve", "dev-backend"],
        ["mkdir", "-p"],
    ], block
    # The first commands, as written: `make vllm` (a no-op once built) and the tiny model.
    for step in steps[:2]:
        done = subprocess.run(step, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (step, done.stdout[-2000:], done.stderr[-2000:])
    assert (ROOT / MODEL / "config.json").is_file()

    [line] = [step for step in steps if ".vllm-venv/bin/vllm" in step]
    split = next(i for i, word in enumerate(line) if "=" not in word)
    assignments, serve = line[:split], line[split:]
    env = dict(word.split("=", 1) for word in assignments)
    pwd = str(ROOT)
    env = {name: value.replace("$PWD", pwd) for name, value in env.items()}

    expected = vllm_argv(vllm_install, Path(MODEL), 8000, MODEL)
    assert Path(serve[0]).resolve() == Path(ROOT / ".vllm-venv/bin/vllm").resolve()
    assert serve[1:3] == expected[1:3] == ["serve", MODEL]
    documented, ours = flags(serve), flags(expected)
    # What the guide leaves to vLLM's defaults: loopback (the guide's server is for this
    # machine's own tests) and the served name (the model path, as given).
    for implied in ("--host", "--served-model-name"):
        ours.pop(implied)
    assert documented == ours

    served = vllm_env(tmp_path)
    if served["TMPDIR"] != str(tmp_path):  # a deep tmp_path: vLLM's sockets go to /tmp
        shutil.rmtree(served["TMPDIR"], ignore_errors=True)
    assert env.pop("PYTHONPATH") == str(PLUGINS) == served["PYTHONPATH"]
    assert env.pop("VLLM_SERVER_DEV_MODE") == served["VLLM_SERVER_DEV_MODE"] == "1"
    assert env.pop("VLLM_CPU_KVCACHE_SPACE") == served["VLLM_CPU_KVCACHE_SPACE"]
    # Caches and temporary files in a directory of their own, which the block makes.
    cache = env.pop("VLLM_CACHE_ROOT")
    assert env.pop("TMPDIR") == cache == f"{pwd}/.rollserve/vllm"
    assert ["mkdir", "-p", ".rollserve/vllm"] in steps
    assert env == {}, f"the guide sets what rollserve does not: {env}"
