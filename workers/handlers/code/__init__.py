"""The `code` data source: Python programs graded by hidden tests run in a sandbox.

`records` reads the task shapes it accepts (native, APPS/TACO, CodeContests, LiveCodeBench,
DeepCoder), `matching` finds the program in a reply and compares outputs, `grading` runs the
tests in a grading box and judges each run, with the two programs in `harness/` (package
data, run inside the box), and `handler` holds `CodeHandler`.
"""
