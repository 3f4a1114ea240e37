"""The development server as a stand-in for a loaded fleet: answers after a drawn delay,
unscored scripted answers without a model, and vLLM's end-to-end latency histogram."""

from __future__ import annotations

import json
from pathlib import Path

from routing.devserver.engine import SamplingParams, UnscoredScriptEngine
from routing.devserver.metrics import ServerMetrics


def script_file(tmp_path: Path) -> Path:
    path = tmp_path / "script.jsonl"
    path.write_text(json.dumps({"match": "HELLO", "samples": [["Hi there."]], "delay": 0.5}) + "\n")
    return path


def test_unscored_answers_the_script_with_made_up_logprobs_and_no_model(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    engine = UnscoredScriptEngine(tiny_model_dir, script_file(tmp_path))
    assert not hasattr(engine, "model")  # no weights were loaded
    engine.set_threads(4)  # as the server sets them: nothing to run them, nothing to fail
    prompt = engine.encode("HELLO: say hi")
    plan = engine.plan(prompt, SamplingParams(max_tokens=16, logprobs=2))
    assert plan.delay == 0.5  # the script entry's delay
    gen = engine.generate(plan)
    expected = engine.encode("Hi there.", add_special_tokens=False)
    assert gen.token_ids[: len(expected)] == expected
    assert gen.token_ids[-1] == engine.eos_token_id and gen.finish_reason == "stop"
    assert gen.logprobs == [UnscoredScriptEngine.LOGPROB] * len(gen.token_ids)
    assert gen.top_logprobs is not None
    for tok, top in zip(gen.token_ids, gen.top_logprobs, strict=True):
        assert top[0] == (tok, UnscoredScriptEngine.LOGPROB) and len(top) == 3


def test_unscored_without_a_script_answers_the_default_text(tiny_model_dir: Path) -> None:
    engine = UnscoredScriptEngine(tiny_model_dir, None, default_text="\\boxed{2}")
    gen = engine.generate(engine.plan(engine.encode("anything"), SamplingParams(max_tokens=16)))
    assert gen.text == "\\boxed{2}"


def test_delays_are_drawn_between_delay_and_delay_max(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine = UnscoredScriptEngine(tiny_model_dir, None, delay=1.0, delay_max=5.0)
    delays = [engine.plan([1, 2], SamplingParams(max_tokens=1)).delay for _ in range(200)]
    assert all(1.0 <= d <= 5.0 for d in delays)
    assert min(delays) < 1.5 and max(delays) > 4.5  # spread over the range, not one value
    fixed = UnscoredScriptEngine(tiny_model_dir, None, delay=2.0)
    assert {fixed.plan([1], SamplingParams(max_tokens=1)).delay for _ in range(5)} == {2.0}


def test_a_script_entry_delay_beats_the_drawn_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine = UnscoredScriptEngine(tiny_model_dir, script_file(tmp_path), delay=1.0, delay_max=5.0)
    assert engine.plan(engine.encode("HELLO"), SamplingParams(max_tokens=1)).delay == 0.5


def test_e2e_latency_histogram_counts_finished_requests() -> None:
    metrics = ServerMetrics("tiny")
    text = metrics.render().decode()
    assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 0.0' in text
    metrics.record_finished([1, 2, 3], [4, 5], "stop", seconds=1.25)
    metrics.record_finished([1, 2, 3], [4], "stop", seconds=0.75)
    text = metrics.render().decode()
    assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 2.0' in text
    assert 'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 2.0' in text
    assert (
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="tiny"} 1.0' in text
    )
