"""The development inference server speaks vLLM's HTTP API with a real model behind it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.support.wait import wait_until_async

if TYPE_CHECKING:
    from tests.support.devserver import DevBackend


REPO = Path(__file__).resolve().parents[2]
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643


def post(backend: DevBackend, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{backend.url}{path}", json=body, timeout=60)


def complete(backend: DevBackend, **body: Any) -> dict[str, Any]:
    response = post(backend, "/v1/completions", {"model": backend.model, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat_ids(backend: DevBackend, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    body = {"messages": messages, "add_generation_prompt": True, **extra}
    response = post(backend, "/tokenize", body)
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


TOKEN_IO = {
    "return_token_ids": True,
    "logprobs": 0,
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
}


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def script_server(devservers: dict[str, DevBackend]) -> DevBackend:
    return devservers["script"]


# ----------------------------------------------------------------------------- the tiny model


def test_tiny_model_has_real_qwen_vocabulary_and_special_tokens(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        ENDOFTEXT,
        IM_START,
        IM_END,
    ]
    assert tok.convert_tokens_to_ids(["<tool_call>", "<think>", "</think>"]) == [
        151657,
        151667,
        151668,
    ]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # Qwen2.5's ids for this sentence; the reasoning and tool markers are not special.
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    ids = tok.encode("<think>x</think><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_make_tiny_skips_a_complete_directory(
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from routing.devserver.cli import main

    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert main(["make-tiny", str(tiny_model_dir)]) == 0
    assert "already holds" in capsys.readouterr().out
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_tiny_model_has_a_head_size_vllms_cpu_attention_supports(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["head_dim"] in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0


def test_an_older_tiny_model_is_not_complete_and_make_tiny_replaces_it(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory from before head_dim 32 (vLLM's CPU attention refuses head_dim 16) has
    every file, but is rebuilt rather than served."""
    import shutil

    from routing.devserver.cli import main
    from routing.devserver.tiny import MARKER, is_complete, is_outdated

    old = tmp_path / "tiny-qwen3"
    shutil.copytree(tiny_model_dir, old)
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    (old / MARKER).write_text(json.dumps({"kind": "tiny-qwen3", "seed": 1234}))
    assert not is_complete(old) and is_outdated(old)

    assert main(["make-tiny", str(old)]) == 0
    assert "replacing an older tiny model" in capsys.readouterr().out
    assert is_complete(old) and not is_outdated(old)
    assert json.loads((old / "config.json").read_text())["head_dim"] == 32
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "tiny-qwen3"]
    assert leftovers == []
    # The same seed: the same weights as the session's model.
    built = (old / "model.safetensors").read_bytes()
    assert built == (tiny_model_dir / "model.safetensors").read_bytes()


def test_make_tiny_refuses_a_directory_that_is_not_a_tiny_model(tmp_path: Path) -> None:
    from routing.devserver.tiny import is_outdated, make_tiny_model

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert not is_outdated(tmp_path / "mine")
    with pytest.raises(FileExistsError):
        make_tiny_model(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_importing_the_server_modules_does_not_import_torch() -> None:
    code = (
        "import sys, routing.devserver, routing.devserver.app, routing.devserver.cli, "
        "routing.vllm, routing.chat; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_model_runs_on_the_threads_asked_for_and_zero_is_refused(tiny_model_dir: Path) -> None:
    import torch

    from routing.devserver.engine import ModelEngine

    before = torch.get_num_threads()
    try:
        engine = ModelEngine(tiny_model_dir)
        for threads in (before + 1, 1):
            engine.set_threads(threads)
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "dev-backend", "--threads", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--threads 0" in out.stderr


# ----------------------------------------------------------------------------- model mode


def test_token_id_prompt_returns_token_ids_and_one_logprob_each(model_server: DevBackend) -> None:
    prompt = chat_ids(model_server, ask("Say something."))
    body = complete(model_server, prompt=prompt, max_tokens=12, seed=7, **TOKEN_IO)
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert 1 <= len(choice["token_ids"]) <= 12
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"])
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert choice["finish_reason"] in ("stop", "length")


def tokenizer_logits(logits: Any, tokenizer: Any) -> Any:
    """`logits` with the ids the tokenizer lacks masked, as the server samples from them (a
    model's output layer may be padded past its tokenizer, like Qwen's; the tiny model's is
    not)."""
    masked = logits.float().clone()
    masked[..., len(tokenizer) :] = float("-inf")
    return masked


def test_model_logprobs_equal_teacher_forced_recomputation(
    model_server: DevBackend, tiny_model: Any, tiny_tokenizer: Any
) -> None:
    import torch

    prompt = chat_ids(model_server, ask("Tell me a story."))
    body = complete(
        model_server, prompt=prompt, max_tokens=24, temperature=1.0, top_p=0.9, seed=11, **TOKEN_IO
    )
    out = body["choices"][0]["token_ids"]
    served = body["choices"][0]["logprobs"]["token_logprobs"]
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
        logits = tokenizer_logits(logits, tiny_tokenizer)
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor([out]).T)
    assert len(served) == len(out) == expected.shape[0]
    assert max(abs(a - float(b)) for a, b in zip(served, expected[:, 0], strict=True)) < 1e-4


def test_same_seed_gives_the_same_sample(model_server: DevBackend) -> None:
    prompt = chat_ids(model_server, ask("Pick a word."))
    runs = [
        complete(model_server, prompt=prompt, max_tokens=8, seed=seed, **TOKEN_IO)
        for seed in (5, 5, 6)
    ]
    ids = [r["choices"][0]["token_ids"] for r in runs]
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]


def test_temperature_zero_picks_the_most_likely_id(
    model_server: DevBackend, tiny_model: Any, tiny_tokenizer: Any
) -> None:
    import torch

    prompt = chat_ids(model_server, ask("Greedy?"))
    body = complete(model_server, prompt=prompt, max_tokens=1, temperature=0.0, **TOKEN_IO)
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([prompt])).logits[0, -1]
        best = int(torch.argmax(tokenizer_logits(logits, tiny_tokenizer)))
    assert body["choices"][0]["token_ids"] == [best]


def test_text_prompt_is_tokenized_by_the_server(model_server: DevBackend) -> None:
    body = complete(model_server, prompt="Hello world", max_tokens=2, return_token_ids=True)
    assert body["choices"][0]["prompt_token_ids"] == [9707, 1879]


# ----------------------------------------------------------------------------- script mode


def scripted(backend: DevBackend, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    prompt = chat_ids(backend, messages)
    return complete(
        backend,
        prompt=prompt,
        max_tokens=body.pop("max_tokens", 64),
        **{
            **TOKEN_IO,
            **body,
        },
    )["choices"][0]


def test_script_answers_with_text_then_eos_and_real_logprobs(
    script_server: DevBackend, tiny_model: Any, tiny_tokenizer: Any
) -> None:
    import torch

    prompt = chat_ids(script_server, ask("What is the capital of France?"))
    choice = complete(script_server, prompt=prompt, max_tokens=64, seed=0, **TOKEN_IO)["choices"][0]
    out = choice["token_ids"]
    assert out == [*tiny_tokenizer.encode("Paris.", add_special_tokens=False), IM_END]
    assert choice["text"] == "Paris.<|im_end|>"
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
        logits = tokenizer_logits(logits, tiny_tokenizer)
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor([out]).T)
    served = choice["logprobs"]["token_logprobs"]
    assert max(abs(a - float(b)) for a, b in zip(served, expected[:, 0], strict=True)) < 1e-4


def test_script_longest_match_wins(script_server: DevBackend) -> None:
    assert scripted(script_server, ask("Tell me about France."))["text"].startswith(
        "A country in Europe."
    )
    assert scripted(script_server, ask("The capital of France?"), seed=0)["text"].startswith(
        "Paris."
    )


def test_script_seed_picks_the_sample(script_server: DevBackend) -> None:
    texts = [
        scripted(script_server, ask("The capital of France?"), seed=seed)["text"]
        for seed in (0, 1, 2, 3)
    ]
    assert [t.removesuffix("<|im_end|>") for t in texts] == ["Paris.", "Lyon?", "Paris.", "Lyon?"]


def test_script_without_seed_takes_samples_in_turn(script_server: DevBackend) -> None:
    texts = [scripted(script_server, ask("Round robin please"))["text"] for _ in range(4)]
    assert [t.removesuffix("<|im_end|>") for t in texts] == ["first", "second", "third", "first"]


def test_script_turn_is_the_number_of_assistant_turns_in_the_prompt(
    script_server: DevBackend,
) -> None:
    history = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Are you sure?"},
    ]
    assert scripted(script_server, history, seed=0)["text"] == "Still Paris.<|im_end|>"
    past_end = [
        *history,
        {"role": "assistant", "content": "Still Paris."},
        {"role": "user", "content": "Really?"},
    ]
    assert scripted(script_server, past_end, seed=0)["text"] == "I do not know.<|im_end|>"


def test_script_unmatched_prompt_gets_the_default_text(script_server: DevBackend) -> None:
    assert (
        scripted(script_server, ask("Nothing matches this."))["text"] == "I do not know.<|im_end|>"
    )


def test_script_delay_holds_the_answer(script_server: DevBackend) -> None:
    started = time.monotonic()
    assert scripted(script_server, ask("Be slow"))["text"] == "finally<|im_end|>"
    assert time.monotonic() - started >= 1.0


def in_flight(backend: DevBackend) -> float:
    return backend.metric("vllm:num_requests_waiting") + backend.metric("vllm:num_requests_running")


async def test_delays_overlap_and_the_server_answers_meanwhile(script_server: DevBackend) -> None:
    prompt = chat_ids(script_server, ask("Be slow"))
    body = {"model": script_server.model, "prompt": prompt, "max_tokens": 8}
    busy0 = in_flight(script_server)
    async with httpx.AsyncClient(base_url=script_server.url, timeout=30) as http:
        slow = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(3)]
        # The three delays overlap: all three are held by the server at once ...
        await wait_until_async(
            lambda: in_flight(script_server) >= busy0 + 3, 30, "three slow requests held at once"
        )
        # ... and it answers meanwhile.
        assert (await http.get("/health")).status_code == 200
        assert not any(task.done() for task in slow)
        answers = await asyncio.gather(*slow)
    assert [a.json()["choices"][0]["text"] for a in answers] == ["finally"] * 3


def test_script_file_errors_name_the_line(tmp_path: Path) -> None:
    from routing.devserver.engine import load_script

    path = tmp_path / "script.jsonl"
    path.write_text('{"match": "a", "samples": [["x"]]}\n\n{"match": "b", "samples": []}\n')
    with pytest.raises(ValueError, match=r"script.jsonl:3: .*samples"):
        load_script(path)
    path.write_text('{"match": "a", "samples": ["one turn"], "errors": [200]}\n')
    with pytest.raises(ValueError, match=r":1: .*errors"):
        load_script(path)


# ----------------------------------------------------------------------------- stopping rules


def test_stop_string_stops_and_is_kept_in_the_output(
    script_server: DevBackend, tiny_tokenizer: Any
) -> None:
    choice = scripted(script_server, ask("Spell it"), stop=["STOP"])
    assert choice["text"] == "alpha STOP"
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "STOP")
    # The ids end with the id that completed the stop string; no EOS was generated.
    assert tiny_tokenizer.decode(choice["token_ids"]) == "alpha STOP"
    assert IM_END not in choice["token_ids"]


def test_stop_string_is_cut_from_the_text_unless_asked_to_keep_it(
    script_server: DevBackend,
) -> None:
    choice = scripted(
        script_server, ask("Spell it"), stop=["STOP"], include_stop_str_in_output=False
    )
    assert choice["text"] == "alpha "
    assert choice["stop_reason"] == "STOP"


def test_max_tokens_ends_with_length(script_server: DevBackend) -> None:
    choice = scripted(script_server, ask("Spell it"), max_tokens=2)
    assert len(choice["token_ids"]) == 2
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)


def test_special_tokens_are_skipped_from_text_by_default(script_server: DevBackend) -> None:
    choice = scripted(script_server, ask("Spell it"), skip_special_tokens=True)
    assert choice["text"] == "alpha STOP beta gamma"
    assert choice["token_ids"][-1] == IM_END


# ----------------------------------------------------------------------------- tokenization


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]


def test_tokenize_messages_equals_the_tokenizers_chat_template(
    script_server: DevBackend, tiny_tokenizer: Any
) -> None:
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 1+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
            ],
        },
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "(checked)"},
    ]
    served = post(
        script_server,
        "/tokenize",
        {"messages": messages, "tools": TOOLS, "add_generation_prompt": True},
    ).json()
    # The template gets the arguments as an object, as vLLM hands them over.
    local = json.loads(json.dumps(messages))
    local[2]["tool_calls"][0]["function"]["arguments"] = {"a": 1, "b": 2}
    expected = tiny_tokenizer.apply_chat_template(
        local, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert served["tokens"] == list(expected)
    assert served["count"] == len(expected)
    assert served["max_model_len"] == 4096


def test_tokenize_text_and_detokenize_round_trip(script_server: DevBackend) -> None:
    text = "Hello <|im_end|> wörld\n"
    tokens = post(script_server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert IM_END in tokens
    assert post(script_server, "/detokenize", {"tokens": tokens}).json() == {"prompt": text}


# ----------------------------------------------------------------------------- metrics, errors


def test_prefix_cache_counters_grow_on_a_repeated_prefix(model_server: DevBackend) -> None:
    # A prompt no other test sends: 100 ids, so 6 full blocks of 16 can hit ((100 - 1) // 16).
    prompt = [1000 + i for i in range(100)]
    queries0 = model_server.metric("vllm:prefix_cache_queries_total")
    hits0 = model_server.metric("vllm:prefix_cache_hits_total")
    complete(model_server, prompt=prompt, max_tokens=1)
    assert model_server.metric("vllm:prefix_cache_queries_total") - queries0 == 100
    assert model_server.metric("vllm:prefix_cache_hits_total") - hits0 == 0
    complete(model_server, prompt=prompt, max_tokens=1)
    assert model_server.metric("vllm:prefix_cache_queries_total") - queries0 == 200
    assert model_server.metric("vllm:prefix_cache_hits_total") - hits0 == 96
    assert model_server.metric("vllm:request_success_total") >= 2


def test_prompt_longer_than_the_context_is_a_400(model_server: DevBackend) -> None:
    response = post(model_server, "/v1/completions", {"prompt": [100] * 2040, "max_tokens": 16})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert "context length is only 2048 tokens" in error["message"]


def test_malformed_request_is_a_400_naming_the_field(model_server: DevBackend) -> None:
    response = post(model_server, "/v1/completions", {"prompt": [1, 2], "max_tokens": "many"})
    assert response.status_code == 400
    assert "max_tokens" in response.json()["error"]["message"]


def test_unknown_model_is_a_404(model_server: DevBackend) -> None:
    response = post(model_server, "/v1/completions", {"model": "nope", "prompt": [1, 2]})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "The model `nope` does not exist."


def test_models_lists_the_served_model_and_health_is_ok(model_server: DevBackend) -> None:
    models = httpx.get(f"{model_server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [model_server.model]
    assert models["data"][0]["max_model_len"] == 2048
    assert httpx.get(f"{model_server.url}/health").status_code == 200


# ----------------------------------------------------------------------------- other APIs


def test_vllm_generate_route_answers_vllms_generate_response(script_server: DevBackend) -> None:
    prompt = chat_ids(script_server, ask("What is the capital of France?"))
    sampling = {"max_tokens": 32, "seed": 0, "logprobs": 0, "skip_special_tokens": False}
    response = httpx.post(
        f"{script_server.url}/inference/v1/generate",
        json={"model": script_server.model, "token_ids": prompt, "sampling_params": sampling},
        headers={"X-Request-Id": "gen-1"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["request_id"] == "generate-tokens-gen-1"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == IM_END
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert all(c["logprob"] < 0 and len(c["top_logprobs"]) == 1 for c in content)
    assert body["usage"]["prompt_tokens"] == len(prompt)
    missing = post(
        script_server, "/inference/v1/generate", {"token_ids": [], "sampling_params": {}}
    )
    assert missing.status_code == 400 and "token_ids" in missing.json()["error"]["message"]


def test_sglang_generate_route_answers_sglangs_fields(script_server: DevBackend) -> None:
    prompt = chat_ids(script_server, ask("Spell it"))
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 32, "stop": ["STOP"], "no_stop_trim": True},
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": "sgl-1",
    }
    response = post(script_server, "/generate", body)
    assert response.status_code == 200, response.text
    out = response.json()
    meta = out["meta_info"]
    assert out["text"] == "alpha STOP"
    assert meta["id"] == "sgl-1"
    assert meta["finish_reason"] == {"type": "stop", "matched": "STOP"}
    assert meta["prompt_tokens"] == len(prompt)
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(e[0] < 0 and e[2] is None for e in meta["output_token_logprobs"])
    trimmed = post(script_server, "/generate", {**body, "sampling_params": {"stop": ["STOP"]}})
    assert trimmed.json()["text"] == "alpha "
    too_long = post(script_server, "/generate", {"input_ids": [100] * 4096})
    assert too_long.status_code == 400
    assert post(script_server, "/abort_request", {"rid": "nothing-running"}).status_code == 200


def test_request_id_header_names_the_completion_and_cache_salt_is_validated(
    script_server: DevBackend,
) -> None:
    body = {"model": script_server.model, "prompt": [9707, 1879], "max_tokens": 2}
    named = httpx.post(
        f"{script_server.url}/v1/completions",
        json={**body, "request_id": "from-body"},
        headers={"X-Request-Id": "from-header"},
        timeout=60,
    )
    assert named.json()["id"] == "cmpl-from-header"
    assert complete(script_server, **body, request_id="from-body")["id"] == "cmpl-from-body"
    assert post(script_server, "/v1/completions", {**body, "cache_salt": ""}).status_code == 400


def test_detokenize_answers_vllm_and_sglang_fields(script_server: DevBackend) -> None:
    ids = [9707, 1879, IM_END]
    vllm = post(script_server, "/detokenize", {"tokens": ids}).json()
    assert vllm == {"prompt": "Hello world<|im_end|>"}
    kept = post(script_server, "/detokenize", {"tokens": ids, "skip_special_tokens": False})
    assert kept.json() == {"text": "Hello world<|im_end|>"}
    skipped = post(script_server, "/detokenize", {"tokens": ids, "skip_special_tokens": True})
    assert skipped.json() == {"text": "Hello world"}
