"""The default stack works: `rollserve up` with the development server and the tiny model.

The released Qwen models have an output layer of 151,936 ids while their tokenizer defines
151,669; the tiny Qwen3 has exactly the tokenizer's ids. With any model the development server
never samples an id past the tokenizer (their logits are masked, the logprobs renormalised),
and a backend that does return one (a real server with a padded output layer) ends the episode
with `stop_reason` `invalid_token` instead of failing the job when the next prompt is refused.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import redis

from core.schemas import Backend, BackendSpec, ModelTurn
from routing.chat import ChatTemplater
from routing.pool import BackendPool
from routing.protocol import Completion
from routing.vllm import BackendError, OutOfVocabularyError, VLLMClient
from routing.vllm_generate import VLLMGenerateClient
from workers.agent import Episode, Limits, run_episode
from workers.handlers.math import MathHandler
from workers.routed_policy import RoutedPolicy

if TYPE_CHECKING:
    from tests.support.devserver import DevBackend


REPO = Path(__file__).resolve().parents[2]
TOKENIZER_SIZE = 151669
"""Ids the Qwen tokenizer defines (151,643 BPE ranks and 26 added tokens)."""
PADDED_WIDTH = 151936
"""The output layer of the released Qwen models, padded past the tokenizer."""
PADDED_ID = 151889
"""An id of a padded output layer that the tokenizer does not define."""
IM_END = 151645


# ----------------------------------------------------------------------------- the dev server


def test_the_tiny_models_output_layer_has_exactly_its_tokenizers_ids(
    tiny_model_dir: Path, tiny_tokenizer: Any
) -> None:
    from safetensors import safe_open

    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert len(tiny_tokenizer) == TOKENIZER_SIZE == config["vocab_size"]
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as weights:
        embedding = weights.get_slice("model.embed_tokens.weight").get_shape()
    assert embedding == [TOKENIZER_SIZE, config["hidden_size"]]


def test_the_dev_server_samples_only_ids_its_tokenizer_defines(
    devserver_model: DevBackend, tiny_tokenizer: Any
) -> None:
    url, model, size = devserver_model.url, devserver_model.model, len(tiny_tokenizer)
    messages = [{"role": "user", "content": "What is 2+3? Put it in \\boxed{}."}]
    tokenized = httpx.post(
        f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": True}, timeout=60
    )
    prompt = tokenized.json()["tokens"]
    generated = 0
    for seed in range(8):
        sampling = {"max_tokens": 48, "temperature": 1.0, "seed": seed, "logprobs": 5}
        if seed % 2:
            # vLLM's tokens-only API, which names the top alternatives by id.
            body = {"model": model, "token_ids": prompt, "sampling_params": sampling}
            response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            ids = choice["token_ids"]
            for entry in choice["logprobs"]["content"]:
                alternatives = [int(t["token"].split(":")[1]) for t in entry["top_logprobs"]]
                assert len(alternatives) == 5 and max(alternatives) < size, alternatives
        else:
            body = {"model": model, "prompt": prompt, "return_token_ids": True, **sampling}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            ids = response.json()["choices"][0]["token_ids"]
        assert ids and max(ids) < size, (seed, ids)
        generated += len(ids)
        # The sequence, its ids fed back as the next prompt, is accepted.
        again = httpx.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": prompt + ids, "max_tokens": 1},
            timeout=60,
        )
        assert again.status_code == 200, again.text
    assert generated >= 100


def test_a_model_wider_than_its_tokenizer_never_generates_the_extra_ids(
    tiny_model_dir: Path, tiny_tokenizer: Any
) -> None:
    """Any model directory, not just the tiny one: here the tiny model's output layer is
    padded to the width of the released Qwen models, the padded ids are made the most likely
    by far, and still none is generated."""
    import torch

    from routing.devserver.engine import ModelEngine, Plan, SamplingParams

    engine = ModelEngine(tiny_model_dir)
    size = len(tiny_tokenizer)
    assert engine.vocab_size == size
    engine.model.resize_token_embeddings(PADDED_WIDTH, mean_resizing=False)
    weight = engine.model.get_output_embeddings().weight
    width, hidden = weight.shape
    assert width == PADDED_WIDTH
    with torch.no_grad():
        rows = torch.zeros(width - size, hidden)
        index = torch.arange(width - size)
        # Each padded id points along one hidden axis, either way: for any hidden state some
        # padded id gets a logit far above every real id's.
        rows[index, index % hidden] = torch.where(index % (2 * hidden) < hidden, 40.0, -40.0)
        weight[size:] = rows
    prompt = engine.render_chat(
        [{"role": "user", "content": "Count to three."}], add_generation_prompt=True
    )
    with torch.inference_mode():
        raw = engine.model(torch.tensor([prompt])).logits[0, -1]
    assert int(torch.argmax(raw)) >= size  # unmasked, greedy decoding would pick a padded id
    assert float(torch.softmax(raw, dim=-1)[size:].sum()) > 0.99

    for seed, temperature in [(0, 1.0), (1, 1.0), (2, 1.0), (3, 0.0)]:
        params = SamplingParams(max_tokens=16, temperature=temperature, seed=seed, logprobs=3)
        generation = engine.generate(Plan(prompt_ids=prompt, params=params))
        out = generation.token_ids
        assert out and max(out) < size, (seed, out)
        assert generation.top_logprobs is not None
        assert all(t < size for top in generation.top_logprobs for t, _ in top)
        # The logprobs are those of the distribution sampled from: a teacher-forced pass
        # over the same ids, with the same ids masked, gives them again.
        with torch.inference_mode():
            logits = engine.model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
            logits = logits.float().clone()
            logits[:, size:] = float("-inf")
            expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor([out]).T)[:, 0]
        served = generation.logprobs
        assert max(abs(a - float(b)) for a, b in zip(served, expected, strict=True)) < 1e-4
        scored, _ = engine.score(prompt, out, None)
        assert max(abs(a - b) for a, b in zip(scored, generation.logprobs, strict=True)) < 1e-4


# ----------------------------------------------------------------------------- the clients


def mock_client(
    cls: type[VLLMClient], answer: Any, calls: list[dict[str, Any]] | None = None
) -> VLLMClient:
    """A client of `cls` whose requests are answered by `answer(path, body)` → (status, json)."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        if calls is not None:
            calls.append({"path": request.url.path, "body": body})
        status, data = answer(request.url.path, body)
        return httpx.Response(status, json=data)

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return cls("http://backend", "m", http=http, retries=0)


def refusal(message: str) -> tuple[int, dict[str, Any]]:
    return 400, {"object": "error", "message": message, "type": "BadRequestError", "code": 400}


@pytest.mark.parametrize(
    ("message", "token_id", "size", "refused_from"),
    [
        (
            f"Token id {PADDED_ID} is out of vocabulary (size {TOKENIZER_SIZE}).",
            PADDED_ID,
            151669,
            151669,
        ),
        (f"Token id {PADDED_ID} is out of vocabulary", PADDED_ID, None, PADDED_ID),
        (
            "The input_ids [1, 151937] contains values greater than the vocab size (151936).",
            None,
            151936,
            151936,
        ),
    ],
)
def test_an_out_of_vocabulary_refusal_is_recognised_and_remembered(
    message: str, token_id: int | None, size: int | None, refused_from: int
) -> None:
    client = mock_client(VLLMClient, lambda _path, _body: refusal(message))

    async def scenario() -> None:
        with pytest.raises(OutOfVocabularyError) as caught:
            await client.complete([1, 2, PADDED_ID], max_tokens=4, fit_context=False)
        error = caught.value
        assert (error.status, error.token_id, error.vocab_size) == (400, token_id, size)
        assert error.refused_from == refused_from and not error.retryable
        assert client.refused_from == refused_from
        assert client.first_refused([5, 6, PADDED_ID + 100, 7]) == PADDED_ID + 100
        assert client.first_refused([5, 6, 7]) is None
        await client.aclose()

    asyncio.run(scenario())


def test_other_refusals_stay_plain_backend_errors() -> None:
    client = mock_client(VLLMClient, lambda _path, _body: refusal("max_tokens must be at least 1"))

    async def scenario() -> None:
        with pytest.raises(BackendError) as caught:
            await client.complete([1], max_tokens=4, fit_context=False)
        assert not isinstance(caught.value, OutOfVocabularyError)
        assert client.refused_from is None
        await client.aclose()

    asyncio.run(scenario())


def test_generate_client_keeps_an_out_of_vocabulary_id_and_decodes_the_rest() -> None:
    """The tokens-only API has no text: `/detokenize` is asked, and a server that refuses the
    padded id there gets the ids it knows (the padded id decodes to nothing)."""
    out = [9707, PADDED_ID, IM_END]
    calls: list[dict[str, Any]] = []

    def answer(path: str, body: Any) -> tuple[int, Any]:
        if path == "/inference/v1/generate":
            content = [{"token": f"token_id:{i}", "logprob": -1.0} for i in out]
            choice = {"token_ids": out, "finish_reason": "stop", "logprobs": {"content": content}}
            return 200, {"choices": [choice], "usage": {"prompt_tokens": 3}}
        assert path == "/detokenize"
        if max(body["tokens"]) >= TOKENIZER_SIZE:
            return refusal(f"Token id {PADDED_ID} is out of vocabulary.")
        return 200, {"prompt": "Hello<|im_end|>" if body["tokens"] == [9707, IM_END] else "?"}

    client = mock_client(VLLMGenerateClient, answer, calls)
    completion = asyncio.run(client.complete([1, 2, 3], max_tokens=4, fit_context=False))
    assert completion.output_ids == out and len(completion.logprobs) == 3
    assert completion.text == "Hello<|im_end|>"
    assert [c["body"]["tokens"] for c in calls if c["path"] == "/detokenize"] == [
        out,
        [9707, IM_END],
    ]
    asyncio.run(client.aclose())


# ----------------------------------------------------------------------------- the agent loop

TASK = {"data_source": "math", "instance_id": "sum", "problem": "What is 2+3?", "answer": "5"}
PROMPT = [151644, 872, 198, 3838, 374, 220, 17, 10, 18, 30, 151645, 198, 151644, 77091, 198]
OBSERVATION = [151645, 198, 151644, 872, 198, 5501, 151645, 198, 151644, 77091, 198]


class FakeTemplater:
    async def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return list(PROMPT)

    async def continuation_ids(
        self,
        last_output_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return list(OBSERVATION)


class PaddedBackend:
    """A backend whose model generates a padded id on its first call and whose server, like
    vLLM, refuses any prompt holding it."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def complete(self, prompt_ids: list[int], **params: Any) -> Completion:
        self.prompts.append(list(prompt_ids))
        bad = [i for i in prompt_ids if i >= TOKENIZER_SIZE]
        if bad:
            raise OutOfVocabularyError(
                f"Token id {bad[0]} is out of vocabulary",
                token_id=bad[0],
                vocab_size=None,
                status=400,
                url="http://padded/v1/completions",
            )
        if prompt_ids == PROMPT:  # the first turn: no answer yet, and a padded id
            ids, text = [40, 1744, PADDED_ID, 432, 374], "I think it is"
        else:
            ids, text = [59, 79075, 90], "\\boxed{5}"
        return Completion(ids, [-1.5] * len(ids), text, "length", None, len(prompt_ids))

    async def max_model_len(self) -> int:
        return 4096


class KnowingBackend(PaddedBackend):
    """The same backend, whose client already learnt which ids it refuses."""

    def first_refused(self, ids: list[int]) -> int | None:
        return next((i for i in ids if i >= TOKENIZER_SIZE), None)


LIMITS = Limits(max_turns=4, max_total_tokens=4096, max_tokens=5)


def episode(policy: Any) -> Episode:
    handler = MathHandler()
    return asyncio.run(
        run_episode(
            handler, TASK, handler.initial_messages(TASK), None, policy, FakeTemplater(), LIMITS
        )
    )


def check_kept_and_graded(result: Episode) -> None:
    assert result.stop_reason == "invalid_token" and not result.truncated
    builder = result.builder
    first = builder.turns[0]
    assert isinstance(first, ModelTurn)
    assert first.output_ids == [40, 1744, PADDED_ID, 432, 374]  # as the backend returned them
    assert builder.model_turns == 1
    assert builder.response_ids[:5] == first.output_ids and builder.loss_mask[:5] == [1] * 5
    assert len(builder.response_ids) == len(builder.loss_mask) == len(builder.logprobs)
    grade = MathHandler().grade(TASK, builder.assistant_texts, job_id="job-1")
    assert grade.reward == 0.0


def test_a_refused_generated_id_ends_the_episode_with_its_own_stop_reason() -> None:
    backend = PaddedBackend()
    result = episode(backend)
    check_kept_and_graded(result)
    # The second call was refused: its prompt is the first turn and the observation.
    assert len(backend.prompts) == 2 and PADDED_ID in backend.prompts[1]
    assert [t.type for t in result.builder.turns] == ["model", "env"]


def test_a_known_refused_id_ends_the_episode_before_the_prompt_is_sent() -> None:
    backend = KnowingBackend()
    result = episode(backend)
    check_kept_and_graded(result)
    assert len(backend.prompts) == 1


def test_a_refusal_of_an_id_the_model_did_not_generate_still_fails() -> None:
    class RefusesAll(PaddedBackend):
        async def complete(self, prompt_ids: list[int], **params: Any) -> Completion:
            raise OutOfVocabularyError(
                "Token id 999999 is out of vocabulary", token_id=999999, vocab_size=None
            )

    with pytest.raises(OutOfVocabularyError):
        episode(RefusesAll())


def test_the_routed_policy_raises_the_refusal_and_keeps_the_backend(
    redis_client: redis.Redis,
) -> None:
    pool = BackendPool(redis_client)
    pool.register(BackendSpec(url="http://padded:8000", model="m", id="padded"))
    backend = KnowingBackend()

    def clients_of(_backend: Backend) -> tuple[Any, ChatTemplater]:
        return backend, ChatTemplater(backend)  # type: ignore[arg-type]

    policy = RoutedPolicy(pool, "job-1", clients_of)
    assert policy.first_refused([PADDED_ID]) is None  # no backend routed to yet
    with pytest.raises(OutOfVocabularyError):
        asyncio.run(policy.complete([1, PADDED_ID], max_tokens=2))
    assert pool.get("padded").state == "healthy"  # type: ignore[union-attr]
    assert policy.first_refused([1, PADDED_ID]) == PADDED_ID

    routed = RoutedPolicy(pool, "job-2", clients_of)
    result = asyncio.run(
        run_episode(MathHandler(), TASK, [], None, routed, FakeTemplater(), LIMITS)
    )
    check_kept_and_graded(result)
    assert pool.get("padded").state == "healthy"  # type: ignore[union-attr]
