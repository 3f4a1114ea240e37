"""Hostile agents through the whole pipeline: a real stack (gateway, Redis, Celery workers,
development server with scripted replies), real bubblewrap boxes, shell tasks graded by a
check. Each attack is what a policy under RL could find; each test asserts that the reward is
not forged, that what the attack aimed at is untouched, and that the host is left clean (no
process of the job, no sandbox state of it)."""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient, RolloutServiceError
from core.schemas import JobStatus, Trajectory
from deploy.stack import Stack
from tests.support.procs import processes_mentioning
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="bubblewrap is not installed (apt-get install bubblewrap)",
    ),
    pytest.mark.full,
]

# A file on the host, world-readable, that no box may read or change.
HOST_SECRET = Path(f"/tmp/rollserve-escape-{uuid.uuid4().hex}")
SECRET_TEXT = f"host-secret-{uuid.uuid4().hex}"
# The project's own checkout (results, logs, settings): not in a box's root at all.
PROJECT_README = Path(__file__).resolve().parents[2] / "README.md"


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def bash(command: str) -> str:
    return call("bash", command=command)


FINISH = call("finish")

# Each attack: a marker the scripted server matches in the instruction, and the agent's turns.
ATTACKS: dict[str, list[str]] = {
    # Grading in the agent's own shell: functions, aliases and startup files that make any
    # check pass, plus a changed cwd and PATH.
    "SHADOW-CHECK": [
        bash(
            "test() { return 0; }; export -f test; alias test=true; shopt -s expand_aliases; "
            "printf 'test() { return 0; }\\n' > /workspace/.evil.sh; "
            "export BASH_ENV=/workspace/.evil.sh ENV=/workspace/.evil.sh; "
            "export PROMPT_COMMAND='test() { return 0; }'; "
            "cp /workspace/.evil.sh /workspace/.bashrc; "
            "mkdir -p /workspace/bin && ln -sf /bin/true /workspace/bin/test; "
            "export PATH=/workspace/bin:$PATH; cd /tmp; echo armed"
        ),
        FINISH,
    ],
    # A process left behind that writes the answer once the agent's session is gone.
    "WATCHER": [
        bash(
            "server=$PPID; "  # the tool server runs the agent's shell
            'setsid nohup sh -c "while [ -d /proc/$server ]; do sleep 0.05; done; '
            'touch /workspace/done" >/dev/null 2>&1 & '
            "setsid nohup sh -c 'sleep 4; touch /workspace/done' >/dev/null 2>&1 & "
            "echo watching $(cat /proc/$server/cmdline | tr '\\0' ' ')"
        ),
        FINISH,
    ],
    # A process left behind that waits for the check to start, then makes it pass.
    "SPY": [
        bash(
            'setsid nohup sh -c \'until pgrep -f "sleep [1].5" >/dev/null; do sleep 0.02; done; '
            "touch /workspace/done' >/dev/null 2>&1 & echo spying"
        ),
        FINISH,
    ],
    # Box-wide limits: two processes that each fit the memory limit but not together, a
    # disk filled past its size, a workspace filled past its inode count, a huge workspace.
    "HOG": [
        bash(
            "for i in 1 2; do python3 -c \"a = b'x' * (160 << 20); import time; "
            "time.sleep(2); print('survived', len(a) >> 20)\" & done; wait; echo hog-over"
        ),
        FINISH,
    ],
    "FILL": [
        bash(
            "head -c 40M /dev/zero > /workspace/a; head -c 40M /dev/zero > /tmp/b; "
            "echo fill-rc=$?; head -c 40M /dev/zero > /dev/shm/c; echo shm-rc=$?"
        ),
        FINISH,
    ],
    "INODES": [
        bash(
            "mkdir /workspace/many && cd /workspace/many && for i in $(seq 3000); do "
            ": > f$i || { echo stopped-at $i; break; }; done 2>&1 | tail -n 2"
        ),
        FINISH,
    ],
    "HUGE-WORKSPACE": [
        bash(
            "mkdir /workspace/tree && cd /workspace/tree && "
            "python3 -c \"[open(str(i), 'w').close() for i in range(100000)]\" && "
            "ls | wc -l"
        ),
        FINISH,
    ],
    # The agent kills its own tool server before finishing.
    "KILL-SERVER": [bash("touch /workspace/partial; kill -9 -1; kill -9 1"), FINISH],
    # Writes outside the workspace and reads of host secrets.
    "OUTSIDE": [
        bash(
            f"echo pwned >> {HOST_SECRET}; touch /etc/rollserve-pwned; "
            f"cat {HOST_SECRET} /etc/shadow /root/.bash_history {PROJECT_README} 2>&1; "
            "ls /srv /opt /var/log /home 2>&1 | head -n 20; "
            "ls /root /home 2>&1; echo done-trying"
        ),
        FINISH,
    ],
    # A fork bomb and a flood of output.
    "BOMB": [bash(":(){ :|:& };: ; sleep 1; echo survived"), FINISH],
    "FLOOD": [bash("head -c 50000000 /dev/zero | tr '\\0' x"), FINISH],
}

SCRIPT = [{"match": marker, "samples": [turns]} for marker, turns in ATTACKS.items()]


def shell_task(marker: str, check: str, **extra: object) -> dict[str, object]:
    return {
        "data_source": "shell",
        "instance_id": marker.lower(),
        "instruction": f"{marker}: do the task.",
        "check": check,
        **extra,
    }


def stack_settings(request: pytest.FixtureRequest, data: Path) -> dict[str, Any]:
    return {
        "script": SCRIPT, "tool_timeout": 5.0, "reap_interval": 1.0,
        "sandbox_dir": data / "sandboxes", "sandbox_backend": "bwrap",
    }  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def host_secret() -> Any:
    HOST_SECRET.write_text(SECRET_TEXT)
    HOST_SECRET.chmod(0o666)
    yield HOST_SECRET
    HOST_SECRET.unlink(missing_ok=True)


def run(client: RolloutClient, task: dict[str, object], **agent: int) -> Trajectory:
    traj = client.submit_rollout(
        task, sampling={"seed": 0, "max_tokens": 256}, agent=agent or None, wait=True, timeout=120
    )
    assert isinstance(traj, Trajectory), traj
    return traj


def host_is_clean(stack: Stack, job_id: str) -> bool:
    """No process mentions the job and no sandbox state (or keeper log) names it."""
    root = stack.settings.sandbox_dir
    return (
        processes_mentioning(job_id) == []
        and not any(job_id in m.read_text(errors="ignore") for m in root.glob("**/meta.json"))
        and not any(job_id in p.name for p in root.iterdir())
    )


def assert_clean(stack: Stack, traj: Trajectory) -> None:
    wait_until(lambda: host_is_clean(stack, traj.job_id), 30, "the job's sandbox to be gone")


def observations(traj: Trajectory) -> str:
    return "\n".join(t.text for t in traj.turns if t.type == "env")


def test_the_check_runs_in_a_fresh_shell_not_the_agents(
    client: RolloutClient, stack: Stack
) -> None:
    traj = run(client, shell_task("SHADOW-CHECK", "test -f /workspace/done"))
    assert "armed" in observations(traj)
    assert traj.status is JobStatus.completed, traj.error
    assert traj.reward == 0.0, traj.eval
    assert traj.eval["exit_code"] == 1
    assert_clean(stack, traj)


def test_the_check_sees_a_clean_environment_and_the_workspace_as_cwd(
    client: RolloutClient, stack: Stack
) -> None:
    check = (
        'test "$(pwd)" = /workspace && test -z "$BASH_ENV$ENV$PROMPT_COMMAND" && '
        'test "$(type -t test)" = builtin && ! alias test 2>/dev/null && '
        'case ":$PATH:" in *:/workspace/*) exit 1;; esac'
    )
    traj = run(client, shell_task("SHADOW-CHECK", check))
    assert traj.status is JobStatus.completed, traj.error
    assert traj.reward == 1.0, traj.eval


def test_nothing_the_agent_left_running_survives_its_turns(
    client: RolloutClient, stack: Stack
) -> None:
    traj = run(client, shell_task("WATCHER", "! test -e /workspace/done"))
    assert traj.status is JobStatus.completed, traj.error
    assert traj.reward == 1.0, traj.eval
    assert_clean(stack, traj)


def test_nothing_the_agent_left_running_sees_or_races_the_check(
    client: RolloutClient, stack: Stack
) -> None:
    traj = run(client, shell_task("SPY", "sleep 1.5; test -f /workspace/done"))
    assert "spying" in observations(traj)
    assert traj.status is JobStatus.completed, traj.error
    assert traj.reward == 0.0, traj.eval
    assert_clean(stack, traj)


def test_an_agent_that_kills_its_tool_server_gets_no_reward(
    client: RolloutClient, stack: Stack
) -> None:
    traj = run(client, shell_task("KILL-SERVER", "test -f /workspace/done"))
    assert traj.reward != 1.0, traj.eval
    if traj.status is not JobStatus.completed:
        assert traj.error is not None and traj.error.type != "security", traj.error
    assert_clean(stack, traj)


def test_writes_outside_the_workspace_and_host_secrets_are_out_of_reach(
    client: RolloutClient, stack: Stack
) -> None:
    traj = run(client, shell_task("OUTSIDE", "true"))
    seen = observations(traj)
    assert "done-trying" in seen
    assert SECRET_TEXT not in seen
    readme_line = next(x for x in PROJECT_README.read_text().splitlines() if len(x) > 40)
    assert readme_line not in seen
    assert f"{PROJECT_README}: No such file or directory" in seen
    assert HOST_SECRET.read_text() == SECRET_TEXT
    assert not Path("/etc/rollserve-pwned").exists()
    assert not re.search(r"root:[^:\n]*:\d+:", seen)  # /etc/shadow's first line
    assert_clean(stack, traj)


def test_a_fork_bomb_is_contained(client: RolloutClient, stack: Stack) -> None:
    traj = run(client, shell_task("BOMB", "true"))
    assert traj.status is JobStatus.completed, traj.error
    # What the shell says depends on which limit the bomb meets first (bash's fork retries,
    # the tool timeout), and a long run of "fork: retry" lines can fill the tiny model's
    # context (the observation is then not appended); what matters is that the tool call
    # comes back, the job ends normally and takes every process along.
    assert traj.stop_reason in ("finish", "context_length", "token_budget"), traj.stop_reason
    assert_clean(stack, traj)  # every process of the bomb is gone with the box


def test_a_flood_of_output_is_cut(client: RolloutClient, stack: Stack) -> None:
    traj = run(client, shell_task("FLOOD", "true"))
    assert traj.status is JobStatus.completed, traj.error
    # Cut at the tool server, then (here) over the job's token budget: either way the
    # trajectory stays small.
    assert len(traj.model_dump_json()) < 2_000_000
    assert traj.stop_reason == "token_budget" or 0 < len(observations(traj)) < 1_000_000
    assert_clean(stack, traj)


def hits(traj: Trajectory) -> set[str]:
    """The box-wide limits the trajectory says the sandbox ran into."""
    return {hit.limit for hit in traj.limits}


def limited(marker: str, check: str = "true", **limits: int) -> dict[str, object]:
    return shell_task(marker, check, sandbox={"limits": limits})


def test_memory_is_limited_for_the_box_as_a_whole(client: RolloutClient, stack: Stack) -> None:
    traj = run(client, limited("HOG", memory_mb=256, disk_mb=64))
    seen = observations(traj)
    assert traj.status is JobStatus.completed, traj.error
    assert "hog-over" in seen
    # Each process fits the box; both together do not: at most one lives to print.
    assert re.findall(r"^survived 160$", seen, re.M) in ([], ["survived 160"]), seen
    assert "Killed" in seen, seen
    assert "memory" in hits(traj), traj.limits  # the trajectory says a limit stopped it
    assert_clean(stack, traj)


def test_disk_is_limited_across_workspace_tmp_and_shm(client: RolloutClient, stack: Stack) -> None:
    traj = run(client, limited("FILL", disk_mb=64))
    seen = observations(traj)
    assert traj.status is JobStatus.completed, traj.error
    assert "No space left on device" in seen, seen
    assert "fill-rc=1" in seen and "shm-rc=1" in seen, seen
    assert "disk" in hits(traj), traj.limits
    assert_clean(stack, traj)


def test_files_are_limited_by_count(client: RolloutClient, stack: Stack) -> None:
    traj = run(client, limited("INODES", inodes=1000))
    seen = observations(traj)
    assert traj.status is JobStatus.completed, traj.error
    assert "stopped-at" in seen, seen
    assert "No space left on device" in seen, seen
    assert "inodes" in hits(traj), traj.limits
    assert_clean(stack, traj)


def test_a_huge_workspace_goes_with_its_box(client: RolloutClient, stack: Stack) -> None:
    traj = run(client, shell_task("HUGE-WORKSPACE", "test -d /workspace/tree"))
    assert "100000" in observations(traj)
    assert traj.status is JobStatus.completed, traj.error
    assert traj.reward == 1.0, traj.eval
    assert_clean(stack, traj)


def test_over_the_limits_is_refused_at_submission(client: RolloutClient) -> None:
    with pytest.raises(RolloutServiceError, match=r"sandbox\.limits\.memory_mb") as refused:
        client.submit_rollout(limited("HOG", memory_mb=10**9))
    assert refused.value.status_code == 422
