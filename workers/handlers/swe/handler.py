"""The `swe` handler: the agent's prompt and tools, the checkout in INIT, the patch taken at
the end of RUN, and the grade of that patch in EVAL (see the package's modules)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import importlib
from typing import Any, ClassVar

from sandbox.base import WORKSPACE_INSIDE, SandboxSpec
from workers.handlers.base import Grade, Handler, StepResult, TaskValidationError, ToolSession
from workers.handlers.boxlimits import box_limits
from workers.handlers.gradingbox import grading_place
from workers.handlers.swe.grading import evaluate, text_tail
from workers.handlers.swe.task import (
    SweEnvironmentError,
    SweTask,
    allowed_image,
    allowed_repo_path,
    box_spec,
    checked_on_worker,
    checkout_script,
    job_source,
    read_task,
)
from workers.tool_specs import ALL_TOOLS

GIT_NO_PROGRAMS = "-c core.pager=cat -c diff.external= -c core.attributesFile=/dev/null"
PATCH_CHUNK = 48_000
"""Bytes of the patch read per tool call (as base64, well under the tool output cap)."""
OUTCOME_PATCH_FILE = "/workspace/.git/rollserve-outcome.patch"
"""Where the patch is kept while it is read: in the repository's own git dir (outside the
diff), since each command that collects the outcome runs in a fresh box with its own /tmp."""

SYSTEM = """\
You are an autonomous software engineer working in a Linux sandbox. A git repository is \
checked out at /workspace; your bash shell starts there. Your job is to resolve the issue \
the user gives you by changing the repository's non-test files.

Work like this:
1. Find and read the code the issue is about.
2. Reproduce the problem (a short script or a test run with `python -m pytest`).
3. Edit the source code to fix it, keeping the change small and the style of the code.
4. Check that the problem is gone and that nothing else broke; think about edge cases.
5. Call `finish`.

Your change is taken as the `git diff` of /workspace against the original commit when you \
call `finish`; hidden tests then decide whether the issue is resolved. Use absolute paths \
with the editor. Do not stop until the issue is resolved.\
"""

USER = """\
<uploaded_files>
{workspace}
</uploaded_files>
The repository {repo} is checked out at {workspace}. Resolve this issue:

<issue_description>
{problem_statement}
</issue_description>

Make the smallest change to the non-test files of the repository that resolves the issue, \
then call finish.\
"""

REMINDER = (
    "Your last message called no tool. Keep working on the issue in /workspace with the tools "
    "(bash, editor, ipython), and call finish once the issue is resolved."
)


class SweHandler(Handler):
    """SWE-bench tasks: the agent edits a repository in a sandbox; the instance's tests,
    run in a fresh sandbox, decide the reward (1.0 when resolved)."""

    name: ClassVar[str] = "swe"
    needs_sandbox: ClassVar[bool] = True
    grades_in_sandbox: ClassVar[bool] = False

    def validate(self, task: dict[str, Any]) -> None:
        parsed = read_task(task)
        if parsed.host_repo is not None:
            allowed_repo_path(parsed.host_repo, self.settings)
        if parsed.image is not None:
            allowed_image(parsed.image, self.settings)
        box_limits(task, self.settings)
        # Always graded in isolation (a fresh box, the patch, the test patch brought in at
        # grading time): `grading.isolated` may say so, never the opposite.
        grading = task.get("grading")
        if grading is not None and (
            not isinstance(grading, dict)
            or set(grading) - {"isolated"}
            or grading.get("isolated", True) is not True
        ):
            raise TaskValidationError(
                "grading", 'a swe task is always graded in a fresh box: only {"isolated": true}'
            )

    def warm_up(self) -> None:
        """Import swebench's harness (about two seconds) before the pool forks."""
        for module in ("swebench.harness.grading", "swebench.harness.run_evaluation"):
            importlib.import_module(module)

    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """A SWE-agent-style system prompt, and the issue with where the repository is."""
        parsed = read_task(task)
        user = USER.format(
            workspace=WORKSPACE_INSIDE,
            repo=parsed.repo,
            problem_statement=parsed.problem_statement.strip(),
        )
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def tools(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return ALL_TOOLS

    def sandbox_spec(self, task: dict[str, Any], job_id: str) -> SandboxSpec:
        """The box: the task's root (its image, or the host's), the job's repository (made
        from the host repository, checked again against this worker's policy, with nothing
        past `base_commit`: `job_source`) bound read-only at /rollserve/source, the task's
        interpreter first on PATH."""
        spec = box_spec(self._with_job_source(task, job_id), job_id)
        return dataclasses.replace(spec, limits=box_limits(task, self.settings, spec.limits))

    def prepare(self, task: dict[str, Any], tools: ToolSession) -> None:
        """Clone the repository into /workspace at `base_commit`; raises
        `SweEnvironmentError` saying why when that fails."""
        parsed = read_task(task)
        script = f"(cd {WORKSPACE_INSIDE} && {{\n{checkout_script(parsed)}\n}})"
        result = tools.call("bash", command=script, timeout=self._budget(parsed))
        if result.get("exit_code") != 0:
            raise SweEnvironmentError(
                f"cannot check out {parsed.base_commit} of {parsed.source} in the sandbox: "
                f"{text_tail(str(result.get('output', '')), 1000)}"
            )

    def step(self, task: dict[str, Any], assistant_text: str, turn: int) -> StepResult:
        return StepResult(done=False, messages=[{"role": "user", "content": REMINDER}])

    def collect_outcome(self, task: dict[str, Any], tools: ToolSession) -> dict[str, Any]:
        """`{"patch": the diff of /workspace against base_commit (new files included,
        binary ones as git binary patches), "changed_files": [...]}`; with an `error` and
        an empty patch when git could not make it."""
        parsed = read_task(task)
        budget = self._budget(parsed)
        # `tools` runs fresh processes in the halted box (workers.freshshell); the agent
        # still wrote the repository's config, so git is told to run none of its programs
        # (fsmonitor, hooks, external diff, textconv).
        git = f"git -c core.fsmonitor=false -c core.hooksPath=/dev/null {GIT_NO_PROGRAMS}"
        made = tools.call(
            "bash",
            command=(
                f"(cd {WORKSPACE_INSIDE} && unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE && "
                f"{git} add -A && {git} diff --cached --binary --no-ext-diff --no-textconv "
                f"{parsed.base_commit} > {OUTCOME_PATCH_FILE} && wc -c < {OUTCOME_PATCH_FILE} "
                f"&& {git} diff --cached --name-only --no-ext-diff {parsed.base_commit})"
            ),
            timeout=budget,
        )
        output = str(made.get("output", ""))
        lines = output.strip().splitlines()
        if made.get("exit_code") != 0 or not lines or not lines[0].strip().isdigit():
            return {"patch": "", "changed_files": [], "error": text_tail(output, 2000)}
        size = int(lines[0].strip())
        data = bytearray()
        while len(data) < size:
            chunk = tools.call(
                "bash",
                command=(
                    f"tail -c +{len(data) + 1} {OUTCOME_PATCH_FILE} | head -c {PATCH_CHUNK} "
                    "| base64 -w0"
                ),
                timeout=budget,
            )
            try:
                piece = base64.b64decode("".join(str(chunk.get("output", "")).split()))
            except binascii.Error:
                piece = b""
            if chunk.get("exit_code") != 0 or not piece:
                return {"patch": "", "changed_files": [], "error": "could not read the patch"}
            data += piece
        return {
            "patch": data.decode("utf-8", errors="replace"),
            "changed_files": [line.strip() for line in lines[1:] if line.strip()],
        }

    def grade(
        self,
        task: dict[str, Any],
        assistant_texts: list[str],
        tools: ToolSession | None = None,
        outcome: dict[str, Any] | None = None,
        *,
        job_id: str,
    ) -> Grade:
        """Grade `outcome["patch"]` in a fresh box labelled with `job_id` (see `evaluate`);
        the sandbox backend and directory are the settings', the time budget the task's
        `timeout` or the `tool_timeout` setting."""
        parsed = self._with_job_source(task, job_id)
        patch = str((outcome or {}).get("patch") or "")
        result = evaluate(
            parsed,
            patch,
            place=grading_place(self.settings),
            job_id=job_id,
            timeout=self._budget(parsed),
        )
        error = (outcome or {}).get("error")
        if error:
            result.details["outcome_error"] = error
        return result

    def _with_job_source(self, task: dict[str, Any], job_id: str) -> SweTask:
        parsed = checked_on_worker(read_task(task), self.settings)
        return job_source(
            parsed, job_id, self.settings.sandbox_dir.resolve(), timeout=self._budget(parsed)
        )

    def _budget(self, task: SweTask) -> float:
        return task.timeout if task.timeout is not None else self.settings.tool_timeout
