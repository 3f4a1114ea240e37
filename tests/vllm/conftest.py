"""Fixtures of the tests against a real vLLM (the CPU build `make vllm` installs).

- `vllm_server`: ONE vLLM server for the whole session, serving the tiny model (started in its
  own process group from `deploy.engine`'s command and environment, warmed up with the
  requests rollserve sends, stopped with its whole group at the end). It loads the logits
  processor of `engine_plugins/scripted_tool_calls.py`, which makes the random model call
  `TOOL_CALLS` in a prompt with tools and leaves every other prompt alone;
- `stack`: Redis, workers and gateway with no backend of their own, for this directory;
  `registered` puts a backend (vLLM itself or a proxy in front of it) behind it for a while;
- `engine_metrics`: the server's Prometheus counters, summed over their labels.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.processes import free_port, spawn, stop_group
from core.settings import Settings
from deploy.engine import vllm_argv, vllm_env, wait_served
from deploy.stack import Stack, StackOptions
from deploy.vllm_env import VllmStatus
from routing.vllm import VLLMClient
from routing.vllm_generate import VLLMGenerateClient

READY_TIMEOUT = 600.0
"""Seconds vLLM may take to serve (60-90 s on an idle 2-core machine, more when loaded)."""
WARM_UP_TIMEOUT = 300.0
"""Seconds the first completion may take (about 25 s on an idle 2-core machine)."""


PLUGINS = Path(__file__).parent / "engine_plugins"
"""Modules the vLLM server imports (from its own virtualenv)."""
SCRIPTED_CALLS = "ROLLSERVE_SCRIPTED_TOOL_CALLS"
"""The configuration of `engine_plugins/scripted_tool_calls.py`."""
TOOL_CALLS = [
    {
        "name": "bash",
        # The sleep keeps a job between its two turns for a while: long enough for a test to
        # act there (a drain before the second request, tests/vllm/test_fleet.py).
        "arguments": {
            "command": "echo hi > /workspace/hello.txt && sleep 3 && cat /workspace/hello.txt"
        },
    },
    {"name": "finish", "arguments": {"result": "wrote hello.txt"}},
]
"""What the model is made to call in a prompt with tools: the first, then (once a tool result
is in the prompt) the second."""


SHELL_TASK = {
    "data_source": "shell",
    "instance_id": "fleet-update",
    "instruction": "Write hi into /workspace/hello.txt.",
    "check": 'test "$(cat /workspace/hello.txt)" = hi',
}
"""Exactly two model turns, whatever the weights: the server's logits processor makes the
first a bash call (`TOOL_CALLS`: it sleeps 3 s) and the second, after the tool result, a
finish call; so the job is between its turns for seconds once the first is in, and no
sampled text can end it early. It needs bubblewrap (a `shell` task's box)."""


ENDLESS = "<|fim_pad|>"
"""A prompt holding this token cannot end by itself on the session's server: its logits
processor bans the end tokens there, so the answer runs to `max_tokens`."""


def scripted_tool_calls(model_dir: Path) -> dict[str, Any]:
    """The scripted tool calls' configuration: each call in the Qwen3 / Hermes convention,
    ended with `<|im_end|>`, as ids of the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scripts = [
        tokenizer.encode(
            f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>", add_special_tokens=False
        )
        for call in TOOL_CALLS
    ]
    trigger, marker, endless, *end_ids = tokenizer.convert_tokens_to_ids(
        ["<tool_call>", "<tool_response>", ENDLESS, "<|im_end|>", "<|endoftext|>"]
    )
    return {
        "trigger": trigger,
        "turn_marker": marker,
        "scripts": scripts,
        "endless": endless,
        "end_ids": end_ids,
    }


@dataclass(frozen=True)
class VllmServer:
    url: str
    model: str
    """The served model name."""
    model_dir: Path
    log: Path
    ready_seconds: float
    warm_up_seconds: float


@pytest.fixture(scope="session")
def vllm_server(
    vllm_install: VllmStatus, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A real vLLM serving the tiny model, shared by every test of the session."""
    scratch = tmp_path_factory.mktemp("vllm")
    port = free_port()
    model = tiny_model_dir.name
    log = scratch / "vllm.log"
    plugin = ["--logits-processors", "scripted_tool_calls:ScriptedToolCalls"]
    argv = vllm_argv(vllm_install, tiny_model_dir, port, model, extra_args=plugin)
    env = vllm_env(scratch / "run")
    env["PYTHONPATH"] = os.pathsep.join([str(PLUGINS), env["PYTHONPATH"]])
    env[SCRIPTED_CALLS] = json.dumps(scripted_tool_calls(tiny_model_dir))
    started = time.monotonic()
    proc = spawn(argv, env=env, log_path=str(log))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_served(url, proc, log, READY_TIMEOUT)
        ready = time.monotonic() - started
        # The first requests warm the engine up (about 25 s on an idle machine): the ones
        # rollserve sends (a chat rendered by /tokenize, a seeded completion with logprobs),
        # before any test.
        timings = asyncio.run(warm_up(url, model))
        warm = sum(timings.values())
        print(
            f"\nvLLM served after {ready:.0f}s; warm-up "
            + ", ".join(f"{what} {t:.1f}s" for what, t in timings.items())
        )
        yield VllmServer(url, model, tiny_model_dir, log, ready, warm)
    finally:
        stop_group(proc, timeout=30)


async def warm_up(url: str, model: str) -> dict[str, float]:
    """Seconds each of rollserve's first requests took."""
    timings: dict[str, float] = {}
    began = time.monotonic()
    async with VLLMClient(url, model, timeout=WARM_UP_TIMEOUT) as client:
        messages = [{"role": "user", "content": "Warm up. " * 100}]
        prompt = await client.tokenize_chat(messages, add_generation_prompt=True)
    timings["/tokenize"] = time.monotonic() - began
    for api, kind in (("completions", VLLMClient), ("generate", VLLMGenerateClient)):
        began = time.monotonic()
        async with kind(url, model, timeout=WARM_UP_TIMEOUT) as client:
            await client.complete(prompt, max_tokens=4, seed=0, cache_salt="warm-up")
        timings[api] = time.monotonic() - began
    return timings


def engine_metrics(url: str) -> dict[str, float]:
    """The `vllm:` series of the server's `/metrics`, each summed over its labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for match in re.finditer(r"^(vllm:[a-z_:]+)(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE):
        totals[match[1]] = totals.get(match[1], 0.0) + float(match[2])
    return totals


def settled_metrics(url: str, pause: float = 0.3) -> dict[str, float]:
    """`engine_metrics` once two readings `pause` apart agree on the prefix-cache counters
    (the engine records a step's stats just after answering)."""
    keys = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    last = engine_metrics(url)
    for _ in range(20):
        time.sleep(pause)
        now = engine_metrics(url)
        if all(now.get(k) == last.get(k) for k in keys):
            return now
        last = now
    return last


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory, vllm_server: VllmServer) -> Iterator[Stack]:
    """Redis, one worker per queue and the gateway; no backend until a test registers one."""
    data = tmp_path_factory.mktemp("vllm-stack")
    # Boxes of its own: a reaper of another stack on this host (another Redis) would take a
    # box in a shared directory for an orphan, its job unknown there.
    settings = Settings(data_dir=data, port=free_port(), sandbox_dir=data / "boxes")
    running = Stack(settings, StackOptions(workers={"init": 1, "run": 1, "eval": 1})).start()
    try:
        yield running
    finally:
        running.stop()


@contextmanager
def registered(
    stack: Stack,
    url: str,
    model: str,
    *,
    api: str,
    backend_id: str,
    policy_version: int | None = None,
) -> Iterator[str]:
    """The backend at `url` registered (and the stack ready) until the block ends."""
    spec: dict[str, Any] = {"url": url, "kind": "vllm", "model": model, "api": api}
    spec["id"] = backend_id
    if policy_version is not None:
        spec["policy_version"] = policy_version
    answer = httpx.post(f"{stack.gateway_url}/v1/backends", json=spec, timeout=30)
    assert answer.status_code == 201, answer.text
    try:
        began = time.monotonic()
        stack.wait_ready(60)
        print(
            f"\n{backend_id} registered; the stack was ready {time.monotonic() - began:.1f}s later"
        )
        yield backend_id
    finally:
        httpx.delete(f"{stack.gateway_url}/v1/backends/{backend_id}", timeout=30)


def resume(stack: Stack, backend_id: str, policy_version: int) -> None:
    """Announce new weights on a backend (`POST /v1/backends/{id}/resume`)."""
    answer = httpx.post(
        f"{stack.gateway_url}/v1/backends/{backend_id}/resume",
        json={"policy_version": policy_version},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: Path) -> Any:
    """The tiny model in transformers, float32, for teacher-forced recomputations."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
