"""Bounded staleness (`agent.max_staleness`): a job whose turns come from a policy too far
behind the newest announced version is started again on the current policy, or dropped. The
stage functions run on a real Redis and backend pool; the backend is an in-memory client."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from broker.jobstore import JobSpec
from core.schemas import MAX_STALE_RERUNS, BackendSpec, JobStatus
from workers import stages
from workers.process_state import Runtime
from workers.routed_policy import StalePolicy, check_staleness

from .test_stage_functions import (
    AGENT,
    BACKEND_ID,
    MATH_TASK,
    POLICY_VERSION,
    SAMPLING,
    Say,
    assert_slot_free,
    rt,
    serve,
)

__all__ = ["rt"]  # the fixture, imported to be used here

ANSWER = Say("So \\boxed{4}.", [40])
"""A turn that ends a math episode with the right answer."""
HMM = Say("Hmm.", [11])
"""A turn without an answer: the handler asks again, and the episode goes on."""


def make_job(rt: Runtime, **agent: Any) -> str:
    spec = JobSpec(
        task=MATH_TASK,
        data_source="math",
        instance_id="two-plus-two",
        sampling=SAMPLING,
        agent={**AGENT, **agent},
        group_id="g-1",
    )
    rt.store.create_jobs([spec])
    return spec.job_id


def bump_at(rt: Runtime, calls: dict[int, int]) -> Any:
    """An `on_call` that announces new weights on the backend during the given calls."""

    async def on_call(n: int) -> None:
        if n in calls:
            rt.pool.resume(BACKEND_ID, policy_version=calls[n])

    return on_call


def model_versions(rt: Runtime, job_id: str) -> list[int | None]:
    return [t.policy_version for t in rt.store.trajectory(job_id).turns if t.type == "model"]


@pytest.mark.parametrize(
    ("versions", "current", "bound", "stale"),
    [
        ([5], 5, 0, False),
        ([5], 6, 0, True),
        ([5, 6], 6, 1, False),
        ([5, 7], 7, 1, True),
        ([None, 3], 9, 0, True),
        ([None], 9, 0, False),  # unversioned turns are never stale
        ([5], None, 0, False),  # nothing announced: nothing to be behind
        ([1], 100, None, False),  # no bound
    ],
)
def test_staleness_is_the_oldest_turn_against_the_current_version(
    versions: list[int | None], current: int | None, bound: int | None, stale: bool
) -> None:
    if stale:
        with pytest.raises(StalePolicy, match=r"agent\.max_staleness"):
            check_staleness("j", versions, current, bound)
    else:
        check_staleness("j", versions, current, bound)


def test_the_current_version_is_the_newest_a_registered_backend_holds(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert rt.pool.current_version() is None
    serve(rt, monkeypatch, [])
    assert rt.pool.current_version() == POLICY_VERSION
    big = 2**62 + 1  # exact, however large (Lua's numbers would round it)
    rt.pool.register(
        BackendSpec(url="http://127.0.0.1:10", model="fake", id="b2", policy_version=big)
    )
    assert rt.pool.current_version() == big
    rt.pool.drain("b2")  # a draining backend's weights still count
    assert rt.pool.current_version() == big
    rt.pool.remove("b2")
    assert rt.pool.current_version() == POLICY_VERSION
    # A new training run switches the fleet back to version 0: that is current now.
    rt.pool.resume(BACKEND_ID, policy_version=0)
    assert rt.pool.current_version() == 0


def test_a_stale_job_starts_its_episode_again_on_the_current_policy(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = make_job(rt, max_staleness=0)
    # The weights change during the first call: the second turn would follow a turn of the
    # old policy, so the episode starts again, all of it on the new one.
    fleet = serve(rt, monkeypatch, [HMM, ANSWER], bump_at(rt, {1: POLICY_VERSION + 1}))
    assert stages.init_stage(rt, job_id)
    assert stages.run_stage(rt, job_id)
    assert stages.eval_stage(rt, job_id) is False
    done = rt.store.trajectory(job_id)
    assert done.status is JobStatus.completed and done.reward == 1.0
    assert done.stale_reruns == 1
    assert model_versions(rt, job_id) == [POLICY_VERSION + 1]
    assert done.response_ids == [40]  # nothing of the stale start is left
    # The stale turn's successor was never requested: two calls in all.
    assert [r["prompt_ids"] for r in fleet.client.requests] == [[101, 102, 103]] * 2
    assert_slot_free(rt, job_id)


def test_within_the_bound_a_job_keeps_turns_of_both_versions(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = make_job(rt, max_staleness=1)
    serve(rt, monkeypatch, [HMM, ANSWER], bump_at(rt, {1: POLICY_VERSION + 1}))
    assert stages.init_stage(rt, job_id)
    assert stages.run_stage(rt, job_id)
    assert model_versions(rt, job_id) == [POLICY_VERSION, POLICY_VERSION + 1]
    assert rt.store.trajectory(job_id).stale_reruns == 0


def test_a_stale_job_is_dropped_when_the_trainer_says_so(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = make_job(rt, max_staleness=0, on_stale="drop")
    fleet = serve(rt, monkeypatch, [HMM, ANSWER], bump_at(rt, {1: POLICY_VERSION + 1}))
    assert stages.init_stage(rt, job_id)
    assert stages.run_stage(rt, job_id) is False
    failed = rt.store.trajectory(job_id)
    assert failed.status is JobStatus.failed
    assert failed.error is not None and failed.error.type == "stale_policy"
    assert f"policy version {POLICY_VERSION}" in failed.error.message
    assert len(fleet.client.requests) == 1
    assert_slot_free(rt, job_id)


def test_staleness_is_checked_again_when_the_episode_ends(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One turn, and the answer comes while the fleet moves two versions on: the finished
    # episode is already too old for a bound of one.
    job_id = make_job(rt, max_staleness=1)
    serve(rt, monkeypatch, [ANSWER, ANSWER], bump_at(rt, {1: POLICY_VERSION + 2}))
    assert stages.init_stage(rt, job_id)
    assert stages.run_stage(rt, job_id)
    done = rt.store.trajectory(job_id)
    assert done.stale_reruns == 1
    assert model_versions(rt, job_id) == [POLICY_VERSION + 2]


def test_a_job_that_keeps_going_stale_is_dropped_after_its_reruns(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = make_job(rt, max_staleness=0)
    starts = MAX_STALE_RERUNS + 1
    # Every start's only call sees the weights change under it.
    bumps = {n: POLICY_VERSION + n for n in range(1, starts + 1)}
    fleet = serve(rt, monkeypatch, [ANSWER] * starts, bump_at(rt, bumps))
    assert stages.init_stage(rt, job_id)
    assert stages.run_stage(rt, job_id) is False
    failed = rt.store.trajectory(job_id)
    assert failed.status is JobStatus.failed
    assert failed.error is not None and failed.error.type == "stale_policy"
    assert f"after {MAX_STALE_RERUNS} reruns" in failed.error.message
    assert len(fleet.client.requests) == starts
    assert_slot_free(rt, job_id)


def test_without_a_bound_versions_are_recorded_and_nothing_reruns(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = make_job(rt)
    serve(rt, monkeypatch, [HMM, ANSWER], bump_at(rt, {1: POLICY_VERSION + 5}))
    assert stages.init_stage(rt, job_id)
    assert stages.run_stage(rt, job_id)
    assert model_versions(rt, job_id) == [POLICY_VERSION, POLICY_VERSION + 5]


def tool_call(name: str, **arguments: Any) -> str:
    body = {"name": name, "arguments": arguments}
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_stale_sandboxed_job_starts_again_in_a_fresh_box(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = {"data_source": "shell", "instruction": "Leave a mark.", "check": "true"}
    spec = JobSpec(
        task=task,
        data_source="shell",
        instance_id="mark",
        sampling=SAMPLING,
        agent={**AGENT, "max_turns": 4, "max_staleness": 0},
        group_id="g-1",
    )
    rt.store.create_jobs([spec])
    job_id = spec.job_id
    script = [
        # The first start marks its box; the weights change during that call.
        Say(tool_call("bash", command="touch /workspace/mark && echo marked"), [50]),
        # The second start finds no mark: its box is a new one.
        Say(tool_call("bash", command="ls /workspace/mark || echo fresh-box"), [51]),
        Say(tool_call("finish"), [52]),
    ]
    serve(rt, monkeypatch, script, bump_at(rt, {1: POLICY_VERSION + 1}))
    assert stages.init_stage(rt, job_id)
    first_box = rt.store.get(job_id).sandbox
    assert first_box is not None
    assert stages.run_stage(rt, job_id)
    done = rt.store.trajectory(job_id)
    assert done.stale_reruns == 1
    observations = [t.text for t in done.turns if t.type == "env"]
    assert any("fresh-box" in text for text in observations), observations
    assert not any("marked" in text for text in observations)
    second_box = rt.store.get(job_id).sandbox
    assert second_box is not None and second_box["socket_path"] != first_box["socket_path"]
    assert not Path(first_box["socket_path"]).exists()  # the stale start's box is gone
    assert_slot_free(rt, job_id)
    # EVAL grades in the second box, and stops it.
    assert stages.eval_stage(rt, job_id) is False
    assert rt.store.trajectory(job_id).status is JobStatus.completed
    assert not Path(second_box["socket_path"]).exists()
