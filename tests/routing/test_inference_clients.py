"""The three inference clients against a live development server: one interface, one convention.

vLLM's `/v1/completions` (VLLMClient), vLLM's `/inference/v1/generate` (VLLMGenerateClient) and
SGLang's native `/generate` (SGLangClient) must give the same ids and logprobs for the same
prompt and seed, the same finish reasons, honour `cache_salt`, abort, and retry alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from broker.processes import free_port
from routing.clients import make_client
from routing.protocol import Completion, InferenceClient
from routing.sglang import SGLangClient
from routing.vllm import BackendError, VLLMClient
from routing.vllm_generate import VLLMGenerateClient
from tests.support.wait import wait_until_async

if TYPE_CHECKING:
    from tests.support.devserver import DevBackend


APIS = ["completions", "generate", "sglang"]
IM_END = 151645
ABORT_SERIES = 'finished_reason="abort"'


def open_client(
    backend: DevBackend | str, api: str, tokenizer: Path, **kwargs: Any
) -> InferenceClient:
    """A client of `api` for a server (or a bare URL), with keyword arguments for its class."""
    url, model = (backend, "m") if isinstance(backend, str) else (backend.url, backend.model)
    if api == "sglang":
        return SGLangClient(url, model, tokenizer=str(tokenizer), **kwargs)
    if api == "generate":
        return VLLMGenerateClient(url, model, **kwargs)
    return VLLMClient(url, model, **kwargs)


async def ask(client: InferenceClient, text: str) -> list[int]:
    return await client.tokenize_chat(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


async def complete_with_each(
    backend: DevBackend, tokenizer: Path, text: str, **kwargs: Any
) -> dict[str, Completion]:
    """The same prompt completed through each API (the prompt rendered by vLLM's /tokenize)."""
    out: dict[str, Completion] = {}
    vllm = open_client(backend, "completions", tokenizer)
    try:
        prompt = await ask(vllm, text)
    finally:
        await vllm.aclose()
    for api in APIS:
        client = open_client(backend, api, tokenizer)
        try:
            out[api] = await client.complete(prompt, **kwargs)
        finally:
            await client.aclose()
    return out


def assert_identical(done: dict[str, Completion]) -> Completion:
    first = done["completions"]
    for api, other in done.items():
        assert other.output_ids == first.output_ids, api
        assert other.logprobs == first.logprobs, api
        assert other.text == first.text, api
        assert other.finish_reason == first.finish_reason, api
        assert other.prompt_tokens == first.prompt_tokens, api
    return first


def abort_count(backend: DevBackend) -> float:
    return sum(
        v
        for k, v in backend.metrics().items()
        if k.startswith("vllm:request_success_total{") and ABORT_SERIES in k
    )


def in_flight(backend: DevBackend) -> float:
    return backend.metric("vllm:num_requests_waiting") + backend.metric("vllm:num_requests_running")


class CountingTransport(httpx.AsyncBaseTransport):
    """Counts the requests that go out (connection attempts included)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


# ----------------------------------------------------------------------------- the factory


def test_make_client_picks_the_class_for_the_kind_and_api() -> None:
    common = {"timeout": 5.0, "retries": 1}
    completions = make_client("vllm", "completions", "http://h:1/", "m", **common)
    generate = make_client("vllm", "generate", "http://h:1", "m", **common)
    sglang = make_client("sglang", "completions", "http://h:1", "m", tokenizer="/tok", **common)
    assert type(completions) is VLLMClient and completions.base_url == "http://h:1"
    assert type(generate) is VLLMGenerateClient
    assert type(sglang) is SGLangClient and sglang.tokenizer_name == "/tok"
    for client in (completions, generate, sglang):
        assert isinstance(client, InferenceClient)
        assert client.retries == 1 and client.timeout == 5.0  # type: ignore[attr-defined]
    assert SGLangClient("http://h:1", "Qwen/Qwen3-8B").tokenizer_name == "Qwen/Qwen3-8B"
    with pytest.raises(ValueError, match="unknown vLLM api"):
        make_client("vllm", "chat", "http://h:1", "m", **common)
    with pytest.raises(ValueError, match="unknown backend kind"):
        make_client("tgi", "completions", "http://h:1", "m", **common)


# ----------------------------------------------------------------------------- tokenization


async def test_sglang_renders_chats_locally_as_vllm_renders_them(
    devserver_script: DevBackend, tiny_model_dir: Path
) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers.",
                "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You add numbers."}]},
        {"role": "user", "content": "What is 1+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "content": "3"},
    ]
    vllm = open_client(devserver_script, "completions", tiny_model_dir)
    sglang = open_client(devserver_script, "sglang", tiny_model_dir)
    try:
        for generation_prompt in (True, False):
            served = await vllm.tokenize_chat(
                messages, add_generation_prompt=generation_prompt, tools=tools
            )
            local = await sglang.tokenize_chat(
                messages, add_generation_prompt=generation_prompt, tools=tools
            )
            assert local == served
    finally:
        await vllm.aclose()
        await sglang.aclose()


@pytest.mark.parametrize("api", APIS)
async def test_tokenize_detokenize_max_model_len_and_health(
    api: str, devserver_script: DevBackend, tiny_model_dir: Path
) -> None:
    client = open_client(devserver_script, api, tiny_model_dir)
    try:
        ids = await client.tokenize("Hello world")
        assert ids == [9707, 1879]
        assert await client.detokenize([*ids, IM_END]) == "Hello world<|im_end|>"
        assert await client.max_model_len() == 4096
        assert await client.health()
    finally:
        await client.aclose()


# ----------------------------------------------------------------------------- completions


async def test_scripted_completion_is_identical_through_every_api(
    devserver_script: DevBackend, tiny_model_dir: Path
) -> None:
    done = await complete_with_each(
        devserver_script, tiny_model_dir, "What is the capital of France?", max_tokens=32, seed=0
    )
    first = assert_identical(done)
    assert first.text == "Paris.<|im_end|>"
    assert first.output_ids[-1] == IM_END
    assert len(first.logprobs) == len(first.output_ids)
    assert all(lp < 0 for lp in first.logprobs)
    assert first.finish_reason == "stop"


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9, "seed": 7}],
    ids=["greedy", "seeded"],
)
async def test_model_completion_is_identical_through_every_api(
    sampling: dict[str, Any], devserver_model: DevBackend, tiny_model_dir: Path
) -> None:
    done = await complete_with_each(
        devserver_model, tiny_model_dir, "Tell me something.", max_tokens=12, **sampling
    )
    first = assert_identical(done)
    assert 1 <= len(first.output_ids) <= 12
    assert first.finish_reason in ("stop", "length")


async def test_finish_reasons_follow_one_convention(
    devserver_script: DevBackend, tiny_model_dir: Path
) -> None:
    by_stop = await complete_with_each(
        devserver_script, tiny_model_dir, "Spell it", max_tokens=32, stop=["STOP"]
    )
    assert assert_identical(by_stop).text == "alpha STOP"
    for api, done in by_stop.items():
        assert (done.finish_reason, done.stop_reason) == ("stop", "STOP"), api
        assert IM_END not in done.output_ids
    by_length = await complete_with_each(devserver_script, tiny_model_dir, "Spell it", max_tokens=2)
    assert len(assert_identical(by_length).output_ids) == 2
    assert {d.finish_reason for d in by_length.values()} == {"length"}
    by_eos = await complete_with_each(devserver_script, tiny_model_dir, "Spell it", max_tokens=32)
    assert assert_identical(by_eos).text == "alpha STOP beta gamma<|im_end|>"
    assert {d.finish_reason for d in by_eos.values()} == {"stop"}
    # vLLM reports no stop reason for EOS; SGLang names the EOS id it matched.
    assert [by_eos[api].stop_reason for api in APIS] == [None, None, IM_END]


@pytest.mark.parametrize("api", APIS)
async def test_max_tokens_is_fitted_to_the_context(
    api: str, devserver_script: DevBackend, tiny_model_dir: Path
) -> None:
    client = open_client(devserver_script, api, tiny_model_dir)
    try:
        done = await client.complete([100] * (4096 - 3), max_tokens=1000)
    finally:
        await client.aclose()
    assert len(done.output_ids) == 3
    assert done.finish_reason == "length"


@pytest.mark.parametrize("api", APIS)
async def test_a_prompt_filling_the_context_is_a_400(
    api: str, devserver_script: DevBackend, tiny_model_dir: Path
) -> None:
    client = open_client(devserver_script, api, tiny_model_dir, retries=3, backoff=0.01)
    try:
        with pytest.raises(BackendError) as caught:
            await client.complete([100] * 4096, max_tokens=16)
    finally:
        await client.aclose()
    assert caught.value.status == 400
    assert "context length" in caught.value.message or "maximum model length" in str(caught.value)


# ----------------------------------------------------------------------------- prefix cache


@pytest.mark.parametrize("api", APIS)
async def test_cache_salt_isolates_prefix_cache_hits(
    api: str, devserver_model: DevBackend, tiny_model_dir: Path
) -> None:
    # 100 ids no other test sends: 6 full blocks of 16 can hit ((100 - 1) // 16).
    base = 20_000 + 1_000 * APIS.index(api)
    prompt = [base + i for i in range(100)]
    client = open_client(devserver_model, api, tiny_model_dir)

    async def hits(salt: str | None) -> float:
        before = devserver_model.metric("vllm:prefix_cache_hits_total")
        await client.complete(prompt, max_tokens=1, temperature=0.0, cache_salt=salt)
        return devserver_model.metric("vllm:prefix_cache_hits_total") - before

    try:
        assert await hits(f"salt-a-{api}") == 0
        assert await hits(f"salt-a-{api}") == 96
        assert await hits(f"salt-b-{api}") == 0
        assert await hits(None) == 0
        assert await hits(None) == 96
        assert await hits(f"salt-b-{api}") == 96
    finally:
        await client.aclose()


# ----------------------------------------------------------------------------- abort


@pytest.mark.parametrize("api", ["completions", "generate"])
async def test_cancelling_a_vllm_request_aborts_it_on_the_server(
    api: str, devserver_script: DevBackend, tiny_model_dir: Path
) -> None:
    client = open_client(devserver_script, api, tiny_model_dir)
    try:
        prompt = await ask(client, f"Hold the line ({api})")
        aborted0, busy0 = abort_count(devserver_script), in_flight(devserver_script)
        task = asyncio.create_task(client.complete(prompt, max_tokens=16, request_id=f"held-{api}"))
        await wait_until_async(
            lambda: in_flight(devserver_script) > busy0, 30, "the request to arrive"
        )
        # Closing the connection is the abort (`generate` also names it to abort_requests).
        await client.abort(f"held-{api}")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await wait_until_async(
            lambda: abort_count(devserver_script) > aborted0, 30, "the abort to count"
        )
        await wait_until_async(
            lambda: in_flight(devserver_script) == busy0, 30, "the server to be idle"
        )
        assert abort_count(devserver_script) == aborted0 + 1
    finally:
        await client.aclose()


async def test_sglang_abort_request_stops_the_named_request(
    devserver_script: DevBackend, tiny_model_dir: Path
) -> None:
    client = open_client(devserver_script, "sglang", tiny_model_dir)
    try:
        prompt = await ask(client, "Hold the line (sglang)")
        aborted0, busy0 = abort_count(devserver_script), in_flight(devserver_script)
        task = asyncio.create_task(client.complete(prompt, max_tokens=16, request_id="held-sgl"))
        await wait_until_async(
            lambda: in_flight(devserver_script) > busy0, 30, "the request to arrive"
        )
        await client.abort("held-sgl")
        done = await asyncio.wait_for(task, 30)
        assert done.finish_reason == "abort"
        assert done.output_ids == [] and done.stop_reason is None
        assert abort_count(devserver_script) == aborted0 + 1
        await client.abort("no-such-request")  # best effort: nothing to abort, no error
    finally:
        await client.aclose()


async def test_generate_abort_names_the_request_as_vllm_does(
    devserver_script: DevBackend, tiny_model_dir: Path
) -> None:
    # vLLM names a request of /inference/v1/generate `generate-tokens-<id>`; its
    # /inference/v1/abort_requests needs that name (a bare id silently aborts nothing).
    client = open_client(devserver_script, "generate", tiny_model_dir)
    try:
        prompt = await ask(client, "Hold the line (generate abort)")
        aborted0, busy0 = abort_count(devserver_script), in_flight(devserver_script)
        task = asyncio.create_task(client.complete(prompt, max_tokens=16, request_id="held-gen"))
        await wait_until_async(
            lambda: in_flight(devserver_script) > busy0, 30, "the request to arrive"
        )
        await client.abort("held-gen")  # the connection stays open: only the route aborts
        done = await asyncio.wait_for(task, 30)
        assert done.finish_reason == "abort"
        assert abort_count(devserver_script) == aborted0 + 1
        await client.abort("no-such-request")  # nothing to abort: 200, no error
    finally:
        await client.aclose()


async def test_generate_client_sends_the_abort_and_checks_the_echoed_prompt() -> None:
    seen: list[tuple[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path == "/inference/v1/abort_requests":
            return httpx.Response(200)
        assert body["return_token_ids"] is True
        return httpx.Response(
            200,
            json={
                "prompt_token_ids": [*body["token_ids"], 9],  # not what was sent
                "choices": [
                    {
                        "token_ids": [5],
                        "finish_reason": "length",
                        "logprobs": {"content": [{"token_id": 5, "logprob": -1.0}]},
                    }
                ],
            },
        )

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    client = VLLMGenerateClient("http://vllm:8000", "m", http=http, retries=0)
    try:
        await client.abort("job-1-2")
        assert seen == [
            ("/inference/v1/abort_requests", {"request_ids": ["generate-tokens-job-1-2"]})
        ]
        with pytest.raises(BackendError, match="changed the prompt ids"):
            await client.complete([1, 2, 3], max_tokens=1, fit_context=False)
    finally:
        await http.aclose()


async def test_sglang_abort_of_a_generating_request_keeps_what_was_generated(
    devserver_model: DevBackend, tiny_model_dir: Path
) -> None:
    # The CPU model generates a long sample for a while; the abort stops it between tokens.
    backend = devserver_model
    client = open_client(backend, "sglang", tiny_model_dir)
    try:
        prompt = await ask(client, "Write a long story.")
        aborted0 = abort_count(backend)
        task = asyncio.create_task(
            client.complete(prompt, max_tokens=1500, temperature=1.0, seed=3, request_id="long")
        )
        await wait_until_async(
            lambda: backend.metric("vllm:num_requests_running") >= 1, 30, "generation"
        )
        await asyncio.sleep(0.3)  # let it generate some ids (none is fine too)
        await client.abort("long")
        done = await asyncio.wait_for(task, 120)
    finally:
        await client.aclose()
    # This seed's sample does not end within 1500 ids, far longer than the abort takes.
    assert done.finish_reason == "abort"
    assert len(done.output_ids) < 1500
    assert len(done.logprobs) == len(done.output_ids)
    assert abort_count(backend) == aborted0 + 1


# ----------------------------------------------------------------------------- retries


@pytest.mark.parametrize("api", APIS)
async def test_a_503_then_success_is_retried(
    api: str, devserver_script: DevBackend, tiny_model_dir: Path
) -> None:
    client = open_client(devserver_script, api, tiny_model_dir, retries=2, backoff=0.01)
    try:
        prompt = await ask(client, f"Flaky once via {api}")
        done = await client.complete(prompt, max_tokens=16)
    finally:
        await client.aclose()
    assert done.text == "back<|im_end|>"
    assert done.finish_reason == "stop"


@pytest.mark.parametrize("api", APIS)
async def test_connection_refused_is_retried_then_raised(api: str, tiny_model_dir: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    transport = CountingTransport()
    async with httpx.AsyncClient(transport=transport) as http:
        client = open_client(url, api, tiny_model_dir, retries=2, backoff=0.01, http=http)
        with pytest.raises(BackendError) as caught:
            await client.complete([1, 2, 3], max_tokens=4, fit_context=False)
        assert not await client.health()
    assert transport.requests == 3 + 1  # three attempts, then the health check
    assert caught.value.status is None and caught.value.retryable
    assert url in str(caught.value) and "after 3 attempts" in str(caught.value)
