"""The `stem` handler: multiple-choice and short-answer tasks, answer extraction, grading."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers.handlers.base import TaskValidationError
from workers.handlers.stem import StemHandler, normalize_answer

CHOICE = {
    "data_source": "stem",
    "instance_id": "mc-1",
    "question": "Which organelle is the site of photosynthesis?",
    "choices": ["Mitochondrion", "Chloroplast", "Ribosome", "Golgi apparatus"],
    "answer": "B",
}
SHORT = {
    "data_source": "stem",
    "instance_id": "sa-1",
    "question": "What is the chemical symbol for sodium?",
    "answer": ["Na", "sodium"],
}


@pytest.fixture(scope="module")
def stem_handler() -> StemHandler:
    return StemHandler()


def with_fields(task: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**task, **fields}


def validation_field(stem_handler: StemHandler, task: dict[str, Any]) -> str:
    with pytest.raises(TaskValidationError) as error:
        stem_handler.validate(task)
    assert str(error.value) == f"{error.value.field}: {error.value.message}"
    return error.value.field


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "task",
    [
        CHOICE,
        with_fields(CHOICE, choices={"A": "Mitochondrion", "B": "Chloroplast"}),
        with_fields(CHOICE, answer=1),
        with_fields(CHOICE, answer="(b)"),
        SHORT,
        with_fields(SHORT, answer="Na"),
        with_fields(SHORT, answer=46),
    ],
    ids=["letter", "dict", "index", "lowercase-parens", "list", "string", "number"],
)
def test_accepted_task_shapes_validate(stem_handler: StemHandler, task: dict[str, Any]) -> None:
    stem_handler.validate(task)


def test_missing_question_names_the_question_field(stem_handler: StemHandler) -> None:
    task = {"data_source": "stem", "answer": "Na"}
    assert validation_field(stem_handler, task) == "question"


def test_missing_answer_names_the_answer_field(stem_handler: StemHandler) -> None:
    task = {"data_source": "stem", "question": "Why?"}
    assert validation_field(stem_handler, task) == "answer"


def test_letter_outside_the_choices_names_the_answer_field(stem_handler: StemHandler) -> None:
    assert validation_field(stem_handler, with_fields(CHOICE, answer="E")) == "answer"


def test_index_out_of_range_names_the_answer_field(stem_handler: StemHandler) -> None:
    assert validation_field(stem_handler, with_fields(CHOICE, answer=4)) == "answer"


def test_boolean_answer_is_rejected(stem_handler: StemHandler) -> None:
    assert validation_field(stem_handler, with_fields(CHOICE, answer=True)) == "answer"


def test_single_choice_is_rejected(stem_handler: StemHandler) -> None:
    assert (
        validation_field(stem_handler, with_fields(CHOICE, choices=["Only"], answer=0)) == "choices"
    )


def test_choices_of_the_wrong_type_are_rejected(stem_handler: StemHandler) -> None:
    assert validation_field(stem_handler, with_fields(CHOICE, choices="A or B")) == "choices"


def test_blank_choice_is_named_by_its_position(stem_handler: StemHandler) -> None:
    task = with_fields(CHOICE, choices=["Mitochondrion", " ", "Ribosome"], answer="A")
    assert validation_field(stem_handler, task) == "choices.1"


def test_choice_keys_must_be_letters(stem_handler: StemHandler) -> None:
    task = with_fields(CHOICE, choices={"first": "x", "second": "y"}, answer="A")
    assert validation_field(stem_handler, task) == "choices"


def test_empty_list_of_accepted_answers_is_rejected(stem_handler: StemHandler) -> None:
    assert validation_field(stem_handler, with_fields(SHORT, answer=[])) == "answer"


def test_blank_accepted_answer_is_named_by_its_position(stem_handler: StemHandler) -> None:
    assert validation_field(stem_handler, with_fields(SHORT, answer=["Na", ""])) == "answer.1"


def test_choice_text_as_answer_means_its_letter(stem_handler: StemHandler) -> None:
    task = with_fields(CHOICE, answer="Chloroplast")
    assert stem_handler.grade(task, ["Answer: B"], job_id="job-1").reward == 1.0


# ----------------------------------------------------------------------------- messages


def test_multiple_choice_prompt_lists_lettered_choices_and_asks_for_answer_line(
    stem_handler: StemHandler,
) -> None:
    system, user = stem_handler.initial_messages(CHOICE)
    assert system["role"] == "system"
    assert '"Answer: X"' in system["content"]
    assert user["role"] == "user"
    assert user["content"].startswith(CHOICE["question"])
    assert "\nA. Mitochondrion\nB. Chloroplast\nC. Ribosome\nD. Golgi apparatus" in user["content"]


def test_short_answer_prompt_asks_for_answer_line(stem_handler: StemHandler) -> None:
    system, user = stem_handler.initial_messages(SHORT)
    assert '"Answer: <answer>"' in system["content"]
    assert user == {"role": "user", "content": SHORT["question"]}


def test_dict_choices_keep_their_letters(stem_handler: StemHandler) -> None:
    task = with_fields(CHOICE, choices={"a": "Mitochondrion", "b": "Chloroplast"}, answer="b")
    assert "A. Mitochondrion\nB. Chloroplast" in stem_handler.initial_messages(task)[1]["content"]


# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text",
    [
        "Chloroplasts capture light.\n\nAnswer: B",
        "Chloroplasts capture light.\n\n(B)",
        "Chloroplasts capture light, so \\boxed{B}.",
        "Chloroplasts capture light, so the answer is B.",
        "Chloroplasts capture light.\n\n**Answer:** B",
        "The correct answer is (B) Chloroplast.",
        "Chloroplasts capture light.\nAnswer: Chloroplast",
        "answer: b",
    ],
    ids=["answer-line", "parens", "boxed", "answer-is", "bold", "correct-answer", "text", "lower"],
)
def test_choice_is_read_from_typical_forms(stem_handler: StemHandler, text: str) -> None:
    grade = stem_handler.grade(CHOICE, [text], job_id="job-1")
    assert grade.details["extracted"] == "B"
    assert grade.reward == 1.0


def test_last_stated_choice_wins(stem_handler: StemHandler) -> None:
    grade = stem_handler.grade(
        CHOICE, ["Answer: B\n\nOn reflection, the answer is C."], job_id="job-1"
    )
    assert grade.details["extracted"] == "C"
    assert grade.reward == 0.0


def test_letters_mentioned_while_reasoning_are_not_an_answer(stem_handler: StemHandler) -> None:
    result = stem_handler.step(CHOICE, "Option A makes energy, and (C) makes proteins.", 0)
    assert not result.done


def test_step_ends_the_episode_on_an_answer(stem_handler: StemHandler) -> None:
    result = stem_handler.step(CHOICE, "Answer: B", 0)
    assert result.done
    assert result.stop_reason == "answer"
    assert result.messages == []


def test_step_reminds_of_the_answer_line_and_the_letters(stem_handler: StemHandler) -> None:
    result = stem_handler.step(CHOICE, "Plants photosynthesise in a green organelle.", 0)
    assert not result.done
    [message] = result.messages
    assert message["role"] == "user"
    assert '"Answer: X"' in message["content"]
    assert "A, B, C, D" in message["content"]


def test_short_answer_step_reminds_of_the_answer_line(stem_handler: StemHandler) -> None:
    result = stem_handler.step(SHORT, "Its Latin name is natrium.", 0)
    assert not result.done
    assert '"Answer: <answer>"' in result.messages[0]["content"]


def test_answer_colon_inside_a_sentence_is_not_an_answer(stem_handler: StemHandler) -> None:
    assert not stem_handler.step(SHORT, "To find the answer: recall the Latin names.", 0).done


def test_answer_inside_an_unfinished_think_block_is_not_an_answer(
    stem_handler: StemHandler,
) -> None:
    assert not stem_handler.step(CHOICE, "<think>Answer: B? Let me check", 0).done


# ----------------------------------------------------------------------------- short answers


@pytest.mark.parametrize(
    ("given", "normalized"),
    [
        ("3.0", "3"),
        ("0.50", "0.5"),
        ("1,000", "1000"),
        ("The Mitochondria.", "mitochondria"),
        ("  New   York ", "new york"),
        ("an ion!", "ion"),
        ("\\text{Na}", "na"),
        ("-0.0", "0"),
    ],
)
def test_short_answers_are_normalised(given: str, normalized: str) -> None:
    assert normalize_answer(given) == normalized


def test_any_accepted_short_answer_is_correct(stem_handler: StemHandler) -> None:
    assert stem_handler.grade(SHORT, ["Answer: Sodium"], job_id="job-1").reward == 1.0
    assert stem_handler.grade(SHORT, ["Answer: Na"], job_id="job-1").reward == 1.0


def test_numbers_match_whatever_their_formatting(stem_handler: StemHandler) -> None:
    task = with_fields(SHORT, answer="46")
    assert (
        stem_handler.grade(task, ["There are 23 pairs. The answer is 46.0."], job_id="job-1").reward
        == 1.0
    )


def test_answer_sentence_ends_the_short_answer(stem_handler: StemHandler) -> None:
    grade = stem_handler.grade(
        SHORT, ["The answer is Na. It comes from the Latin natrium."], job_id="job-1"
    )
    assert grade.details["extracted"] == "Na"
    assert grade.reward == 1.0


def test_wrong_short_answer_gets_reward_zero(stem_handler: StemHandler) -> None:
    grade = stem_handler.grade(SHORT, ["Answer: So"], job_id="job-1")
    assert grade.reward == 0.0
    assert grade.details["reason"] == "incorrect"


def test_episode_without_an_answer_gets_reward_zero_and_says_so(stem_handler: StemHandler) -> None:
    grade = stem_handler.grade(CHOICE, ["Plants are green.", "Still thinking."], job_id="job-1")
    assert grade.reward == 0.0
    assert grade.details["reason"] == "no_answer"


def test_episode_without_assistant_turns_gets_reward_zero(stem_handler: StemHandler) -> None:
    assert stem_handler.grade(SHORT, [], job_id="job-1").reward == 0.0


def test_last_turn_with_an_answer_is_graded(stem_handler: StemHandler) -> None:
    grade = stem_handler.grade(CHOICE, ["Answer: A", "Answer: B", "Anything else?"], job_id="job-1")
    assert grade.reward == 1.0
    assert grade.details["answer_turn"] == 1


def test_grade_details_are_json_serialisable(stem_handler: StemHandler) -> None:
    for task, text in ((CHOICE, "Answer: B"), (SHORT, "Answer: Na")):
        details = stem_handler.grade(task, [text], job_id="job-1").details
        assert json.loads(json.dumps(details)) == details


def test_end_of_turn_token_in_the_text_is_not_part_of_the_answer(stem_handler: StemHandler) -> None:
    # Backends asked to keep special tokens end the text with the chat template's <|im_end|>.
    grade = stem_handler.grade(
        SHORT, ["Sodium comes from natrium.\n\nAnswer: Na<|im_end|>"], job_id="job-1"
    )
    assert grade.reward == 1.0
