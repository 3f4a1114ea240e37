"""Runs a code task's tests inside the grading box (standard library only).

Started as `python -S -I -c <the text of this file>`: reads the plan as JSON on stdin, runs
each test as a child process under the test's limits, and reports on stdout a line
{"start": i} before test i and a line with its raw outcome after it. The comparison with
expected outputs happens outside the box, which never sees them.
"""

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def shield() -> None:
    # Not dumpable: a program under test runs as the same user, but cannot open this
    # process's descriptors through /proc or trace it, so it cannot forge its reports.
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE


def own_pid_namespace() -> bool:
    try:
        with open("/proc/1/comm") as f:
            return os.getpid() != 1 and f.read().strip() == "bwrap"
    except OSError:
        return False


def sweep() -> None:
    # kill(-1) reaches every process of this pid namespace but this one and bwrap (pid 1):
    # daemons and fork bombs a test left behind are gone before the next test starts.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.002)


def head(path: str, limit: int) -> tuple[str | None, bool]:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return None, False
    return data[:limit].decode("utf-8", "replace"), len(data) > limit


def tail(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def limiter(memory: int, cpu: int, fsize: int) -> Callable[[], None]:
    def apply() -> None:
        for which, value in (
            (resource.RLIMIT_AS, memory),
            (resource.RLIMIT_CPU, cpu),
            (resource.RLIMIT_FSIZE, fsize),
            (resource.RLIMIT_CORE, 0),
        ):
            hard = resource.getrlimit(which)[1]
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(which, (value, value))

    return apply


def run(
    test: dict[str, Any], plan: dict[str, Any], env: dict[str, str], sweeping: bool
) -> dict[str, Any]:
    io_dir = tempfile.mkdtemp(prefix="io-")
    work = tempfile.mkdtemp(prefix="work-")
    out_path = os.path.join(io_dir, "stdout")
    err_path = os.path.join(io_dir, "stderr")
    result_path = os.path.join(io_dir, "result")
    python = [plan["python"], "-I", "-X", "int_max_str_digits=0"]
    if test["kind"] == "call":
        argv = [*python, "-c", plan["call_runner"], plan["program"], test["fn_name"], result_path]
    else:
        argv = [*python, plan["program"]]
    env = dict(env, HOME=work, TMPDIR=work)
    cpu = int(plan["time_limit"]) + 1
    timed_out = False
    started = time.monotonic()
    try:
        with (
            open(test["input"], "rb") as stdin,
            open(out_path, "wb") as out,
            open(err_path, "wb") as err,
        ):
            proc = subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=out if test["kind"] == "stdio" else subprocess.DEVNULL,
                stderr=err,
                cwd=work,
                env=env,
                start_new_session=True,
                preexec_fn=limiter(plan["memory_bytes"], cpu, plan["file_size_bytes"]),
            )
            try:
                returncode = proc.wait(timeout=plan["time_limit"])
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                returncode = proc.wait()
    except OSError as exc:
        return {
            "done": test["index"],
            "returncode": 1,
            "timed_out": False,
            "seconds": 0.0,
            "stdout": "",
            "stdout_cut": False,
            "result": None,
            "result_cut": False,
            "stderr": f"grader: cannot run the program: {exc}",
        }
    seconds = time.monotonic() - started
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    if sweeping:
        sweep()
    stdout, stdout_cut = head(out_path, test["cap"])
    result, result_cut = head(result_path, test["cap"])
    record = {
        "done": test["index"],
        "returncode": returncode,
        "timed_out": timed_out,
        "seconds": round(seconds, 4),
        "stdout": stdout or "",
        "stdout_cut": stdout_cut,
        "result": result,
        "result_cut": result_cut,
        "stderr": tail(err_path, 2000),
    }
    shutil.rmtree(io_dir, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return record


def main() -> None:
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


if __name__ == "__main__":
    main()
