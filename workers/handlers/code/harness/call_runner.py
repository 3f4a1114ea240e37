"""Runs one function-call test, in the child process the test harness starts for it.

Started as `python -I -c <the text of this file> PROGRAM FN_NAME RESULT_PATH` (standard
library only): the arguments come as JSON on stdin, the program is loaded as the module
`solution` with the names LeetCode-style solutions take for granted (typing, collections,
...), and the return value goes as JSON to the result file.

No `from __future__` import here: the program under test, compiled here, would inherit it.
"""

import json
import os
import sys
import types
from typing import Any

PRELUDE = """
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
"""


def plain(value: object) -> list[Any]:
    if isinstance(value, (set, frozenset)):
        try:
            return sorted(value)
        except TypeError:
            return list(value)
    raise TypeError(f"a {type(value).__name__} is not JSON")


def main() -> None:
    program, fn_name, result_path = sys.argv[1:4]
    args = json.loads(sys.stdin.buffer.read())
    sys.stdin = open(os.devnull)  # noqa: SIM115
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
        sys.stderr.write(f"NameError: the program defines no function {fn_name!r}\n")
        sys.exit(1)
    result = function(*args)
    try:
        text = json.dumps(result, default=plain)
    except (TypeError, ValueError) as exc:
        sys.stderr.write(f"TypeError: the return value is not comparable: {exc}\n")
        sys.exit(1)
    with open(result_path, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
