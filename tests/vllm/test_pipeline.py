"""Token fidelity through the whole pipeline against a real vLLM, through both of its APIs.

A multi-turn math job runs through the gateway, the workers and a recording proxy in front of
vLLM (`/v1/completions` or `/inference/v1/generate`). Every turn's prompt must be exactly the
ids the engine says it was given (`prompt_token_ids`), every output exactly the ids it
generated (`token_ids`) with its logprobs; the logprobs must equal a teacher-forced float32
recomputation of the whole trajectory with transformers; and vLLM's chat template rendering
(`/tokenize` with messages) must equal transformers' `apply_chat_template`.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from core.schemas import ModelTurn
from deploy.stack import Stack
from tests.vllm.checks import Run, assert_turns_are_the_engines, logprob_differences, recorded_run
from tests.vllm.conftest import VllmServer
from workers.handlers.math import SYSTEM_PROMPT

pytestmark = pytest.mark.vllm

TASK = {"data_source": "math", "instance_id": "sum", "problem": "What is 2+3?", "answer": "5"}
MESSAGES = [
    {"role": "system", "content": SYSTEM_PROMPT},
    {"role": "user", "content": TASK["problem"]},
]
"""What the math handler opens a conversation with (`MathHandler.initial_messages`)."""


@pytest.fixture(scope="module", params=["completions", "generate"])
def run(request: pytest.FixtureRequest, stack: Stack, vllm_server: VllmServer) -> Run:
    api: str = request.param
    sampling = {"temperature": 1.0, "max_tokens": 12, "seed": 7}
    return recorded_run(
        stack, vllm_server, api, f"recorded-{api}", TASK, sampling, {"max_turns": 3}
    )


def test_random_model_runs_every_turn_with_reminders_between(run: Run) -> None:
    assert [t.type for t in run.trajectory.turns] == ["model", "env", "model", "env", "model"]
    assert run.trajectory.stop_reason == "max_turns"
    assert run.trajectory.reward == 0.0


def test_every_turn_is_exactly_what_the_engine_ran_and_generated(run: Run) -> None:
    assert len(run.exchanges) == 3
    assert_turns_are_the_engines(run.api, run.trajectory, run.exchanges)


def test_logprobs_equal_a_teacher_forced_float32_recomputation(run: Run, hf_model: Any) -> None:
    differences = logprob_differences(run.trajectory, hf_model)
    largest = max(differences)
    print(f"\n{run.api}: {len(differences)} logprobs, largest difference {largest:.3g}")
    assert len(differences) >= 3
    assert largest <= 1e-3


def test_first_prompt_rendered_by_vllm_equals_transformers_chat_template(
    run: Run, vllm_server: VllmServer
) -> None:
    from transformers import AutoTokenizer

    answer = httpx.post(
        f"{vllm_server.url}/tokenize",
        json={
            "model": vllm_server.model,
            "messages": MESSAGES,
            "add_generation_prompt": True,
            "add_special_tokens": False,
        },
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    rendered = answer.json()["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    local = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(local, list):  # transformers 5 answers a BatchEncoding
        local = local["input_ids"]
    assert rendered == list(local)
    first = run.trajectory.turns[0]
    assert isinstance(first, ModelTurn)
    assert first.prompt_ids == rendered
