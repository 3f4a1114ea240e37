"""Weight updates on the development server: SGLang's `/update_weights_from_disk`, vLLM's
development-mode endpoints, and `routing.weights.load_weights` speaking both."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from core.schemas import Backend
from routing.weights import WeightUpdateError, load_weights
from tests.support.devserver import DevBackend
from tests.support.weights import WeightDirs, max_diff, teacher_forced

PROMPT = list(range(1000, 1070))
"""A fixed prompt of 70 ids: four full blocks of the prefix cache."""


@pytest.fixture
def server(
    devserver_factory: Callable[..., DevBackend], weight_dirs: WeightDirs
) -> Iterator[DevBackend]:
    """A model-mode development server of its own, given back with its first weights."""
    backend = devserver_factory("weights", args=["--max-model-len", "2048"])
    yield backend
    httpx.post(f"{backend.url}/resume", timeout=30)
    answer = httpx.post(
        f"{backend.url}/update_weights_from_disk",
        json={"model_path": str(weight_dirs.original), "weight_version": "default"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text


def as_backend(server: DevBackend, kind: str) -> Backend:
    return Backend(id=f"dev-{kind}", url=server.url, kind=kind, model=server.model, registered_at=0)


def complete(
    server: DevBackend, prompt: list[int] = PROMPT, **extra: Any
) -> tuple[list[int], list[float]]:
    """Greedy ids and their logprobs, from vLLM's `/v1/completions`."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0}
    body |= {"logprobs": 0, "return_token_ids": True, **extra}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def sglang_generate(server: DevBackend) -> tuple[list[int], list[float]]:
    body = {"input_ids": PROMPT, "return_logprob": True}
    body["sampling_params"] = {"max_new_tokens": 6, "temperature": 0.0}
    answer = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    meta = answer.json()["meta_info"]
    return answer.json()["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]]


def assert_served_by(server: DevBackend, dirs: WeightDirs, which: str) -> None:
    """The server's logprobs are those of the model in `which` and not of the others."""
    ids, lps = complete(server)
    assert max_diff(lps, teacher_forced(getattr(dirs, which), PROMPT, ids)) < 1e-4
    others = [d for d in ("original", "perturbed") if d != which]
    for other in others:
        assert max_diff(lps, teacher_forced(getattr(dirs, other), PROMPT, ids)) > 1e-2


def test_update_weights_from_disk_answers_as_sglang_and_serves_the_new_weights(
    server: DevBackend, weight_dirs: WeightDirs
) -> None:
    assert_served_by(server, weight_dirs, "original")
    answer = httpx.post(
        f"{server.url}/update_weights_from_disk",
        json={"model_path": str(weight_dirs.perturbed), "weight_version": "step-1"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to step-1.",
        "num_paused_requests": 0,
    }
    assert_served_by(server, weight_dirs, "perturbed")
    ids, lps = sglang_generate(server)  # SGLang's dialect is served by the same weights
    assert max_diff(lps, teacher_forced(weight_dirs.perturbed, PROMPT, ids)) < 1e-4
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(f"{server.url}{path}", timeout=30).json()
        assert info["model_path"] == str(weight_dirs.perturbed)
        assert info["weight_version"] == "step-1"
        assert info["architectures"] == ["Qwen3ForCausalLM"]


def test_a_checkpoint_of_another_shape_is_refused_and_the_old_weights_kept(
    server: DevBackend, weight_dirs: WeightDirs
) -> None:
    before = complete(server)
    answer = httpx.post(
        f"{server.url}/update_weights_from_disk",
        json={"model_path": str(weight_dirs.mismatched)},
        timeout=120,
    )
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["success"] is False and body["num_paused_requests"] == 0
    assert "intermediate_size" in body["message"] and "kept" in body["message"]
    assert complete(server) == before
    info = httpx.get(f"{server.url}/model_info", timeout=30).json()
    assert info["model_path"] == str(weight_dirs.original)
    missing = httpx.post(f"{server.url}/update_weights_from_disk", json={}, timeout=30)
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["model_path"]
    nowhere = httpx.post(
        f"{server.url}/update_weights_from_disk",
        json={"model_path": str(weight_dirs.original / "nowhere")},
        timeout=30,
    )
    assert nowhere.status_code == 400 and "no config.json" in nowhere.json()["message"]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_load_weights_switches_the_server_and_its_prefix_cache_starts_empty(
    server: DevBackend, weight_dirs: WeightDirs, kind: str
) -> None:
    complete(server)
    hits = server.metric("vllm:prefix_cache_hits_total")
    complete(server)
    assert server.metric("vllm:prefix_cache_hits_total") > hits  # the prompt is cached
    seconds = asyncio.run(
        load_weights(as_backend(server, kind), str(weight_dirs.perturbed), timeout=120)
    )
    assert seconds > 0
    hits = server.metric("vllm:prefix_cache_hits_total")
    assert_served_by(server, weight_dirs, "perturbed")
    # Nothing computed under the old weights is reused; what the new ones compute is.
    assert server.metric("vllm:prefix_cache_hits_total") == hits
    complete(server)
    assert server.metric("vllm:prefix_cache_hits_total") > hits
    assert httpx.get(f"{server.url}/is_paused", timeout=30).json() == {"is_paused": False}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_load_weights_names_the_backend_and_what_the_engine_said(
    server: DevBackend, weight_dirs: WeightDirs, kind: str
) -> None:
    before = complete(server)
    backend = as_backend(server, kind)
    with pytest.raises(WeightUpdateError) as caught:
        asyncio.run(load_weights(backend, str(weight_dirs.mismatched), timeout=120))
    message = str(caught.value)
    assert f"backend dev-{kind}" in message and server.url in message
    assert "intermediate_size" in message and "refused" in message
    assert caught.value.backend_id == f"dev-{kind}"
    # Refused before anything was touched: the engine serves on, with the old weights.
    assert complete(server) == before


def test_load_weights_reports_an_engine_without_weight_updates() -> None:
    backend = Backend(
        id="nobody", url="http://127.0.0.1:9", kind="vllm", model="m", registered_at=0
    )
    with pytest.raises(WeightUpdateError, match=r"backend nobody .*POST /pause failed"):
        asyncio.run(load_weights(backend, "/models/step-1", timeout=10))


def test_an_update_waits_for_the_request_in_flight_which_keeps_its_weights(
    server: DevBackend, weight_dirs: WeightDirs
) -> None:
    long = {"max_tokens": 200, "ignore_eos": True}
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(gen=complete(server, **long)))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while server.metric("vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.02)
        answer = httpx.post(
            f"{server.url}/update_weights_from_disk",
            json={"model_path": str(weight_dirs.perturbed)},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
    finally:
        thread.join(120)
    ids, lps = result["gen"]
    assert len(ids) == 200
    # SGLang's semantics: the update waited for the request in flight, every token of which
    # came from the old weights (no sequence mixes the two).
    assert max_diff(lps, teacher_forced(weight_dirs.original, PROMPT, ids)) < 1e-4
    assert_served_by(server, weight_dirs, "perturbed")


def test_vllm_pause_holds_new_requests_until_resume(server: DevBackend) -> None:
    paused = httpx.post(f"{server.url}/pause", params={"mode": "wait"}, timeout=30)
    assert paused.status_code == 200 and paused.json() == {"status": "paused"}
    assert httpx.get(f"{server.url}/is_paused", timeout=30).json() == {"is_paused": True}
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(gen=complete(server)))
    thread.start()
    try:
        thread.join(1.0)
        assert "gen" not in result  # held back while paused
        resumed = httpx.post(f"{server.url}/resume", timeout=30)
        assert resumed.status_code == 200 and resumed.json() == {"status": "resumed"}
    finally:
        thread.join(60)
    assert "gen" in result


def test_collective_rpc_refuses_what_it_does_not_serve_as_vllm_does(server: DevBackend) -> None:
    url = f"{server.url}/collective_rpc"
    unknown = httpx.post(url, json={"method": "sleep"}, timeout=30)
    assert unknown.status_code == 500
    assert "has no attribute 'sleep'" in unknown.json()["error"]["message"]
    no_method = httpx.post(url, json={"args": []}, timeout=30)
    assert no_method.status_code == 400
    assert no_method.json() == {"detail": "Missing 'method' in request body"}
    reset = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200 and reset.json() == {"success": True}
