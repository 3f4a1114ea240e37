"""The `code` handler: the record shapes it accepts, finding the program in a reply, comparing
outputs, and grading programs in bubblewrap boxes with time and memory limits."""

from __future__ import annotations

import base64
import json
import pickle
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from sandbox.bwrap import BubblewrapBackend
from sandbox.reaper import GRADING_DIR, reap
from tests.support.procs import processes_mentioning
from workers.handlers.base import TaskValidationError
from workers.handlers.code import records as code
from workers.handlers.code.handler import CodeHandler
from workers.handlers.code.matching import extract_code, last_program, outputs_match, values_match
from workers.handlers.code.records import CallTest, StdioTest, read_task

if TYPE_CHECKING:
    from tests.support.sandbox import Listener


JOB = f"code-grade-test-{uuid.uuid4().hex[:12]}"
"""The id of the job graded here: this module's own, so that its leftover check sees only
its own processes (other modules grade beside it)."""
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def pack_lcb(cases: list[dict[str, Any]]) -> str:
    """Test cases packed the way LiveCodeBench ships its private ones."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


NATIVE = {
    "data_source": "code",
    "instance_id": "add-1",
    "problem": "Read two integers and print their sum.",
    "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "-4 4\n", "output": "0"}],
}
NATIVE_CALL = {
    "data_source": "code",
    "instance_id": "square-1",
    "problem": "Write square(x).",
    "tests": [
        {"fn_name": "square", "args": [3], "expected": 9},
        {"fn_name": "square", "args": [-2], "expected": 4},
    ],
}
APPS_STDIN = {
    "data_source": "code",
    "problem_id": 4001,
    "question": "Print the number of words in the line.",
    "input_output": json.dumps({"inputs": ["a b c\n", ["x", "y z"]], "outputs": ["3\n", ["3"]]}),
    "starter_code": "",
    "difficulty": "introductory",
}
APPS_CALL = {
    "data_source": "code",
    "question": "Return the list doubled.",
    "input_output": json.dumps(
        {"fn_name": "double", "inputs": [[[1, 2]], [[]]], "outputs": [[[2, 4]], [[]]]}
    ),
    "starter_code": "def double(xs):\n\t",
}
CODE_CONTESTS = {
    "data_source": "code",
    "name": "1_A. Halve",
    "description": "Print n / 2.",
    "public_tests": {"input": ["3\n"], "output": ["1.5\n"]},
    "private_tests": {"input": ["8\n"], "output": ["4\n"]},
    "generated_tests": {"input": ["1\n", "5\n"], "output": ["0.5\n", "2.5\n"]},
    "time_limit": {"seconds": 2, "nanos": 500000000},
    "memory_limit_bytes": 256 * 2**20,
    "source": 2,
    "difficulty": 7,
}
LCB = {
    "data_source": "code",
    "question_title": "Two Sum",
    "question_content": "Return the indices of the two numbers that add up to target.",
    "platform": "leetcode",
    "question_id": "1",
    "contest_id": "weekly-contest-1",
    "contest_date": "2023-08-21T00:00:00",
    "starter_code": (
        "class Solution:\n"
        "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        "
    ),
    "difficulty": "easy",
    "public_test_cases": json.dumps(
        [{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"}]
    ),
    "private_test_cases": pack_lcb(
        [{"input": "[3,2,4]\n6", "output": "[1, 2]", "testtype": "functional"}]
    ),
    "metadata": json.dumps({"func_name": "twoSum"}),
}
LCB_STDIN = {
    "data_source": "code",
    "question_content": "Print A + B.",
    "platform": "atcoder",
    "starter_code": "",
    "public_test_cases": [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}],
    "private_test_cases": json.dumps([{"input": "5 5\n", "output": "10\n", "testtype": "stdin"}]),
    "metadata": "{}",
}
DEEPCODER = {
    "data_source": "code",
    "problem": "Print the sum.",
    "tests": json.dumps(
        [
            {"input": "1 2\n", "output": "3\n", "testtype": "stdin_stdout"},
            {"input": "1\n2", "output": "3", "testtype": "functional"},
        ]
    ),
    "metadata": {"func_name": "add"},
}
TACO_TESTS = {
    "data_source": "code",
    "problem": "Return n + 1.",
    "tests": {"fn_name": "inc", "inputs": [[1], [5]], "outputs": [2, [6]]},
}
PRIME_INTELLECT = {
    "data_source": "code",
    "problem": "Return the larger number.",
    "tests": [{"type": "function_call", "fn_name": "larger", "input": [3, 9], "output": [9]}],
}


def with_fields(task: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**task, **fields}


def without(task: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in task.items() if k not in keys}


def program(source: str, tag: str = "python") -> str:
    return f"Here is my solution.\n\n```{tag}\n{source.strip()}\n```\n"


# ----------------------------------------------------------------------------- record shapes


def test_native_stdin_record_reads_its_tests_and_defaults() -> None:
    spec = read_task(NATIVE)
    assert spec.tests == [StdioTest("1 2\n", "3\n"), StdioTest("-4 4\n", "0")]
    assert (spec.time_limit, spec.memory_mb, spec.reward) == (5.0, 512, "all")


def test_native_function_call_record_reads_args_and_expected() -> None:
    spec = read_task(with_fields(NATIVE_CALL, time_limit=2, memory_limit_mb=128, reward="fraction"))
    assert spec.tests[0] == CallTest("square", [3], [9])
    assert (spec.time_limit, spec.memory_mb, spec.reward) == (2.0, 128, "fraction")


def test_apps_stdin_record_joins_lists_of_lines() -> None:
    assert read_task(APPS_STDIN).tests == [StdioTest("a b c\n", "3\n"), StdioTest("x\ny z", "3")]


def test_apps_call_record_accepts_the_value_or_the_list_holding_it() -> None:
    first = read_task(APPS_CALL).tests[0]
    assert first == CallTest("double", [[1, 2]], [[[2, 4]], [2, 4]])


def test_code_contests_record_takes_every_test_group_and_its_limits() -> None:
    spec = read_task(CODE_CONTESTS)
    assert [t.input for t in spec.tests if isinstance(t, StdioTest)] == ["3\n", "8\n", "1\n", "5\n"]
    assert (spec.time_limit, spec.memory_mb) == (2.5, 256)


def test_livecodebench_record_unpacks_private_cases_and_reads_func_name() -> None:
    spec = read_task(LCB)
    assert spec.tests == [
        CallTest("twoSum", [[2, 7, 11, 15], 9], [[0, 1]]),
        CallTest("twoSum", [[3, 2, 4], 6], [[1, 2]]),
    ]


def test_livecodebench_stdin_record_accepts_json_text_or_lists() -> None:
    assert read_task(LCB_STDIN).tests == [StdioTest("1 2\n", "3\n"), StdioTest("5 5\n", "10\n")]


def test_deepcoder_tests_as_json_text_mix_stdin_and_functional() -> None:
    assert read_task(DEEPCODER).tests == [StdioTest("1 2\n", "3\n"), CallTest("add", [1, 2], [3])]


def test_deepcoder_taco_and_primeintellect_function_calls() -> None:
    assert read_task(TACO_TESTS).tests == [
        CallTest("inc", [1], [2]),
        CallTest("inc", [5], [[6], 6]),
    ]
    assert read_task(PRIME_INTELLECT).tests == [CallTest("larger", [3, 9], [[9], 9])]


class Exploit:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (print, ("unpickled",))


def test_packed_cases_naming_code_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    evil = base64.b64encode(zlib.compress(pickle.dumps(Exploit()))).decode()
    assert validation_field(with_fields(LCB, private_test_cases=evil)) == "private_test_cases"
    assert "unpickled" not in capsys.readouterr().out


def test_packed_cases_that_inflate_too_far_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(code, "MAX_UNPACKED", 1000)
    big = pack_lcb([{"input": "x" * 5000, "output": "", "testtype": "stdin"}])
    assert validation_field(with_fields(LCB, private_test_cases=big)) == "private_test_cases"


def validation_field(task: dict[str, Any]) -> str:
    with pytest.raises(TaskValidationError) as error:
        CodeHandler().validate(task)
    return error.value.field


@pytest.mark.parametrize(
    ("task", "field"),
    [
        (without(NATIVE, "problem"), "problem"),
        (with_fields(NATIVE, problem="  "), "problem"),
        (without(NATIVE, "tests"), "tests"),
        (with_fields(NATIVE, tests=[]), "tests"),
        (with_fields(NATIVE, tests="{not json"), "tests"),
        (with_fields(NATIVE, tests=[{"input": "1"}, {"output": "2"}]), "tests.0.output"),
        (with_fields(NATIVE, tests=[{"input": "1", "output": 3}]), "tests.0.output"),
        (with_fields(NATIVE, tests=[{"fn_name": "f", "args": 1, "expected": 2}]), "tests.0.args"),
        (with_fields(NATIVE, tests=[{"fn_name": "f", "args": [1]}]), "tests.0.expected"),
        (with_fields(NATIVE, tests=[{"fn_name": "no good", "args": [], "expected": 0}]),
         "tests.0.fn_name"),
        (with_fields(NATIVE, time_limit=0), "time_limit"),
        (with_fields(NATIVE, time_limit="5s"), "time_limit"),
        (with_fields(NATIVE, memory_limit_mb=16), "memory_limit_mb"),
        (with_fields(NATIVE, reward="most"), "reward"),
        (with_fields(NATIVE, starter_code=5), "starter_code"),
        (with_fields(APPS_STDIN, input_output="{oops"), "input_output"),
        (with_fields(APPS_STDIN, input_output={"inputs": ["1"], "outputs": []}),
         "input_output.outputs"),
        (with_fields(APPS_CALL, input_output={"fn_name": "f", "inputs": [1], "outputs": [1]}),
         "input_output.inputs.0"),
        (with_fields(LCB, metadata="{}"), "metadata.func_name"),
        (with_fields(LCB, private_test_cases="bm90IHRlc3RzIQ=="), "private_test_cases"),
        (with_fields(CODE_CONTESTS, private_tests={"input": ["1"], "output": []}),
         "private_tests.output"),
        (with_fields(CODE_CONTESTS, time_limit={"seconds": "two"}), "time_limit.seconds"),
    ],
)  # fmt: skip
def test_a_bad_task_names_the_field(task: dict[str, Any], field: str) -> None:
    assert validation_field(task) == field


# ----------------------------------------------------------------------------- the program


def test_the_last_python_block_wins() -> None:
    text = program("print(1)") + "Actually, better:\n" + program("print(2)")
    assert extract_code(text) == "print(2)\n"


def test_an_untagged_block_counts_only_without_a_python_block() -> None:
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    tagged_then_output = program("print(4)") + "It prints:\n```\n4\n```"
    assert extract_code(tagged_then_output) == "print(4)\n"


def test_other_languages_reasoning_and_open_fences_are_not_programs() -> None:
    assert extract_code("```cpp\nint main() {}\n```") is None
    assert extract_code("<think>" + program("print(5)") + "</think>No code here.") is None
    assert extract_code("```python\nprint(6)\n") is None
    assert extract_code(program("   ")) is None


def test_the_last_turn_holding_a_program_is_graded() -> None:
    turns = [program("print('first')"), "I am confident.<|im_end|>"]
    assert last_program(turns) == ("print('first')\n", 0)
    assert last_program(["no code", "none either"]) is None


def test_a_turn_with_code_ends_the_episode_one_without_gets_one_reminder() -> None:
    code_handler = CodeHandler()
    assert code_handler.step(NATIVE, program("print(1)"), 0).stop_reason == "answer"
    reminder = code_handler.step(NATIVE, "Let me think.", 0)
    assert not reminder.done and "```python" in reminder.messages[0]["content"]
    assert code_handler.step(NATIVE, "Still thinking.", 1).stop_reason == "no_code"


def test_the_prompt_says_how_the_program_is_run() -> None:
    code_handler = CodeHandler()
    stdin_prompt = code_handler.initial_messages(NATIVE)[1]["content"]
    assert NATIVE["problem"] in stdin_prompt and "standard input" in stdin_prompt
    call_prompt = code_handler.initial_messages(LCB)[1]["content"]
    assert "`twoSum`" in call_prompt and "def twoSum(self" in call_prompt


# ----------------------------------------------------------------------------- comparison


@pytest.mark.parametrize(
    ("got", "expected"),
    [
        ("3\n", "3"),
        ("1 2  3\r\n\n", "1\n2\n3"),
        ("0.333333333", "0.3333333333333333"),
        ("1.0", "1"),
        ("1000000.5", "1000000.0"),
        ("007", "7"),
        ("1" * 5000, "0" + "1" * 5000),
    ],
)
def test_outputs_that_match(got: str, expected: str) -> None:
    assert outputs_match(got, expected)


@pytest.mark.parametrize(
    ("got", "expected"),
    [
        ("3 4", "3"),
        ("YES", "yes"),
        ("0.3334", "0.3333333"),
        ("10000000000000001", "10000000000000000"),
        ("1" * 5000 + "2", "1" * 5000 + "3"),
        ("nan", "nan0"),
        ("1e999", "2e999"),
        ("", "0"),
    ],
)
def test_outputs_that_do_not_match(got: str, expected: str) -> None:
    assert not outputs_match(got, expected)


def test_return_values_compare_as_json_with_float_tolerance() -> None:
    assert values_match([1, [2.0000000001, "a"]], [1, [2, "a"]])
    assert values_match({"k": None}, {"k": None})
    assert not values_match(True, 1)
    assert not values_match([1, 2], [1, 2, 3])
    assert not values_match(2**70, 2**70 + 1)
    assert not values_match(10**400, 1.5)


# ----------------------------------------------------------------------------- grading


@pytest.fixture
def code_handler(bwrap_backend: BubblewrapBackend, state_root: Path) -> Iterator[CodeHandler]:
    """A handler grading in bubblewrap boxes under `state_root`; every box must be gone after."""
    yield CodeHandler(backend="bwrap", state_root=state_root, budget_seconds=60)
    assert [p.name for p in state_root.iterdir() if not p.name.startswith(".")] == []
    assert processes_mentioning(JOB) == []


def stdin_task(*cases: tuple[str, str], **fields: Any) -> dict[str, Any]:
    tests = [{"input": i, "output": o} for i, o in cases]
    return {"data_source": "code", "problem": "Solve it.", "tests": tests, **fields}


ADD = program("a, b = map(int, input().split())\nprint(a + b)")


def test_a_correct_stdin_program_gets_reward_one(code_handler: CodeHandler) -> None:
    grade = code_handler.grade(NATIVE, [ADD], job_id=JOB)
    assert grade.reward == 1.0
    assert (grade.details["passed"], grade.details["total"]) == (2, 2)
    assert [t["verdict"] for t in grade.details["tests"]] == ["pass", "pass"]


def test_function_calls_reach_top_level_functions_and_solution_methods(
    code_handler: CodeHandler,
) -> None:
    assert (
        code_handler.grade(
            NATIVE_CALL, [program("def square(x):\n    return x * x")], job_id=JOB
        ).reward
        == 1.0
    )
    two_sum = """
class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return (seen[target - x], i)
            seen[x] = i
"""
    grade = code_handler.grade(LCB, [program(two_sum)], job_id=JOB)
    assert grade.reward == 1.0, grade.details


def test_a_wrong_answer_is_reported_with_what_was_printed(code_handler: CodeHandler) -> None:
    grade = code_handler.grade(NATIVE, [program("print(3)")], job_id=JOB)
    assert grade.reward == 0.0
    first, second = grade.details["tests"]
    assert first["verdict"] == "pass"
    assert second["verdict"] == "wrong answer"
    assert "got '3', expected '0'" in second["message"]


def test_a_runtime_error_is_reported_with_the_exception(code_handler: CodeHandler) -> None:
    grade = code_handler.grade(
        NATIVE_CALL, [program("def square(x):\n    return x / 0")], job_id=JOB
    )
    verdict = grade.details["tests"][0]
    assert verdict["verdict"] == "runtime error"
    assert "ZeroDivisionError" in verdict["message"]


def test_an_endless_loop_hits_the_time_limit_and_the_other_tests_still_run(
    code_handler: CodeHandler,
) -> None:
    loop = program("s = input()\nwhile s == 'spin':\n    pass\nprint(s)")
    task = stdin_task(("spin\n", "spin"), ("ok\n", "ok"), time_limit=1, reward="fraction")
    started = time.monotonic()
    grade = code_handler.grade(task, [loop], job_id=JOB)
    assert time.monotonic() - started < 10
    assert [t["verdict"] for t in grade.details["tests"]] == ["time limit", "pass"]
    assert grade.details["tests"][0]["seconds"] >= 1.0
    assert grade.reward == 0.5


def test_a_program_that_takes_too_much_memory_hits_the_memory_limit(
    code_handler: CodeHandler,
) -> None:
    hog = program("data = bytearray(200 * 2**20)\nprint(len(data))")
    task = stdin_task(("\n", str(200 * 2**20)), memory_limit_mb=128)
    assert (
        code_handler.grade(task, [hog], job_id=JOB).details["tests"][0]["verdict"] == "memory limit"
    )
    assert (
        code_handler.grade(with_fields(task, memory_limit_mb=512), [hog], job_id=JOB).reward == 1.0
    )


def test_a_fork_bomb_is_contained_and_the_next_test_runs(code_handler: CodeHandler) -> None:
    bomb = program(
        """
import os
if input() == "bomb":
    while True:
        try:
            os.fork()
        except OSError:
            pass
print("calm")
"""
    )
    task = stdin_task(("bomb\n", "calm"), ("quiet\n", "calm"), time_limit=1, reward="fraction")
    grade = code_handler.grade(task, [bomb], job_id=JOB)
    assert grade.details["tests"][0]["verdict"] in ("time limit", "runtime error")
    assert grade.details["tests"][1]["verdict"] == "pass"


def test_shell_abuse_cannot_write_outside_or_outlive_its_test(
    code_handler: CodeHandler, visible_host_dir: Path
) -> None:
    target = visible_host_dir / "pwned"
    abuse = program(
        f"""
import os
os.system("sleep 1000 &")
os.system("echo x > {target}; echo x > /workspace/pwned; echo x > /workspace/tests/0.in")
if input() == "kill":
    os.system("kill -9 -1")
print("done")
"""
    )
    task = stdin_task(("kill\n", "done"), ("stay\n", "done"), ("stay\n", "done"), reward="fraction")
    grade = code_handler.grade(task, [abuse], job_id=JOB)
    assert [t["verdict"] for t in grade.details["tests"]] == ["runtime error", "pass", "pass"]
    assert "stopped the grader" in grade.details["tests"][0]["message"]
    assert not target.exists()


def test_a_program_has_no_network(code_handler: CodeHandler, host_listener: Listener) -> None:
    probe = program(
        f"""
import socket
reached = []
for address in [("127.0.0.1", {host_listener.port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(address, timeout=1).close()
        reached.append(address[0])
    except OSError:
        pass
print("reached", *reached) if reached else print("isolated")
"""
    )
    grade = code_handler.grade(stdin_task(("", "isolated")), [probe], job_id=JOB)
    assert grade.reward == 1.0, grade.details
    assert host_listener.accepted == 0


def test_all_needs_every_test_and_stops_at_the_first_crash_fraction_counts(
    code_handler: CodeHandler,
) -> None:
    flaky = program("n = int(input())\nassert n != 2\nprint(n)")
    cases = [("1\n", "1"), ("2\n", "2"), ("3\n", "3"), ("4\n", "4")]
    fraction = code_handler.grade(stdin_task(*cases, reward="fraction"), [flaky], job_id=JOB)
    assert fraction.reward == 0.75
    everything = code_handler.grade(stdin_task(*cases), [flaky], job_id=JOB)
    assert everything.reward == 0.0
    verdicts = [t["verdict"] for t in everything.details["tests"]]
    assert verdicts == ["pass", "runtime error", "skipped", "skipped"]


def test_the_time_budget_bounds_grading(bwrap_backend: BubblewrapBackend, state_root: Path) -> None:
    code_handler = CodeHandler(backend="bwrap", state_root=state_root, budget_seconds=3)
    spin = program("while True:\n    pass")
    task = stdin_task(*[("\n", "x")] * 6, time_limit=1, reward="fraction")
    started = time.monotonic()
    grade = code_handler.grade(task, [spin], job_id=JOB)
    assert time.monotonic() - started < 6
    verdicts = [t["verdict"] for t in grade.details["tests"]]
    assert verdicts[0] == "time limit" and verdicts[-1] == "skipped"
    assert "budget" in grade.details["tests"][-1]["message"]


def test_no_code_found_gives_reward_zero_without_a_sandbox() -> None:
    grade = CodeHandler(backend="no-such-backend").grade(
        NATIVE, ["I could not solve it."], job_id=JOB
    )
    assert grade.reward == 0.0
    assert grade.details["reason"] == "no code found"


def test_boxes_left_by_a_dead_grader_are_reaped(
    bwrap_backend: BubblewrapBackend, state_root: Path
) -> None:
    from sandbox.base import SandboxSpec

    grading_root = state_root / GRADING_DIR
    box = bwrap_backend.create(SandboxSpec(job_id="code-grade-999999999-1-abcd"), grading_root)
    assert reap(state_root, lambda job_id: False) == [box.id]
    assert not box.state_dir.exists()


# ----------------------------------------------------------------------------- the examples


def read_jsonl(name: str) -> list[dict[str, Any]]:
    lines = (EXAMPLES / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_the_example_tasks_validate_and_each_has_one_script_entry() -> None:
    code_handler = CodeHandler()
    tasks = read_jsonl("code_tasks.jsonl")
    script = read_jsonl("code_script.jsonl")
    assert len(tasks) == len(script) >= 5
    for task in tasks:
        code_handler.validate(task)
        prompt = "\n".join(m["content"] for m in code_handler.initial_messages(task))
        matches = [entry for entry in script if entry["match"] in prompt]
        assert len(matches) == 1, task["instance_id"]
        good, bad = (sample[-1] for sample in matches[0]["samples"])
        assert extract_code(good) and extract_code(bad)
