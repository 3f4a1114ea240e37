"""The `math` handler: task shapes, answer detection, and grading on and off the main thread."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from workers.handlers.base import Grade, TaskValidationError
from workers.handlers.math import (
    CheckLimits,
    IsolatedChecker,
    MathHandler,
    check_answer,
    find_final_answer,
    gold_answer,
)

GSM8K = {
    "data_source": "math",
    "instance_id": "gsm8k-1",
    "question": "Tom has 3 boxes of 4 pencils. How many pencils does he have?",
    "answer": "He has 3 * 4 = <<3*4=12>>12 pencils.\n#### 12",
}
MATH = {
    "data_source": "math",
    "problem": "Compute $\\frac{1}{2} + \\frac{1}{4}$.",
    "solution": "We get $\\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
}
# A power tower math-verify cannot compare with a number in reasonable time.
TOWER = "\\boxed{9^{9^{9^{9}}}}"


@pytest.fixture(scope="module")
def math_handler() -> MathHandler:
    return MathHandler()


def grade_off_main_thread(
    math_handler: MathHandler, task: dict[str, Any], texts: list[str]
) -> Grade:
    result: list[Grade] = []
    worker = threading.Thread(
        target=lambda: result.append(math_handler.grade(task, texts, job_id="job-1"))
    )
    worker.start()
    worker.join(timeout=120)
    assert result, "grading thread did not finish"
    return result[0]


# ----------------------------------------------------------------------------- task shapes


def test_gsm8k_gold_is_the_number_after_the_hashes() -> None:
    assert gold_answer(GSM8K) == "12"


def test_math_gold_is_the_last_boxed_answer_of_the_solution() -> None:
    assert gold_answer(MATH) == "\\frac{3}{4}"


def test_answer_field_is_preferred_over_the_solution() -> None:
    task = {"problem": "p", "answer": "\\frac{1}{6}", "solution": "so \\boxed{\\frac{6}{36}}"}
    assert gold_answer(task) == "\\frac{1}{6}"


def test_numeric_answer_field_is_accepted() -> None:
    assert gold_answer({"problem": "p", "answer": 42}) == "42"


def test_answer_field_in_dollars_is_unwrapped() -> None:
    assert gold_answer({"problem": "p", "answer": "$\\sqrt{2}$"}) == "\\sqrt{2}"


@pytest.mark.parametrize(
    "task",
    [
        GSM8K,
        MATH,
        {"data_source": "math", "problem": "How many?", "answer": "30"},
        {"data_source": "math", "prompt": "What is 2 + 2?", "answer": "4"},
    ],
    ids=["gsm8k", "math", "deepscaler", "prompt"],
)
def test_each_record_shape_validates(math_handler: MathHandler, task: dict[str, Any]) -> None:
    math_handler.validate(task)


def test_missing_problem_names_the_problem_field(math_handler: MathHandler) -> None:
    with pytest.raises(TaskValidationError) as error:
        math_handler.validate({"data_source": "math", "answer": "4"})
    assert error.value.field == "problem"
    assert str(error.value).startswith("problem: ")


def test_missing_gold_names_the_answer_field(math_handler: MathHandler) -> None:
    with pytest.raises(TaskValidationError) as error:
        math_handler.validate({"data_source": "math", "problem": "What is 2 + 2?"})
    assert error.value.field == "answer"


def test_solution_without_boxed_answer_names_the_solution_field(math_handler: MathHandler) -> None:
    with pytest.raises(TaskValidationError) as error:
        math_handler.validate({"data_source": "math", "problem": "p", "solution": "It is four."})
    assert error.value.field == "solution"


def test_non_string_problem_names_its_field(math_handler: MathHandler) -> None:
    with pytest.raises(TaskValidationError) as error:
        math_handler.validate({"data_source": "math", "question": ["x"], "answer": "4"})
    assert error.value.field == "question"


def test_blank_answer_is_rejected(math_handler: MathHandler) -> None:
    with pytest.raises(TaskValidationError) as error:
        math_handler.validate({"data_source": "math", "problem": "p", "answer": "  "})
    assert error.value.field == "answer"


def test_boolean_answer_is_rejected(math_handler: MathHandler) -> None:
    with pytest.raises(TaskValidationError) as error:
        math_handler.validate({"data_source": "math", "problem": "p", "answer": True})
    assert error.value.field == "answer"


# ----------------------------------------------------------------------------- messages


def test_initial_messages_ask_for_a_boxed_answer_then_give_the_problem(
    math_handler: MathHandler,
) -> None:
    messages = math_handler.initial_messages(GSM8K)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "\\boxed{}" in messages[0]["content"]
    assert "step by step" in messages[0]["content"]
    assert messages[1]["content"] == GSM8K["question"]


def test_math_offers_no_tools(math_handler: MathHandler) -> None:
    assert math_handler.tools(GSM8K) is None


def test_math_needs_no_sandbox() -> None:
    assert MathHandler.needs_sandbox is False


# ----------------------------------------------------------------------------- step


@pytest.mark.parametrize(
    "text",
    [
        "3 * 4 = 12, so he has \\boxed{12} pencils.",
        "3 * 4 = 12\n#### 12",
        "Three boxes of four make twelve. The answer is 12.",
        "Final answer: $12$",
    ],
    ids=["boxed", "hashes", "answer-is", "final-answer"],
)
def test_step_ends_the_episode_on_a_final_answer(math_handler: MathHandler, text: str) -> None:
    result = math_handler.step(GSM8K, text, 0)
    assert result.done
    assert result.stop_reason == "answer"
    assert result.messages == []


def test_step_asks_for_a_boxed_answer_when_none_was_given(math_handler: MathHandler) -> None:
    result = math_handler.step(GSM8K, "Each box has 4 pencils and there are 3 boxes.", 0)
    assert not result.done
    assert len(result.messages) == 1
    assert result.messages[0]["role"] == "user"
    assert "\\boxed{}" in result.messages[0]["content"]


def test_answer_phrase_without_mathematics_is_not_an_answer() -> None:
    assert find_final_answer("The answer is not obvious yet, let me think.") is None


def test_answer_colon_inside_a_sentence_is_not_an_answer() -> None:
    assert find_final_answer("To find the answer: first compute 3 * 4 = 12.") is None


def test_answer_phrase_ends_at_the_explanation() -> None:
    found = find_final_answer("The answer is 12 because 3 * 4 = 12")
    assert found is not None
    assert found.text == "12"


def test_answer_inside_an_unfinished_think_block_is_not_an_answer() -> None:
    assert find_final_answer("<think>Maybe \\boxed{11}? Let me check") is None


def test_answer_after_the_think_block_wins_over_drafts_inside_it() -> None:
    found = find_final_answer("<think>Maybe \\boxed{11}.</think>It is \\boxed{12}.")
    assert found is not None
    assert found.text == "12"


def test_last_answer_in_a_turn_wins() -> None:
    found = find_final_answer("First \\boxed{11}. Wait, recount: the answer is 12.")
    assert found is not None
    assert (found.text, found.form) == ("12", "phrase")


def test_nested_braces_in_a_boxed_answer_are_kept() -> None:
    found = find_final_answer("So \\boxed{\\frac{\\sqrt{3}}{2}}.")
    assert found is not None
    assert found.text == "\\frac{\\sqrt{3}}{2}"


# ----------------------------------------------------------------------------- grade


def test_correct_answer_gets_reward_one(math_handler: MathHandler) -> None:
    grade = math_handler.grade(GSM8K, ["3 * 4 = 12, so \\boxed{12}."], job_id="job-1")
    assert grade.reward == 1.0
    assert grade.details["reason"] == "correct"
    assert grade.details["extracted"] == "12"
    assert grade.details["gold"] == "12"


def test_wrong_answer_gets_reward_zero(math_handler: MathHandler) -> None:
    grade = math_handler.grade(GSM8K, ["3 + 4 = 7, so \\boxed{7}."], job_id="job-1")
    assert grade.reward == 0.0
    assert grade.details["reason"] == "incorrect"
    assert grade.details["extracted"] == "7"


@pytest.mark.parametrize(
    ("gold", "answer"),
    [
        ("\\frac{3}{4}", "\\boxed{0.75}"),
        ("1200", "#### 1,200"),
        ("18", "The answer is 18 dollars."),
        ("6", "\\boxed{x = 6}"),
        ("3\\sqrt{2}", "\\boxed{\\sqrt{18}}"),
        ("(x+1)^2", "\\boxed{x^2 + 2x + 1}"),
        (
            "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
            "\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}",
        ),
    ],
    ids=["fraction-decimal", "thousands", "units", "assignment", "surd", "polynomial", "matrix"],
)
def test_equivalent_forms_of_the_gold_are_correct(
    math_handler: MathHandler, gold: str, answer: str
) -> None:
    task = {"data_source": "math", "problem": "p", "answer": gold}
    assert math_handler.grade(task, [answer], job_id="job-1").reward == 1.0


def test_units_do_not_make_a_wrong_number_right(math_handler: MathHandler) -> None:
    task = {"data_source": "math", "problem": "p", "answer": "18"}
    assert math_handler.grade(task, ["\\boxed{17 \\text{ dollars}}"], job_id="job-1").reward == 0.0
    assert math_handler.grade(task, ["The answer is 17 dollars."], job_id="job-1").reward == 0.0


def test_last_turn_with_an_answer_is_graded(math_handler: MathHandler) -> None:
    texts = ["I think \\boxed{7}.", "Recounting: \\boxed{12}.", "Is there anything else?"]
    grade = math_handler.grade(GSM8K, texts, job_id="job-1")
    assert grade.reward == 1.0
    assert grade.details["answer_turn"] == 1


def test_episode_without_an_answer_gets_reward_zero_and_says_so(math_handler: MathHandler) -> None:
    grade = math_handler.grade(
        GSM8K, ["Let me count the pencils.", "Still counting."], job_id="job-1"
    )
    assert grade.reward == 0.0
    assert grade.details["reason"] == "no_answer"
    assert grade.details["extracted"] is None


def test_episode_without_assistant_turns_gets_reward_zero(math_handler: MathHandler) -> None:
    grade = math_handler.grade(GSM8K, [], job_id="job-1")
    assert grade.reward == 0.0
    assert grade.details["reason"] == "no_answer"


def test_grade_details_are_json_serialisable(math_handler: MathHandler) -> None:
    details = math_handler.grade(MATH, ["\\boxed{\\frac{3}{4}}"], job_id="job-1").details
    assert json.loads(json.dumps(details)) == details


def test_grading_off_the_main_thread_matches_grading_on_it(math_handler: MathHandler) -> None:
    texts = [["\\boxed{0.75}"], ["\\boxed{\\frac{2}{3}}"], ["no answer"]]
    on_main = [math_handler.grade(MATH, t, job_id="job-1") for t in texts]
    off_main = [grade_off_main_thread(math_handler, MATH, t) for t in texts]
    assert [g.reward for g in off_main] == [1.0, 0.0, 0.0]
    assert [g.details for g in off_main] == [g.details for g in on_main]


def test_runaway_comparison_times_out_on_the_main_thread() -> None:
    math_handler = MathHandler(CheckLimits(parse_s=1, verify_s=1))
    started = time.monotonic()
    grade = math_handler.grade(GSM8K, [TOWER], job_id="job-1")
    assert grade.reward == 0.0
    assert grade.details["reason"] == "timeout"
    assert time.monotonic() - started < 5


def test_runaway_comparison_times_out_off_the_main_thread() -> None:
    math_handler = MathHandler(CheckLimits(parse_s=1, verify_s=1))
    grade_off_main_thread(math_handler, GSM8K, ["\\boxed{12}"])  # start the checker child
    started = time.monotonic()
    grade = grade_off_main_thread(math_handler, GSM8K, [TOWER])
    assert grade.reward == 0.0
    assert grade.details["reason"] == "timeout"
    assert time.monotonic() - started < 6


def test_isolated_checker_replaces_a_child_that_overruns_its_deadline() -> None:
    checker = IsolatedChecker(CheckLimits(parse_s=30, verify_s=30), deadline_s=0.5)
    try:
        started = time.monotonic()
        assert checker.check("12", "9^{9^{9^{9}}}") == {"correct": False, "reason": "timeout"}
        assert time.monotonic() - started < 5
        assert checker.check("12", "12")["correct"] is True
    finally:
        checker.close()


def test_time_limits_are_refused_off_the_main_thread() -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            check_answer("1", "1", CheckLimits())
        except RuntimeError as error:
            errors.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert len(errors) == 1


def test_end_of_turn_token_in_the_text_is_not_part_of_the_answer(math_handler: MathHandler) -> None:
    # Backends asked to keep special tokens end the text with the chat template's <|im_end|>.
    assert (
        math_handler.grade(GSM8K, ["3 * 4 = 12\n#### 12<|im_end|>"], job_id="job-1").reward == 1.0
    )
    assert math_handler.step(GSM8K, "#### 12<|im_end|>", 0).done


def test_warm_up_loads_the_checker_ahead_of_the_first_grade() -> None:
    import subprocess
    import sys

    # A fresh interpreter: importing the handler is cheap, warming it loads math-verify.
    probe = (
        "import sys, workers.handlers.math as m\n"
        "assert 'math_verify' not in sys.modules\n"
        "m.MathHandler().warm_up()\n"
        "assert 'math_verify' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
