"""VLLMClient against the development server: token ids in and out, retries, errors."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from broker.processes import free_port
from routing.vllm import BackendError, VLLMClient

if TYPE_CHECKING:
    from tests.support.devserver import DevBackend


IM_END = 151645


async def prompt_for(backend: DevBackend, text: str) -> list[int]:
    async with backend.client() as client:
        return await client.tokenize_chat(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )


async def test_complete_returns_exact_ids_logprobs_and_finish_reason(
    devserver_script: DevBackend,
) -> None:
    prompt = await prompt_for(devserver_script, "What is the capital of France?")
    async with devserver_script.client() as client:
        done = await client.complete(prompt, max_tokens=32, seed=1)
        paris = await client.tokenize("Lyon?")
    assert done.output_ids == [*paris, IM_END]
    assert len(done.logprobs) == len(done.output_ids)
    assert all(lp < 0 for lp in done.logprobs)
    assert done.text == "Lyon?<|im_end|>"
    assert (done.finish_reason, done.stop_reason) == ("stop", None)
    assert done.prompt_tokens == len(prompt)


async def test_complete_keeps_the_stop_string_and_its_ids(devserver_script: DevBackend) -> None:
    prompt = await prompt_for(devserver_script, "Spell it")
    async with devserver_script.client() as client:
        done = await client.complete(prompt, max_tokens=32, stop=["STOP"])
        assert await client.detokenize(done.output_ids) == "alpha STOP"
    assert (done.text, done.finish_reason, done.stop_reason) == ("alpha STOP", "stop", "STOP")


async def test_complete_lowers_max_tokens_to_what_the_context_leaves(
    devserver_script: DevBackend,
) -> None:
    prompt = [100] * (4096 - 3)
    async with devserver_script.client() as client:
        done = await client.complete(prompt, max_tokens=1000)
    assert len(done.output_ids) == 3
    assert done.finish_reason == "length"


async def test_prompt_filling_the_context_is_a_400_backend_error(
    devserver_script: DevBackend,
) -> None:
    async with devserver_script.client(retries=3, backoff=0.01) as client:
        with pytest.raises(BackendError) as caught:
            await client.complete([100] * 4096, max_tokens=16)
    assert caught.value.status == 400
    assert "context length" in caught.value.message
    assert devserver_script.url in str(caught.value)


async def test_5xx_answers_are_retried_until_one_succeeds(devserver_script: DevBackend) -> None:
    prompt = await prompt_for(devserver_script, "Flaky twice")
    async with devserver_script.client(retries=3, backoff=0.01) as client:
        done = await client.complete(prompt, max_tokens=16)
    assert done.text == "recovered<|im_end|>"


async def test_5xx_after_the_last_retry_is_a_backend_error(devserver_script: DevBackend) -> None:
    prompt = await prompt_for(devserver_script, "Broken for a while")
    async with devserver_script.client(retries=1, backoff=0.01) as client:
        with pytest.raises(BackendError) as caught:
            await client.complete(prompt, max_tokens=16)
        assert caught.value.status == 502
        assert "after 2 attempts" in str(caught.value)
        # Both scripted failures were used up by the two attempts: the next call succeeds.
        assert (await client.complete(prompt, max_tokens=16)).text == "healed<|im_end|>"


async def test_4xx_is_raised_at_once_without_retrying(devserver_script: DevBackend) -> None:
    prompt = await prompt_for(devserver_script, "Refuse once")
    async with devserver_script.client(retries=3, backoff=0.01) as client:
        with pytest.raises(BackendError) as caught:
            await client.complete(prompt, max_tokens=16)
        assert caught.value.status == 400
        assert not caught.value.retryable
        # One attempt only: the entry had a single failure to give, so this one succeeds.
        assert (await client.complete(prompt, max_tokens=16)).text == "accepted<|im_end|>"


async def test_unreachable_server_is_a_backend_error_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    async with VLLMClient(url, "m", retries=2, backoff=0.01) as client:
        with pytest.raises(BackendError) as caught:
            await client.tokenize("x")
        assert not await client.health()
    assert caught.value.status is None
    assert url in str(caught.value) and "after 3 attempts" in str(caught.value)
    assert time.monotonic() - started < 5


async def test_a_redirect_is_not_followed() -> None:
    """A backend is reached only at the address it was registered (and checked) with: one
    that answers with a redirect, say to an internal address, gets an error, and nothing
    is sent where it points."""
    from aiohttp import web

    hits: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{target_port}{request.path}")

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"tokens": [1, 2], "count": 2, "max_model_len": 8})

    runners = []
    ports = []
    for handler in (redirect, record):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        ports.append(port)
    target_port = ports[1]
    try:
        async with VLLMClient(f"http://127.0.0.1:{ports[0]}", "m", retries=0) as client:
            with pytest.raises(BackendError) as caught:
                await client.tokenize("x")
        assert hits == []
        assert f"127.0.0.1:{ports[0]}" in str(caught.value)
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_tokenize_detokenize_and_max_model_len(devserver_script: DevBackend) -> None:
    async with devserver_script.client() as client:
        ids = await client.tokenize("Hello world")
        assert ids == [9707, 1879]
        assert await client.detokenize([*ids, IM_END]) == "Hello world<|im_end|>"
        assert await client.max_model_len() == 4096
        assert await client.health()


async def test_many_requests_at_once_share_one_pool(devserver_script: DevBackend) -> None:
    """A thousand-job worker sends hundreds of requests at once to one server: every one is
    answered, through the one connection pool of the loop, which later requests reuse."""
    import asyncio

    async with devserver_script.client() as client:
        await client.tokenize("warm")
        pool = client._pool()
        texts = await asyncio.gather(*(client.tokenize(f"text {i}") for i in range(300)))
        assert len(texts) == 300 and all(texts)
        assert client._pool() is pool and not pool.closed
        assert await client.tokenize("one more") == await client.tokenize("one more")
    assert pool.closed


def test_a_client_whose_loop_goes_away_is_discarded_without_running_it(
    devserver_script: DevBackend,
) -> None:
    """A worker whose event loop broke (a time limit mid-await) drops that loop's clients:
    their pools are closed without running the loop again, so none is reported unclosed when
    collected; the next request opens a fresh pool."""
    import asyncio
    import gc
    import warnings

    loop = asyncio.new_event_loop()
    client = VLLMClient(devserver_script.url, devserver_script.model, retries=0)
    try:
        assert loop.run_until_complete(client.tokenize("before"))
        pool = client._session
        assert pool is not None and not pool.closed
        client.discard()
        assert pool.closed and client._session is None
    finally:
        loop.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del pool
        gc.collect()
    # Its sockets close when collected (Python's own ResourceWarning, off by default);
    # aiohttp's report of an unclosed session, which it logs as an error, is not made.
    reports = [str(w.message) for w in caught]
    assert not [r for r in reports if "client session" in r or "connector" in r], reports
    assert asyncio.run(client.tokenize("after"))  # another loop: a new pool
    asyncio.run(client.aclose())


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("pool", ["aiohttp", "httpx"])
async def test_an_answer_past_the_bound_is_a_backend_error(
    chunked: bool, pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend cannot make a worker read (and hold) an answer of any size: past
    `MAX_REPLY_BYTES`, declared or streamed, the request fails naming the bound."""
    import httpx
    from aiohttp import web

    import routing.vllm

    monkeypatch.setattr(routing.vllm, "MAX_REPLY_BYTES", 4096)
    body = b'{"tokens": [' + b"1, " * 5000 + b'1], "count": 5001}'

    async def huge(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=body, content_type="application/json")
        answer = web.StreamResponse(headers={"Content-Type": "application/json"})
        answer.enable_chunked_encoding()
        await answer.prepare(request)
        for start in range(0, len(body), 1000):
            await answer.write(body[start : start + 1000])
        await answer.write_eof()
        return answer

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", huge)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    http = httpx.AsyncClient() if pool == "httpx" else None
    try:
        url = f"http://127.0.0.1:{port}"
        async with VLLMClient(url, "m", retries=0, http=http) as client:
            with pytest.raises(BackendError, match="longer than 4096 bytes"):
                await client.tokenize("x")
    finally:
        if http is not None:
            await http.aclose()
        await runner.cleanup()
