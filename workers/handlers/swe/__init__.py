"""The `swe` data source: SWE-bench instances, worked by an agent in a sandbox and graded by
their tests.

INIT clones the repository into `/workspace` at `base_commit`; RUN's outcome is the
`git diff` of the workspace against `base_commit`, new files included; EVAL applies that
patch and the test patch in a fresh box and grades the test log with swebench's own parser
and grading functions, as its harness does. `task` reads and checks the task (and where its
repository may come from), `grading` grades a patch, `handler` holds `SweHandler`.
"""
