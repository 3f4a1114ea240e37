"""The `code` handler: program synthesis graded by hidden tests run in a sandbox.

The model answers with a Python 3 program in a fenced code block; the last ```python block
of the episode is graded (an untagged block counts when a turn has no tagged one).

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

Grading runs every test in a fresh sandbox (network off) under the time limit (wall clock,
interpreter start included) and the memory limit (address space). A stdin/stdout test
passes when the program exits 0 and its output matches the expected output token by token:
whitespace of any kind (spaces, tabs, line breaks) only separates tokens; two tokens match
when they are equal strings, equal integers ("007" and "7"), or numbers at least one of
which is not an integer that differ by at most 1e-6 absolutely or relatively; case matters.
A function-call test passes when the return value, turned into JSON (tuples become lists,
sets sorted lists), equals the expected value under the same number rule (booleans only
equal booleans). Verdicts: pass, wrong answer, runtime error, time limit, memory limit, and
skipped (not run: after a failure when the reward is "all", or once the grading time budget
is spent).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import math
import os
import pickle
import re
import secrets
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from core.schemas import json_problem
from core.settings import get_settings
from sandbox.backends import get_backend
from sandbox.base import (
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    chown_tree,
    explain_end,
    process_matches,
    process_start_time,
)
from sandbox.reaper import reap
from workers.handlers.base import (
    Grade,
    Handler,
    StepResult,
    TaskValidationError,
    ToolSession,
    first_text,
    visible_text,
)

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the programming problem. Think it through, "
    "then give your complete solution as one Python 3 program in a single ```python code "
    "block; the last such block of your reply is what gets tested."
)
STDIO_INSTRUCTION = (
    "Your program reads the input from standard input and writes the answer to standard output."
)
REMINDER = "Please give your complete solution as one Python 3 program in a ```python code block."

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
FLOAT_TOLERANCE = 1e-6
MAX_UNPACKED = 256 << 20
"""Largest packed LiveCodeBench test data unpacked (a small body could inflate to gigabytes)."""
"""Largest absolute or relative difference of two matching non-integer numbers."""

RewardMode = Literal["all", "fraction"]
Verdict = Literal["pass", "wrong answer", "runtime error", "time limit", "memory limit", "skipped"]


# ----------------------------------------------------------------------------- task records


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


# ----------------------------------------------------------------------------- the answer

# A fenced block: its language tag and its body, up to the next fence.
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "python3", "py", "py3"})


def extract_code(text: str) -> str | None:
    """The program in an assistant turn: the last ```python block of its visible text, or,
    when there is none, the last untagged block; None when neither holds any code."""
    tagged: str | None = None
    untagged: str | None = None
    for match in _FENCE.finditer(visible_text(text)):
        tag, body = match.group(1).lower(), match.group(2)
        if not body.strip():
            continue
        if tag in _PYTHON_TAGS:
            tagged = body
        elif not tag:
            untagged = body
    return tagged if tagged is not None else untagged


def last_program(assistant_texts: list[str]) -> tuple[str, int] | None:
    """The program of the last turn that has one, and that turn's index; None if none has."""
    for turn in range(len(assistant_texts) - 1, -1, -1):
        code = extract_code(assistant_texts[turn])
        if code is not None:
            return code, turn
    return None


# ----------------------------------------------------------------------------- comparison

_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_INTEGER = re.compile(r"[+-]?\d+")


def _integer_key(token: str) -> tuple[bool, str]:
    """(negative, digits) of an integer token, so that huge integers compare without int()."""
    negative = token.startswith("-")
    digits = token.lstrip("+-").lstrip("0") or "0"
    return negative and digits != "0", digits


def tokens_match(got: str, expected: str) -> bool:
    """Two output tokens match: equal, equal integers, or numbers within `FLOAT_TOLERANCE`."""
    if got == expected:
        return True
    if not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(expected)):
        return False
    if _INTEGER.fullmatch(got) and _INTEGER.fullmatch(expected):
        return _integer_key(got) == _integer_key(expected)
    # Tokens too large for a float ("1e999") only match when written the same.
    return _numbers_close(float(got), float(expected), infinite_equal=False)


def _numbers_close(got: float, expected: float, *, infinite_equal: bool = True) -> bool:
    if not (math.isfinite(got) and math.isfinite(expected)):
        return infinite_equal and got == expected
    return abs(got - expected) <= FLOAT_TOLERANCE * max(1.0, abs(expected))


def outputs_match(got: str, expected: str) -> bool:
    """A program's output matches the expected output (the token rule in the module docstring)."""
    got_tokens, expected_tokens = got.split(), expected.split()
    return len(got_tokens) == len(expected_tokens) and all(
        tokens_match(g, e) for g, e in zip(got_tokens, expected_tokens, strict=True)
    )


def values_match(got: Any, expected: Any) -> bool:
    """Two JSON values are equal, numbers within `FLOAT_TOLERANCE` (integers exactly)."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return isinstance(got, bool) and isinstance(expected, bool) and got == expected
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(got, int) and isinstance(expected, int):
            return got == expected
        try:
            return _numbers_close(float(got), float(expected))
        except OverflowError:  # an integer beyond any float
            return False
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(
            values_match(g, e) for g, e in zip(got, expected, strict=True)
        )
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_match(got[k], expected[k]) for k in got)
    return type(got) is type(expected) and bool(got == expected)


# ----------------------------------------------------------------------------- running tests

# Runs in the sandbox (`python -S -I -c HARNESS`, standard library only): reads the plan as
# JSON on stdin, runs each test as a child process under the test's limits, and reports on
# stdout a line {"start": i} before test i and a line with its raw outcome after it. The
# comparison with expected outputs happens outside the box, which never sees them.
HARNESS = r"""
import json, os, resource, shutil, signal, subprocess, sys, tempfile, time


def emit(record):
    sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def shield():
    # Not dumpable: a program under test runs as the same user, but cannot open this
    # process's descriptors through /proc or trace it, so it cannot forge its reports.
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except Exception:
        pass


def own_pid_namespace():
    try:
        with open("/proc/1/comm") as f:
            return os.getpid() != 1 and f.read().strip() == "bwrap"
    except OSError:
        return False


def sweep():
    # kill(-1) reaches every process of this pid namespace but this one and bwrap (pid 1):
    # daemons and fork bombs a test left behind are gone before the next test starts.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.002)


def head(path, limit):
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return None, False
    return data[:limit].decode("utf-8", "replace"), len(data) > limit


def tail(path, limit):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def limiter(memory, cpu, fsize):
    def apply():
        for which, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                             (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
            hard = resource.getrlimit(which)[1]
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(which, (value, value))
    return apply


def run(test, plan, env, sweeping):
    io_dir = tempfile.mkdtemp(prefix="io-")
    work = tempfile.mkdtemp(prefix="work-")
    out_path = os.path.join(io_dir, "stdout")
    err_path = os.path.join(io_dir, "stderr")
    result_path = os.path.join(io_dir, "result")
    python = [plan["python"], "-I", "-X", "int_max_str_digits=0"]
    if test["kind"] == "call":
        argv = python + ["-c", plan["call_runner"], plan["program"], test["fn_name"], result_path]
    else:
        argv = python + [plan["program"]]
    env = dict(env, HOME=work, TMPDIR=work)
    cpu = int(plan["time_limit"]) + 1
    timed_out = False
    started = time.monotonic()
    try:
        with open(test["input"], "rb") as stdin, open(out_path, "wb") as out, \
                open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv, stdin=stdin, stdout=out if test["kind"] == "stdio" else subprocess.DEVNULL,
                stderr=err, cwd=work, env=env, start_new_session=True,
                preexec_fn=limiter(plan["memory_bytes"], cpu, plan["file_size_bytes"]),
            )
            try:
                returncode = proc.wait(timeout=plan["time_limit"])
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                returncode = proc.wait()
    except OSError as exc:
        return {"done": test["index"], "returncode": 1, "timed_out": False, "seconds": 0.0,
                "stdout": "", "stdout_cut": False, "result": None, "result_cut": False,
                "stderr": "grader: cannot run the program: %s" % exc}
    seconds = time.monotonic() - started
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    if sweeping:
        sweep()
    stdout, stdout_cut = head(out_path, test["cap"])
    result, result_cut = head(result_path, test["cap"])
    record = {"done": test["index"], "returncode": returncode, "timed_out": timed_out,
              "seconds": round(seconds, 4), "stdout": stdout or "", "stdout_cut": stdout_cut,
              "result": result, "result_cut": result_cut, "stderr": tail(err_path, 2000)}
    shutil.rmtree(io_dir, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return record


def main():
    plan = json.loads(sys.stdin.buffer.read())
    shield()
    sweeping = plan["sweep"] and own_pid_namespace()
    env = dict(os.environ)
    env.update(plan["env"])
    for test in plan["tests"]:
        emit({"start": test["index"]})
        record = run(test, plan, env, sweeping)
        emit(record)
        if plan["stop_on_error"] and (record["timed_out"] or record["returncode"] != 0):
            break


main()
"""

# Runs a function-call test in the child: the arguments come as JSON on stdin, the program is
# loaded as the module `solution` with the names LeetCode-style solutions take for granted
# (typing, collections, ...), and the return value goes as JSON to the result file.
CALL_RUNNER = r"""
import json, os, sys, types

PRELUDE = '''
from typing import *
from collections import *
from itertools import *
from functools import *
from heapq import *
from bisect import *
from math import *
import bisect, collections, functools, heapq, itertools, math, operator, random, re, string, sys
from builtins import *
sys.setrecursionlimit(max(sys.getrecursionlimit(), 50000))
'''


def plain(value):
    if isinstance(value, (set, frozenset)):
        try:
            return sorted(value)
        except TypeError:
            return list(value)
    raise TypeError("a %s is not JSON" % type(value).__name__)


def main():
    program, fn_name, result_path = sys.argv[1:4]
    args = json.loads(sys.stdin.buffer.read())
    sys.stdin = open(os.devnull)
    module = types.ModuleType("solution")
    module.__file__ = program
    sys.modules["solution"] = module
    exec(PRELUDE, module.__dict__)
    with open(program, encoding="utf-8") as f:
        code = compile(f.read(), program, "exec")
    exec(code, module.__dict__)
    holder = module.__dict__.get("Solution")
    if isinstance(holder, type) and hasattr(holder, fn_name):
        function = getattr(holder(), fn_name)
    elif callable(module.__dict__.get(fn_name)):
        function = module.__dict__[fn_name]
    else:
        sys.stderr.write("NameError: the program defines no function %r\n" % fn_name)
        sys.exit(1)
    result = function(*args)
    try:
        text = json.dumps(result, default=plain)
    except (TypeError, ValueError) as exc:
        sys.stderr.write("TypeError: the return value is not comparable: %s\n" % exc)
        sys.exit(1)
    with open(result_path, "w", encoding="utf-8") as f:
        f.write(text)


main()
"""

PROGRAM_INSIDE = "/workspace/solution.py"
TESTS_INSIDE = "/workspace/tests"
MIN_OUTPUT_CAP = 64 << 10
"""Bytes of output (or of a JSON return value) always kept; more when the expected is longer."""
FILE_SIZE_LIMIT = 64 << 20
"""Largest file a program under test may write, stdout and stderr included."""
PROCESS_LIMIT = 64
"""Processes and threads of one grading box at a time."""
PER_TEST_SLACK = 3.0
"""Seconds allowed per test beyond its time limit: cleaning up after it, and reporting."""
RUN_SLACK = 10.0
"""Seconds allowed per harness run for starting the box and the harness."""
HARNESS_MEMORY = 256 << 20
"""Address space of the harness beyond the outputs it holds."""

# Extra environment of the programs under test: BLAS pools of one thread, so that numpy
# stays inside the address-space limit.
PROGRAM_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class TestResult:
    """How one test went."""

    index: int
    kind: Literal["stdio", "call"]
    verdict: Verdict
    seconds: float | None = None
    message: str = ""
    """A short excerpt: the difference, the error's last lines, or why the test did not run."""

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"test": self.index, "kind": self.kind, "verdict": self.verdict}
        if self.seconds is not None:
            data["seconds"] = self.seconds
        if self.message:
            data["message"] = self.message
        return data


def _excerpt(text: str, limit: int = 200) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _error_excerpt(stderr: str, limit: int = 300) -> str:
    """The end of a traceback: its last few lines, where the exception is named."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    text = "\n".join(lines[-3:])
    return text if len(text) <= limit else "…" + text[-(limit - 1) :]


def _output_cap(test: TestCase) -> int:
    if isinstance(test, StdioTest):
        size = len(test.output.encode())
    else:
        size = max(len(json.dumps(value)) for value in test.expected)
    return max(MIN_OUTPUT_CAP, 2 * size + 4096)


def judge(test: TestCase, index: int, record: dict[str, Any]) -> TestResult:
    """The verdict on one test from the harness's raw record of its run."""
    kind: Literal["stdio", "call"] = "stdio" if isinstance(test, StdioTest) else "call"
    seconds = float(record.get("seconds", 0.0))
    returncode = int(record.get("returncode", 1))
    timed_out = bool(record.get("timed_out"))
    stderr = str(record.get("stderr") or "")

    def result(verdict: Verdict, message: str = "") -> TestResult:
        return TestResult(index, kind, verdict, seconds, message)

    limit = explain_end(returncode, stderr, timed_out) if returncode != 0 or timed_out else None
    if timed_out or limit == "cpu_seconds":
        return result("time limit")
    if limit == "memory_bytes":
        return result("memory limit", _error_excerpt(stderr))
    if returncode != 0:
        reasons = {"processes": "process limit reached", "file_size_bytes": "output too large"}
        why = reasons.get(limit or "") or (f"killed by {limit}" if limit else "")
        message = _error_excerpt(stderr) or f"exit status {returncode}"
        return result("runtime error", f"{why}: {message}" if why else message)
    if isinstance(test, StdioTest):
        if record.get("stdout_cut"):
            return result("wrong answer", "output longer than the grader keeps")
        got = str(record.get("stdout") or "")
        if outputs_match(got, test.output):
            return result("pass")
        return result("wrong answer", f"got {_excerpt(got)!r}, expected {_excerpt(test.output)!r}")
    if record.get("result") is None:
        return result("runtime error", "the function returned no result (the program exited)")
    if record.get("result_cut"):
        return result("wrong answer", "return value longer than the grader keeps")
    try:
        value = json.loads(str(record["result"]))
    except ValueError:
        return result("runtime error", "the return value is not JSON")
    if any(values_match(value, expected) for expected in test.expected):
        return result("pass")
    return result(
        "wrong answer",
        f"got {_excerpt(json.dumps(value))}, expected {_excerpt(json.dumps(test.expected[0]))}",
    )


@dataclass(frozen=True)
class GradingBox:
    """Where grading boxes are made: a backend name and a state root."""

    backend: str
    state_root: Path


def _owner_job_id() -> str:
    """A job id for a grading box naming the process that owns it (pid and start time)."""
    pid = os.getpid()
    return f"code-grade-{pid}-{process_start_time(pid) or 0}-{secrets.token_hex(4)}"


def _owner_alive(job_id: str) -> bool:
    """True while the process named in a grading box's job id runs."""
    parts = job_id.split("-")
    if len(parts) != 5 or parts[:2] != ["code", "grade"]:
        return False
    try:
        pid, start = int(parts[2]), int(parts[3])
    except ValueError:
        return False
    return process_matches(pid, start or None)


def reap_grading_boxes(state_root: Path) -> list[str]:
    """Remove grading boxes under `state_root` whose owning process is gone or whose lease
    ran out (a worker that crashed mid-grade leaves its box's state behind)."""
    if not state_root.is_dir():
        return []
    return reap(state_root, _owner_alive)


def run_tests(
    program: str,
    task: CodeTask,
    where: GradingBox,
    *,
    budget_seconds: float,
    stop_at_first_failure: bool,
) -> list[TestResult]:
    """Run `program` on every test of `task` in a fresh sandbox; one result per test, in order.

    The box has no network, and each test runs as its own process under the task's time and
    memory limits. A test that hangs, blows its memory or kills the grader fails alone;
    the others are still run. With `stop_at_first_failure`, tests after the first one that
    fails to exit cleanly are skipped. Everything ends within about `budget_seconds`, tests
    not reached by then are skipped, and the box is always stopped.
    """
    deadline = time.monotonic() + budget_seconds
    caps = [_output_cap(test) for test in task.tests]
    file_size = max(FILE_SIZE_LIMIT, *caps)
    # The box's limits bind the harness; each program gets the task's own (lower) ones.
    limits = Limits(
        cpu_seconds=math.ceil(budget_seconds) + 10,
        memory_bytes=(task.memory_mb << 20) + 8 * max(caps) + HARNESS_MEMORY,
        processes=PROCESS_LIMIT,
        file_size_bytes=file_size,
    )
    spec = SandboxSpec(
        job_id=_owner_job_id(),
        network=False,
        limits=limits,
        lease_seconds=budget_seconds + 120.0,
    )
    results: dict[int, TestResult] = {}
    budget_spent = False
    box: Sandbox | None = None
    try:
        box = _backend(where.backend).create(spec, where.state_root)
        _write_inputs(box, program, task)
        box.start(tool_server=False)
        pending = list(range(len(task.tests)))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining < min(task.time_limit, 1.0):
                budget_spent = True
                break
            ran = _harness_run(box, task, pending, caps, remaining, stop_at_first_failure)
            results.update(ran)
            failed = any(r.verdict != "pass" for r in ran.values())
            pending = [i for i in pending if i not in ran]
            if stop_at_first_failure and failed:
                break
    finally:
        if box is not None:
            box.stop()
    for index, test in enumerate(task.tests):
        if index not in results:
            kind: Literal["stdio", "call"] = "stdio" if isinstance(test, StdioTest) else "call"
            why = "the grading time budget was spent" if budget_spent else "an earlier test failed"
            results[index] = TestResult(index, kind, "skipped", message=why)
    return [results[i] for i in range(len(task.tests))]


@functools.cache
def _backend(name: str) -> SandboxBackend:
    """One backend object per name, so `auto` probes this host once, not once per grade."""
    return get_backend(name)


def _write_inputs(box: Sandbox, program: str, task: CodeTask) -> None:
    """Put the program and the test inputs in the box's workspace, read-only to the box."""
    workspace = box.workspace
    (workspace / "solution.py").write_text(program, encoding="utf-8")
    tests_dir = workspace / "tests"
    tests_dir.mkdir()
    for index, test in enumerate(task.tests):
        data = test.input if isinstance(test, StdioTest) else json.dumps(test.args)
        (tests_dir / f"{index}.in").write_text(data, encoding="utf-8")
    if os.geteuid() == 0:
        # As root the box runs under a uid of its own that was given the workspace; taking
        # it back leaves the program nothing on the host's disk to write to.
        chown_tree(workspace, 0, 0)


def _harness_run(
    box: Sandbox,
    task: CodeTask,
    pending: list[int],
    caps: list[int],
    remaining: float,
    stop_at_first_failure: bool,
) -> dict[int, TestResult]:
    """One run of the harness over `pending`: the results of the tests it finished, and of
    the one it was running when it died (a grader killed by its test fails that test).

    Raises SandboxError when the harness did not get as far as starting a test: no program
    had run yet, so the fault is the grader's, not the answer's.
    """
    plan = {
        "python": sys.executable,
        "program": PROGRAM_INSIDE,
        "call_runner": CALL_RUNNER,
        "time_limit": task.time_limit,
        "memory_bytes": task.memory_mb << 20,
        "file_size_bytes": max(FILE_SIZE_LIMIT, *caps),
        "env": PROGRAM_ENV,
        "sweep": box.backend == "bwrap",
        "stop_on_error": stop_at_first_failure,
        "tests": [
            {
                "index": i,
                "kind": "stdio" if isinstance(task.tests[i], StdioTest) else "call",
                "fn_name": getattr(task.tests[i], "fn_name", None),
                "input": f"{TESTS_INSIDE}/{i}.in",
                "cap": caps[i],
            }
            for i in pending
        ],
    }
    timeout = min(remaining, len(pending) * (task.time_limit + PER_TEST_SLACK) + RUN_SLACK)
    output_room = sum(6 * caps[i] + 8192 for i in pending) + (1 << 20)
    outcome = box.exec(
        [sys.executable, "-S", "-I", "-c", HARNESS],
        timeout=timeout,
        input=json.dumps(plan).encode(),
        max_output=output_room,
    )
    results: dict[int, TestResult] = {}
    running: int | None = None
    started = False
    for line in outcome.stdout.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if not isinstance(record, dict):
                continue
            if "start" in record:
                running = int(record["start"])
                started = True
            elif "done" in record:
                index = int(record["done"])
                results[index] = judge(task.tests[index], index, record)
                running = None
    if not started:
        raise SandboxError(
            f"the grading harness did not start (exit status {outcome.returncode}): "
            f"{_error_excerpt(outcome.stderr) or '(no output)'}"
        )
    if running is not None and running not in results:
        kind: Literal["stdio", "call"] = (
            "stdio" if isinstance(task.tests[running], StdioTest) else "call"
        )
        if outcome.timed_out:
            results[running] = TestResult(
                running, kind, "time limit", message="the grader timed out"
            )
        else:
            why = outcome.killed_by or f"exit status {outcome.returncode}"
            results[running] = TestResult(
                running, kind, "runtime error", message=f"the test stopped the grader ({why})"
            )
    return results


# ----------------------------------------------------------------------------- handler


class CodeHandler(Handler):
    """Python programs graded by hidden tests in a sandbox: reward 1.0 when all pass, or the
    passing fraction when the task asks for it."""

    name: ClassVar[str] = "code"

    def __init__(
        self,
        *,
        budget_seconds: float = 300.0,
        stop_at_first_failure: bool = True,
        backend: str | None = None,
        state_root: Path | None = None,
    ) -> None:
        """`budget_seconds` bounds one episode's grading (also kept under EVAL's soft time
        limit); with `stop_at_first_failure`, an "all" task stops at its first test that fails
        to exit cleanly. `backend` and `state_root` default to the settings' sandbox backend
        and `<sandbox_dir>/.grading`."""
        self.budget_seconds = budget_seconds
        self.stop_at_first_failure = stop_at_first_failure
        self.backend = backend
        self.state_root = state_root

    def validate(self, task: dict[str, Any]) -> None:
        """Require a problem statement and at least one well-formed test (any accepted shape)."""
        read_task(task)

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """A system prompt asking for one program in a ```python block, then the problem with
        how the program is run: on stdin/stdout, or by calling the named function."""
        spec = read_task(task)
        parts = [spec.problem.strip()]
        calls = sorted({t.fn_name for t in spec.tests if isinstance(t, CallTest)})
        if calls:
            names = ", ".join(f"`{name}`" for name in calls)
            parts.append(
                f"Your program defines the function {names} (at top level, or as a method of a "
                "class `Solution`); the tests call it and check what it returns."
            )
        else:
            parts.append(STDIO_INSTRUCTION)
        if spec.starter_code.strip():
            parts.append(f"Start from this code:\n```python\n{spec.starter_code.rstrip()}\n```")
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "\n\n".join(parts)},
        ]

    def step(self, task: dict[str, Any], assistant_text: str, turn: int) -> StepResult:
        """Done once the turn holds a program; otherwise one reminder, then the episode ends."""
        if extract_code(assistant_text) is not None:
            return StepResult(done=True, stop_reason="answer")
        if turn == 0:
            return StepResult(done=False, messages=[{"role": "user", "content": REMINDER}])
        return StepResult(done=True, stop_reason="no_code")

    def warm_up(self) -> None:
        """Clear grading boxes a crashed worker left behind on this host."""
        reap_grading_boxes(self._where().state_root)

    def grade(
        self,
        task: dict[str, Any],
        assistant_texts: list[str],
        tools: ToolSession | None = None,
        outcome: dict[str, Any] | None = None,
    ) -> Grade:
        """Run the episode's last program on the task's tests in a fresh sandbox.

        Reward 1.0 when every test passes (0.0 otherwise), or the passing fraction with
        `reward: "fraction"`. Details: `passed`, `total`, per-test verdicts in `tests`, and a
        `reason` ("no code found" when no turn holds a program).
        """
        spec = read_task(task)
        details: dict[str, Any] = {
            "method": "tests",
            "reward_mode": spec.reward,
            "passed": 0,
            "total": len(spec.tests),
            "time_limit": spec.time_limit,
            "memory_limit_mb": spec.memory_mb,
        }
        found = last_program(assistant_texts)
        if found is None:
            details.update(reason="no code found", tests=[])
            return Grade(reward=0.0, details=details)
        program, turn = found
        started = time.monotonic()
        where = self._where()
        reap_grading_boxes(where.state_root)
        results = run_tests(
            program,
            spec,
            where,
            budget_seconds=self._budget(),
            stop_at_first_failure=self.stop_at_first_failure and spec.reward == "all",
        )
        passed = sum(r.verdict == "pass" for r in results)
        total = len(results)
        all_passed = 1.0 if passed == total else 0.0
        reward = passed / total if spec.reward == "fraction" else all_passed
        failed = [r for r in results if r.verdict != "pass"]
        details.update(
            passed=passed,
            code_turn=turn,
            grading_seconds=round(time.monotonic() - started, 3),
            reason="all tests passed"
            if not failed
            else f"test {failed[0].index}: {failed[0].verdict}",
            tests=[r.as_dict() for r in results],
        )
        return Grade(reward=reward, details=details)

    def _where(self) -> GradingBox:
        settings = get_settings()
        backend = self.backend or settings.sandbox_backend
        root = self.state_root or settings.sandbox_dir.resolve() / ".grading"
        return GradingBox(backend=backend, state_root=root)

    def _budget(self) -> float:
        # Past EVAL's soft limit the job fails; a partial grade within it is worth more.
        return max(1.0, min(self.budget_seconds, get_settings().eval_soft_time_limit * 0.8))
