"""Code task records: the shapes the `code` handler accepts, read into one `CodeTask`.

Accepted task shapes (besides `data_source` and `instance_id`):

- native: `problem`, `tests` as a list of `{"input": str, "output": str}` (stdin/stdout) or
  `{"fn_name": str, "args": [...], "expected": value}` (function call), and optionally
  `time_limit` (seconds per test, default 5), `memory_limit_mb` (default 512),
  `reward` ("all", the default, or "fraction") and `starter_code`;
- APPS / TACO: `question`, `input_output` (JSON text or object) with `inputs`, `outputs` and,
  for function-call problems, `fn_name` (then each input is the list of arguments and each
  output the return value, or a one-element list holding it), `starter_code`;
- CodeContests: `description`, `public_tests`, `private_tests`, `generated_tests`, each
  `{"input": [...], "output": [...]}`; `time_limit` as `{"seconds", "nanos"}`,
  `memory_limit_bytes`;
- LiveCodeBench: `question_content`, `starter_code`, `public_test_cases` and
  `private_test_cases` (JSON text, or LiveCodeBench's base64/zlib/pickle packing of it) with
  `{"input", "output", "testtype": "stdin" | "functional"}`, and `metadata` (JSON text or
  object) whose `func_name` names the function of functional tests (each input line is one
  JSON argument, the output is the JSON return value);
- DeepCoder / DeepScaleR-style: `problem` and `tests` as JSON text or a list of
  `{"input", "output"}` items (with `testtype`/`type`, and `fn_name` or `metadata.func_name`
  for function calls), or an APPS-style `{"inputs", "outputs", "fn_name"}` object.

Tests come from the first of `tests`, `input_output`, the LiveCodeBench fields and the
CodeContests fields that the task has.
"""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
import zlib
from dataclasses import dataclass
from typing import Any, Literal

from core.schemas import json_problem
from workers.handlers.base import TaskValidationError, first_text

PROBLEM_FIELDS = ("problem", "question_content", "question", "description", "prompt")
"""Where the problem statement may be, in order of preference."""

DEFAULT_TIME_LIMIT = 5.0
MAX_TIME_LIMIT = 3600.0
"""Longest time limit of one test a task may set, in seconds."""
DEFAULT_MEMORY_MB = 512
MIN_MEMORY_MB = 64
"""Less address space than this does not start the interpreter reliably."""
MAX_MEMORY_MB = 1 << 20
"""Largest memory limit a task may set (1 TiB)."""
MAX_UNPACKED = 256 << 20
"""Largest packed LiveCodeBench test data unpacked (a small body could inflate to gigabytes)."""

RewardMode = Literal["all", "fraction"]


@dataclass(frozen=True)
class StdioTest:
    """Run the program with `input` on stdin; its stdout must match `output`."""

    input: str
    output: str


@dataclass(frozen=True)
class CallTest:
    """Call the program's function `fn_name` with `args`; it must return one of `expected`."""

    fn_name: str
    args: list[Any]
    expected: list[Any]
    """Accepted return values as JSON data (APPS allows the value or a list holding it)."""


TestCase = StdioTest | CallTest


@dataclass(frozen=True)
class CodeTask:
    """A validated code task."""

    problem: str
    starter_code: str
    tests: list[TestCase]
    time_limit: float
    """Wall-clock seconds per test."""
    memory_mb: int
    """Address-space limit of the program, in MiB."""
    reward: RewardMode


def read_task(task: dict[str, Any]) -> CodeTask:
    """The task as a `CodeTask`, from any accepted shape (see the module docstring).

    Raises `TaskValidationError` naming the offending field.
    """
    starter = task.get("starter_code") or ""
    if not isinstance(starter, str):
        raise TaskValidationError("starter_code", "must be a string")
    return CodeTask(
        problem=_problem_text(task),
        starter_code=starter,
        tests=_read_tests(task),
        time_limit=_time_limit(task),
        memory_mb=_memory_mb(task),
        reward=_reward_mode(task),
    )


def _problem_text(task: dict[str, Any]) -> str:
    return first_text(task, PROBLEM_FIELDS)


def _positive_number(value: Any, where: str, most: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TaskValidationError(where, "must be a positive number")
    if isinstance(value, float) and not math.isfinite(value):
        raise TaskValidationError(where, "must be finite")
    if not value <= most:  # compared exactly: an int too large for a float is refused here
        raise TaskValidationError(where, f"must be at most {most:g}")
    return float(value)


def _time_limit(task: dict[str, Any]) -> float:
    value = task.get("time_limit")
    if value is None:
        return DEFAULT_TIME_LIMIT
    if isinstance(value, dict):  # CodeContests: {"seconds": 2, "nanos": 500000000}
        seconds, nanos = value.get("seconds") or 0, value.get("nanos") or 0
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TaskValidationError("time_limit.seconds", "must be a number")
        if isinstance(nanos, bool) or not isinstance(nanos, (int, float)):
            raise TaskValidationError("time_limit.nanos", "must be a number")
        for part, name in ((seconds, "seconds"), (nanos, "nanos")):
            if not abs(part) <= MAX_TIME_LIMIT * 1e9:
                raise TaskValidationError(f"time_limit.{name}", "is out of range")
        total = seconds + nanos / 1e9
        # CodeContests leaves some limits at zero: unknown, so the default applies.
        if total == 0:
            return DEFAULT_TIME_LIMIT
        return _positive_number(total, "time_limit", MAX_TIME_LIMIT)
    return _positive_number(value, "time_limit", MAX_TIME_LIMIT)


def _memory_mb(task: dict[str, Any]) -> int:
    if task.get("memory_limit_mb") is not None:
        megabytes = _positive_number(task["memory_limit_mb"], "memory_limit_mb", MAX_MEMORY_MB)
        where = "memory_limit_mb"
    elif task.get("memory_limit_bytes"):  # CodeContests; 0 means unknown
        most = MAX_MEMORY_MB * 2**20
        megabytes = _positive_number(task["memory_limit_bytes"], "memory_limit_bytes", most)
        megabytes /= 2**20
        where = "memory_limit_bytes"
    else:
        return DEFAULT_MEMORY_MB
    if megabytes < MIN_MEMORY_MB:
        raise TaskValidationError(where, f"must be at least {MIN_MEMORY_MB} MiB")
    return math.ceil(megabytes)


def _reward_mode(task: dict[str, Any]) -> RewardMode:
    mode = task.get("reward", "all")
    if mode == "all":
        return "all"
    if mode == "fraction":
        return "fraction"
    raise TaskValidationError("reward", 'must be "all" or "fraction"')


def _json_field(value: Any, where: str) -> Any:
    """A field that may hold JSON text: the parsed value, or the value itself."""
    if not isinstance(value, str):
        return value
    try:
        return _decoded(json.loads(value), where)
    except (ValueError, RecursionError):
        raise TaskValidationError(where, "is not valid JSON") from None


def _decoded(value: Any, where: str) -> Any:
    """`value`, decoded from JSON text in the task, when it can be passed on: no lone
    surrogate (a test's input is written to a file as UTF-8) and no deep nesting."""
    problem = json_problem(value, allow_nonfinite=True)
    if problem is not None:
        path, message = problem
        inner = "".join(f"[{p!r}]" for p in path)
        raise TaskValidationError(where, f"decodes to JSON that {message} (at {inner or 'top'})")
    return value


def _task_fn_name(task: dict[str, Any]) -> str | None:
    """The function name a task gives for all its function-call tests, if any."""
    if task.get("fn_name") is not None:
        return _fn_name(task["fn_name"], "fn_name")
    metadata = _json_field(task.get("metadata"), "metadata")
    if isinstance(metadata, dict) and metadata.get("func_name") is not None:
        return _fn_name(metadata["func_name"], "metadata.func_name")
    return None


def _fn_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.isidentifier():
        raise TaskValidationError(where, "must be a Python identifier")
    return value


def _text(value: Any, where: str) -> str:
    """A test's input or output: a string, or a list of lines (APPS) joined by newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise TaskValidationError(where, "must be a string (or a list of lines)")


def _apps_call(fn_name: str, args: Any, output: Any, args_where: str) -> CallTest:
    if isinstance(args, str):
        args = _json_field(args, args_where)
    if not isinstance(args, list):
        raise TaskValidationError(args_where, "must be the list of arguments")
    # APPS stores a return value either as is or wrapped in a one-element list.
    expected = [output]
    if isinstance(output, list) and output:
        expected.append(output[0])
    return CallTest(fn_name, args, expected)


def _lcb_call(fn_name: str, text: Any, output: Any, where: str) -> CallTest:
    if not isinstance(text, str):
        raise TaskValidationError(f"{where}.input", "must be a string")
    try:
        args = [json.loads(line) for line in text.split("\n") if line.strip()]
    except (ValueError, RecursionError):
        raise TaskValidationError(f"{where}.input", "each line must be a JSON value") from None
    _decoded(args, f"{where}.input")
    expected = _json_field(output, f"{where}.output")
    return CallTest(fn_name, args, [expected])


def _read_tests(task: dict[str, Any]) -> list[TestCase]:
    fn_name = _task_fn_name(task)
    if task.get("tests") is not None:
        tests = _tests_field(_json_field(task["tests"], "tests"), fn_name)
        where = "tests"
    elif task.get("input_output") is not None:
        tests = _apps_tests(_json_field(task["input_output"], "input_output"), "input_output")
        where = "input_output"
    elif task.get("public_test_cases") is not None or task.get("private_test_cases") is not None:
        tests = _lcb_tests(task, fn_name)
        where = "public_test_cases"
    elif any(task.get(k) is not None for k in ("public_tests", "private_tests", "generated_tests")):
        tests = _code_contests_tests(task)
        where = "public_tests"
    else:
        raise TaskValidationError(
            "tests",
            "is required (or input_output, public_test_cases/private_test_cases, "
            "public_tests/private_tests/generated_tests)",
        )
    if not tests:
        raise TaskValidationError(where, "holds no test cases")
    return tests


def _tests_field(value: Any, fn_name: str | None) -> list[TestCase]:
    if isinstance(value, dict):
        return _apps_tests(value, "tests")
    if not isinstance(value, list):
        raise TaskValidationError("tests", "must be a list of test cases (or an APPS object)")
    return [_test_item(item, f"tests.{i}", fn_name) for i, item in enumerate(value)]


def _test_item(item: Any, where: str, task_fn_name: str | None) -> TestCase:
    if not isinstance(item, dict):
        raise TaskValidationError(where, "must be an object")
    if "args" in item or "expected" in item:
        fn_name = _fn_name(item.get("fn_name", task_fn_name), f"{where}.fn_name")
        if not isinstance(item.get("args"), list):
            raise TaskValidationError(f"{where}.args", "must be the list of arguments")
        if "expected" not in item:
            raise TaskValidationError(f"{where}.expected", "is required")
        return CallTest(fn_name, item["args"], [item["expected"]])
    for key in ("input", "output"):
        if key not in item:
            raise TaskValidationError(
                f"{where}.{key}", "is required (or fn_name, args and expected)"
            )
    kind = item.get("testtype") or item.get("type")
    item_metadata = item.get("metadata")
    item_fn = item.get("fn_name")
    if item_fn is None and isinstance(item_metadata, dict):
        item_fn = item_metadata.get("func_name")
    if kind == "functional":  # LiveCodeBench: one JSON argument per input line
        fn_name = _fn_name(item_fn or task_fn_name, f"{where}.fn_name")
        return _lcb_call(fn_name, item["input"], item["output"], where)
    if kind == "function_call" or item_fn is not None:  # PrimeIntellect: APPS-style values
        fn_name = _fn_name(item_fn or task_fn_name, f"{where}.fn_name")
        return _apps_call(fn_name, item["input"], item["output"], f"{where}.input")
    return StdioTest(
        _text(item["input"], f"{where}.input"), _text(item["output"], f"{where}.output")
    )


def _apps_tests(value: Any, where: str) -> list[TestCase]:
    if not isinstance(value, dict):
        raise TaskValidationError(where, "must be an object with inputs and outputs")
    inputs, outputs = value.get("inputs"), value.get("outputs")
    if not isinstance(inputs, list):
        raise TaskValidationError(f"{where}.inputs", "must be a list")
    if not isinstance(outputs, list) or len(outputs) != len(inputs):
        raise TaskValidationError(f"{where}.outputs", "must be a list as long as inputs")
    if value.get("fn_name") is not None:
        fn_name = _fn_name(value["fn_name"], f"{where}.fn_name")
        return [
            _apps_call(fn_name, args, out, f"{where}.inputs.{i}")
            for i, (args, out) in enumerate(zip(inputs, outputs, strict=True))
        ]
    return [
        StdioTest(_text(inp, f"{where}.inputs.{i}"), _text(out, f"{where}.outputs.{i}"))
        for i, (inp, out) in enumerate(zip(inputs, outputs, strict=True))
    ]


class _StringsOnly(pickle.Unpickler):
    """Unpickles plain data only: a pickle naming any class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}")


def _lcb_cases(value: Any, where: str) -> list[Any]:
    """LiveCodeBench test cases: a list, its JSON text, or that text pickled, zlib-compressed
    and base64-encoded (how the dataset ships its private cases)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            value = _unpack_lcb(value, where)
        _decoded(value, where)
    if not isinstance(value, list):
        raise TaskValidationError(where, "must be a list of test cases")
    return value


def _unpack_lcb(text: str, where: str) -> Any:
    """Test cases packed as LiveCodeBench packs them: base64 of zlib of a pickled JSON text."""
    inflater = zlib.decompressobj()
    try:
        packed = inflater.decompress(base64.b64decode(text.encode(), validate=True), MAX_UNPACKED)
    except (ValueError, zlib.error):
        raise TaskValidationError(where, "is neither JSON nor packed test cases") from None
    if inflater.unconsumed_tail:
        raise TaskValidationError(where, f"unpacks to more than {MAX_UNPACKED} bytes")
    try:
        return json.loads(_StringsOnly(io.BytesIO(packed)).load())
    except Exception:  # a malformed pickle fails in many ways; they all mean the same here
        raise TaskValidationError(where, "holds packed data that is not test cases") from None


def _lcb_tests(task: dict[str, Any], fn_name: str | None) -> list[TestCase]:
    tests: list[TestCase] = []
    for key in ("public_test_cases", "private_test_cases"):
        if task.get(key) is None:
            continue
        for i, item in enumerate(_lcb_cases(task[key], key)):
            where = f"{key}.{i}"
            if isinstance(item, dict) and item.get("testtype") == "functional" and not fn_name:
                raise TaskValidationError("metadata.func_name", "is required for functional tests")
            tests.append(_test_item(item, where, fn_name))
    return tests


def _code_contests_tests(task: dict[str, Any]) -> list[TestCase]:
    tests: list[TestCase] = []
    for key in ("public_tests", "private_tests", "generated_tests"):
        group = _json_field(task.get(key), key)
        if group is None:
            continue
        if not isinstance(group, dict):
            raise TaskValidationError(key, "must be an object with input and output lists")
        inputs, outputs = group.get("input"), group.get("output")
        if not isinstance(inputs, list):
            raise TaskValidationError(f"{key}.input", "must be a list")
        if not isinstance(outputs, list) or len(outputs) != len(inputs):
            raise TaskValidationError(f"{key}.output", "must be a list as long as input")
        for i, (inp, out) in enumerate(zip(inputs, outputs, strict=True)):
            tests.append(StdioTest(_text(inp, f"{key}.input.{i}"), _text(out, f"{key}.output.{i}")))
    return tests
