"""The shipped examples: every task validates, and the demo script earns the rewards
`examples/README.md` promises."""

from __future__ import annotations

from typing import Any, cast

import pytest

from tests.support.examples import expected_rewards, read_jsonl
from workers.handlers.math import gold_answer
from workers.handlers.registry import get_handler
from workers.handlers.stem import MultipleChoice, read_task

TASK_FILES = ("math_tasks.jsonl", "stem_tasks.jsonl", "demo_tasks.jsonl")
SAMPLES_PER_GROUP = 4


def prompt_text(task: dict[str, Any]) -> str:
    return "\n".join(m["content"] for m in get_handler(task["data_source"]).initial_messages(task))


def script_entry(task: dict[str, Any]) -> dict[str, Any]:
    [entry] = [e for e in read_jsonl("demo_script.jsonl") if e["match"] in prompt_text(task)]
    return entry


def play(task: dict[str, Any], turns: list[str]) -> tuple[list[str], bool]:
    """Feed a scripted sample through `step` until it is done; the texts used and whether done."""
    handler = get_handler(task["data_source"])
    texts: list[str] = []
    for turn, text in enumerate(turns):
        texts.append(text)
        if handler.step(task, text, turn).done:
            return texts, True
    return texts, False


DEMO_TASKS = read_jsonl("demo_tasks.jsonl")
DEMO_CASES = [
    pytest.param(task, sample, id=f"{task['instance_id']}-sample{sample}")
    for task in DEMO_TASKS
    for sample in range(SAMPLES_PER_GROUP)
]
ALL_TASKS = [
    pytest.param(task, id=f"{name}:{task['instance_id']}")
    for name in TASK_FILES
    for task in read_jsonl(name)
]


@pytest.mark.parametrize("task", ALL_TASKS)
def test_every_example_task_validates(task: dict[str, Any]) -> None:
    get_handler(task["data_source"]).validate(task)


@pytest.mark.parametrize("name", TASK_FILES)
def test_every_example_task_has_a_unique_instance_id(name: str) -> None:
    ids = [task.get("instance_id") for task in read_jsonl(name)]
    assert all(ids)
    assert len(set(ids)) == len(ids)


def of_source(source: str) -> list[Any]:
    """The example tasks of one data source, as parameters."""
    return [t for t in ALL_TASKS if cast(dict[str, Any], t.values[0])["data_source"] == source]


@pytest.mark.parametrize("task", of_source("math"))
def test_math_example_gold_answers_grade_as_correct(task: dict[str, Any]) -> None:
    handler = get_handler("math")
    assert handler.grade(task, [f"\\boxed{{{gold_answer(task)}}}"], job_id="job-1").reward == 1.0


@pytest.mark.parametrize("task", of_source("stem"))
def test_stem_example_gold_answers_grade_as_correct(task: dict[str, Any]) -> None:
    parsed = read_task(task)
    answer = parsed.answer if isinstance(parsed, MultipleChoice) else parsed.accepted[0]
    assert get_handler("stem").grade(task, [f"Answer: {answer}"], job_id="job-1").reward == 1.0


def test_demo_has_four_math_and_two_stem_tasks() -> None:
    sources = sorted(task["data_source"] for task in DEMO_TASKS)
    assert sources == ["math"] * 4 + ["stem"] * 2


def test_every_script_entry_matches_exactly_one_demo_task() -> None:
    prompts = [prompt_text(task) for task in DEMO_TASKS]
    for entry in read_jsonl("demo_script.jsonl"):
        assert sum(entry["match"] in prompt for prompt in prompts) == 1, entry["match"]


@pytest.mark.parametrize("task", DEMO_TASKS, ids=[t["instance_id"] for t in DEMO_TASKS])
def test_every_demo_task_has_one_group_of_scripted_samples(task: dict[str, Any]) -> None:
    entry = script_entry(task)
    assert len(entry["samples"]) == SAMPLES_PER_GROUP
    assert entry["delay"] >= 0


def test_readme_table_covers_every_demo_task() -> None:
    table = expected_rewards()
    assert sorted(table) == sorted(task["instance_id"] for task in DEMO_TASKS)
    assert all(len(rewards) == SAMPLES_PER_GROUP for rewards in table.values())


def test_demo_mixes_informative_and_uniform_groups() -> None:
    groups = expected_rewards().values()
    assert any(len(set(rewards)) > 1 for rewards in groups)
    assert any(len(set(rewards)) == 1 for rewards in groups)


@pytest.mark.parametrize(("task", "sample"), DEMO_CASES)
def test_scripted_sample_ends_on_its_last_turn(task: dict[str, Any], sample: int) -> None:
    turns = script_entry(task)["samples"][sample]
    texts, done = play(task, turns)
    assert done
    assert len(texts) == len(turns)


@pytest.mark.parametrize(("task", "sample"), DEMO_CASES)
def test_scripted_sample_earns_the_reward_in_the_readme(task: dict[str, Any], sample: int) -> None:
    texts, _ = play(task, script_entry(task)["samples"][sample])
    grade = get_handler(task["data_source"]).grade(task, texts, job_id="job-1")
    assert grade.reward == expected_rewards()[task["instance_id"]][sample], grade.details


def test_some_demo_samples_answer_only_after_the_reminder() -> None:
    two_turn = [
        sample
        for task in DEMO_TASKS
        for sample in script_entry(task)["samples"]
        if len(play(task, sample)[0]) == 2
    ]
    assert two_turn
