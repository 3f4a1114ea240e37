"""The development server answers out-of-range sampling parameters with a 400, as vLLM does,
never a 500 (a 5xx would make the workers mark a healthy backend dead)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from tests.support.devserver import DevBackend


PROMPT = [9707, 1879]


def post_raw(model_server: DevBackend, path: str, raw: str) -> httpx.Response:
    return httpx.post(
        f"{model_server.url}{path}",
        content=raw.encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )


def completion(model_server: DevBackend, sampling: str) -> str:
    return f'{{"model": "{model_server.model}", "prompt": {PROMPT}, "max_tokens": 2, {sampling}}}'


CASES = [
    ('"seed": 1180591620717411303424', "seed"),
    ('"seed": 18446744073709551616', "seed"),
    ('"seed": -9223372036854775809', "seed"),
    ('"temperature": NaN', "temperature"),
    ('"temperature": Infinity', "temperature"),
    ('"logprobs": 10000000', "logprobs"),
]


@pytest.mark.parametrize(("sampling", "param"), CASES, ids=[c for c, _ in CASES])
def test_completions_refuse_out_of_range_params_with_a_400(
    model_server: DevBackend, sampling: str, param: str
) -> None:
    answer = post_raw(model_server, "/v1/completions", completion(model_server, sampling))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "BadRequestError"
    assert param in error["message"] or error["param"] == param


def test_the_largest_64_bit_seeds_are_accepted(model_server: DevBackend) -> None:
    for seed in (2**63 - 1, -(2**63)):
        answer = post_raw(
            model_server, "/v1/completions", completion(model_server, f'"seed": {seed}')
        )
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"seed": 2**70}}),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"sampling_seed": 2**64}}),
        (
            "/generate",
            {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 10**7},
        ),
    ],
)
def test_the_other_apis_refuse_them_too(model_server: DevBackend, path: str, body: Any) -> None:
    answer = httpx.post(f"{model_server.url}{path}", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    nan = post_raw(
        model_server, "/generate", '{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}'
    )
    assert nan.status_code == 400, nan.text
