"""bench/tokens.py measures what it claims: rollserve's record is checked against the ids the
server really sent back, and the re-tokenizing baseline finds drift where there is some and
none where there is none."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from bench import tokens as bt
from core.schemas import EnvTurn, ModelTurn, Segment

if TYPE_CHECKING:
    from tests.support.devserver import DevBackend


CORPUS = bt.Corpus(
    code=["def add(a, b):\n    return a + b"],
    prose=["Return the sum of two numbers, as the tests expect."],
    files=["adder.py"],
    chars=0,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny model's tokenizer: the one `build_qwen_tokenizer` made and saved."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def one_turn(tokenizer: Any, output_ids: list[int]) -> bt.Recorded:
    """A trajectory of one assistant turn answering "Say hello", ended by EOS."""
    messages = [{"role": "user", "content": "Say hello"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    output = [*output_ids, tokenizer.eos_token_id]
    turn = ModelTurn(
        prompt_ids=list(prompt), output_ids=output, logprobs=[0.0] * len(output),
        finish_reason="stop", text="",
    )  # fmt: skip
    return bt.Recorded(
        messages=messages,
        tools=None,
        prompt_ids=list(prompt),
        turns=[turn],
        response_ids=list(output),
        loss_mask=[1] * len(output),
        replies=[],
        closing=tokenizer.encode("<|im_end|>\n", add_special_tokens=False),
        calls=[bt.Call(list(prompt), list(output), [0.0] * len(output))],
        stop_reason="answer",
    )


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


async def test_record_holds_exactly_the_ids_the_server_sent(devserver_model: DevBackend) -> None:
    jobs = bt.make_jobs("model", 2, CORPUS, turns=2, max_tokens=6, seed=3)
    recs = await bt.run_server_jobs(
        devserver_model.url, devserver_model.model, jobs, bt.CorpusRunner(CORPUS.code, 0)
    )
    for rec in recs:
        outputs = [t.output_ids for t in rec.turns if isinstance(t, ModelTurn)]
        assert len(outputs) == 2
        assert outputs == [call.output_ids for call in rec.calls]  # as captured on the wire
        last = rec.calls[-1]
        assert rec.prompt_ids + rec.response_ids == last.prompt_ids + last.output_ids
        assert bt.check_record(rec) == bt.RecordCheck(differs=False, mismatched_tokens=0)

    # The check is not vacuous: a record that lost or changed an id is caught.
    rec = recs[0]
    rec.calls[1].output_ids[0] += 1
    assert bt.check_record(rec) == bt.RecordCheck(differs=True, mismatched_tokens=1)


def test_known_drift_is_found_and_a_canonical_turn_is_not(tokenizer: Any) -> None:
    hel, lo, hello = ids(tokenizer, "Hel"), ids(tokenizer, "lo"), ids(tokenizer, "Hello")
    assert len(hel) == len(lo) == len(hello) == 1
    assert tokenizer.decode(hel + lo) == "Hello"  # "Hel" + "lo" comes back as "Hello"

    drift = bt.retokenize_drift(tokenizer, one_turn(tokenizer, hel + lo))
    assert drift.differs
    assert (drift.generated_tokens, drift.drifted_tokens, drift.other_drifted_tokens) == (3, 2, 0)
    assert (drift.model_turns, drift.drifted_turns, drift.length_delta) == (1, 1, -1)

    canonical = bt.retokenize_drift(tokenizer, one_turn(tokenizer, hello))
    assert not canonical.differs
    assert (canonical.drifted_tokens, canonical.drifted_turns) == (0, 0)


async def test_multi_turn_episodes_through_the_agent_loop(tokenizer: Any) -> None:
    """The in-process path (real ChatTemplater, observations appended as ids): canonical
    text never drifts; a generator that emits "Hel" + "lo" drifts in every turn."""
    eos = int(tokenizer.eos_token_id)
    runner = bt.CorpusRunner(CORPUS.code, 0)
    canonical = bt.NgramModel(2, [ids(tokenizer, "Hello world, this is fine.")], eos)
    jobs = bt.make_jobs("bigram", 2, CORPUS, turns=3, max_tokens=64, seed=0)
    recs = await bt.run_ngram_jobs(jobs, canonical, tokenizer, runner)
    for rec in recs:
        assert [type(t).__name__ for t in rec.turns] == ["ModelTurn", "EnvTurn"] * 2 + ["ModelTurn"]
        assert not bt.check_record(rec).differs
        assert not bt.retokenize_drift(tokenizer, rec).differs

    split = ids(tokenizer, "Hel") + ids(tokenizer, "lo") + ids(tokenizer, " world.")
    drifting = bt.NgramModel(2, [split], eos)
    recs = await bt.run_ngram_jobs(jobs, drifting, tokenizer, runner)
    for rec in recs:
        assert not bt.check_record(rec).differs
        drift = bt.retokenize_drift(tokenizer, rec)
        assert drift.differs
        assert (drift.model_turns, drift.drifted_turns) == (3, 3)
        assert (drift.drifted_tokens, drift.other_drifted_tokens) == (6, 0)


def test_alignment_counts_only_what_has_no_counterpart() -> None:
    assert bt.align([1, 2, 3], [1, 2, 3]) == ([True, True, True], [])
    matched, inserted = bt.align([1, 2, 3], [1, 4, 3])
    assert (matched, len(inserted)) == ([True, False, True], 1)
    matched, inserted = bt.align([1, 2, 3, 4], [1, 5, 4])
    assert (matched, len(inserted)) == ([True, False, False, True], 1)
    assert bt.align([1, 3], [1, 2, 3]) == ([True, True], [1])
    assert bt.align([1, 2, 3], [1, 3]) == ([True, False, True], [])


def two_segment_record() -> bt.Recorded:
    """Two calls in one sequence, then a call whose prompt [1, 2, 3, 6] does not extend it
    (segment 2); the record exactly what was generated."""
    turns: list[ModelTurn | EnvTurn] = [
        ModelTurn(prompt_ids=[1, 2, 3], output_ids=[7, 8], logprobs=[-0.5, -0.25],
                  finish_reason="stop", text=""),
        EnvTurn(observation_ids=[5], text=""),
        ModelTurn(prompt_ids=[5], output_ids=[9], logprobs=[-1.0], finish_reason="stop", text=""),
        ModelTurn(prompt_ids=[1, 2, 3, 6], output_ids=[10], logprobs=[-2.0],
                  finish_reason="stop", text="", segment_start="history_changed"),
    ]  # fmt: skip
    later = Segment(
        reason="history_changed", first_turn=3, prompt_ids=[1, 2, 3, 6], response_ids=[10],
        loss_mask=[1], logprobs=[-2.0],
    )  # fmt: skip
    return bt.Recorded(
        messages=[{"role": "user", "content": "hi"}],
        tools=None,
        prompt_ids=[1, 2, 3],
        turns=turns,
        response_ids=[7, 8, 5, 9],
        loss_mask=[1, 1, 0, 1],
        replies=[[{"role": "user", "content": "more"}]],
        closing=[4],
        calls=[
            bt.Call([1, 2, 3], [7, 8], [-0.5, -0.25]),
            bt.Call([1, 2, 3, 7, 8, 5], [9], [-1.0]),
            bt.Call([1, 2, 3, 6], [10], [-2.0]),
        ],
        stop_reason="answer",
        segments=[later],
    )


def test_a_record_of_two_segments_is_checked_segment_by_segment() -> None:
    assert bt.check_record(two_segment_record()) == bt.RecordCheck(False, 0)
    # The call that began segment 2 was sent its own prompt, not the sequence before it.
    continued = two_segment_record()
    continued.calls[2].prompt_ids = [1, 2, 3, 7, 8, 5, 9, 6]
    assert bt.check_record(continued).differs
    flattened = two_segment_record()
    flattened.segments[0].response_ids = [11]  # segment 2's arrays lost the id generated
    assert bt.check_record(flattened).differs
    returned = two_segment_record()
    returned.calls[2].output_ids = [11]  # the engine returned 11; segment 2's turn holds 10
    assert bt.check_record(returned) == bt.RecordCheck(True, 1)


def test_the_retokenizing_baseline_refuses_a_record_of_two_segments(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="2 segments"):
        bt.retokenize_drift(tokenizer, two_segment_record())
