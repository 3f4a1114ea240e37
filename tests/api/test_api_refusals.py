"""Input that used to be accepted and fail later, or to make the gateway answer 500, is refused
at submission with a 4xx naming the field, and leaves Redis as it was (nothing enqueued)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import redis

from api.app import create_app
from broker.jobstore import JobStore
from core.schemas import MAX_SEED, MAX_TASK_DEPTH, MAX_TOKENS
from core.settings import Settings
from tests.support.gateway import GOOD_TASK, field_locs, snapshot

SHELL = {"data_source": "shell", "instruction": "make x", "check": "test -f /workspace/x"}
CODE = {"data_source": "code", "problem": "Echo.", "tests": [{"input": "1", "output": "1"}]}
SWE = {
    "data_source": "swe",
    "instance_id": "o__r-1",
    "repo": "o/r",
    "base_commit": "a" * 40,
    "problem_statement": "It breaks.",
    "test_patch": "",
    "FAIL_TO_PASS": ["tests/test_x.py::test_x"],
    "PASS_TO_PASS": [],
    "environment": {"image": "docker://example/swe:latest"},
}


def strict_json(answer: httpx.Response) -> Any:
    """The body, read as strict JSON (no NaN, no Infinity) from valid UTF-8."""

    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in {answer.text!r}")

    return json.loads(answer.content.decode("utf-8"), parse_constant=refuse)


def refused(
    http: httpx.Client, r: redis.Redis, path: str, raw: str, loc: str, status: int = 422
) -> dict[str, Any]:
    """POST the raw JSON text `raw`; assert `status`, an error naming `loc`, no Redis change."""
    before = snapshot(r)
    answer = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    body = strict_json(answer)
    assert loc in field_locs(answer), body
    assert snapshot(r) == before
    item: dict[str, Any] = next(i for i in body["detail"] if ".".join(map(str, i["loc"])) == loc)
    return item


def rollout(task: dict[str, Any] | None = None, **fields: Any) -> str:
    return json.dumps({"task": task or GOOD_TASK, **fields})


NON_FINITE = [
    ('{"temperature": NaN}', "body.sampling.temperature"),
    ('{"temperature": Infinity}', "body.sampling.temperature"),
    ('{"temperature": -Infinity}', "body.sampling.temperature"),
    ('{"temperature": 1e309}', "body.sampling.temperature"),
    ('{"top_p": NaN}', "body.sampling.top_p"),
]


@pytest.mark.parametrize(("sampling", "loc"), NON_FINITE, ids=[s for s, _ in NON_FINITE])
def test_non_finite_sampling_is_a_clean_422(
    http: httpx.Client, redis_client: redis.Redis, sampling: str, loc: str
) -> None:
    raw = f'{{"task": {json.dumps(GOOD_TASK)}, "sampling": {sampling}}}'
    item = refused(http, redis_client, "/v1/rollouts", raw, loc)
    assert item["type"] == "finite_number"
    assert item["input"] in ("nan", "inf", "-inf")


@pytest.fixture(autouse=True)
def backend_for_http(request: pytest.FixtureRequest) -> None:
    """Every test that talks to the gateway here has a backend registered."""
    if "http" in request.fixturenames:
        request.getfixturevalue("with_backend")


def test_non_finite_number_inside_a_task_is_refused_naming_its_path(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    raw = '{"task": {"data_source": "math", "problem": "p", "answer": "4", "meta": [1, NaN]}}'
    refused(http, redis_client, "/v1/rollouts", raw, "body.task.meta.1")
    bad = '{"data_source": "math", "problem": "p", "answer": Infinity}'
    raw = f'{{"tasks": [{json.dumps(GOOD_TASK)}, {bad}]}}'
    refused(http, redis_client, "/v1/batches", raw, "body.tasks.1.answer")


SURROGATES = [
    ("problem", rollout({**GOOD_TASK, "problem": "\ud800"}), "body.task.problem"),
    (
        "nested",
        rollout({**GOOD_TASK, "meta": {"notes": ["fine", "a\udfffb"]}}),
        "body.task.meta.notes.1",
    ),
    ("instance_id", rollout({**GOOD_TASK, "instance_id": "x\ud800"}), "body.task.instance_id"),
    ("key", rollout({**GOOD_TASK, "meta": {"\ud800": 1}}), "body.task.meta.\\ud800"),
    ("stop", rollout(sampling={"stop": ["ok", "\ud83d"]}), "body.sampling.stop.1"),
    (
        "shell files",
        rollout({**SHELL, "files": {"/workspace/a": "\ud800"}}),
        "body.task.files./workspace/a",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("case", "raw", "loc"), SURROGATES, ids=[c for c, _, _ in SURROGATES])
def test_lone_surrogate_is_refused_naming_the_field(
    http: httpx.Client, redis_client: redis.Redis, case: str, raw: str, loc: str
) -> None:
    # json.dumps writes a lone surrogate as the escape `\ud800`, which JSON allows
    assert "\\ud8" in raw or "\\udf" in raw
    item = refused(http, redis_client, "/v1/rollouts", raw, loc)
    assert "surrogate" in item["msg"]


def test_lone_surrogate_in_a_key_or_echoed_value_still_answers_strict_json(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    key = rollout({**GOOD_TASK, "\ud800": 1})
    item = refused(http, redis_client, "/v1/rollouts", key, "body.task")
    assert item["input"] == "\\ud800"  # the key, escaped
    echoed = f'{{"task": {json.dumps(GOOD_TASK)}, "sampling": {{"temperature": "\\ud800"}}}}'
    refused(http, redis_client, "/v1/rollouts", echoed, "body.sampling.temperature")
    batch = json.dumps({"tasks": [GOOD_TASK, {**GOOD_TASK, "question": "\udc00"}]})
    refused(http, redis_client, "/v1/batches", batch, "body.tasks.1.question")


def test_task_nested_too_deep_is_refused(http: httpx.Client, redis_client: redis.Redis) -> None:
    deep: Any = "x"
    for _ in range(MAX_TASK_DEPTH + 5):
        deep = [deep]
    loc = ".".join(["body", "task", "deep", *["0"] * (MAX_TASK_DEPTH - 1)])
    item = refused(http, redis_client, "/v1/rollouts", rollout({**GOOD_TASK, "deep": deep}), loc)
    assert f"deeper than {MAX_TASK_DEPTH}" in item["msg"]


BAD_NUMBERS = [
    ("seed past 64 bits", {"seed": 2**70}, "body.sampling.seed"),
    ("seed 2**63", {"seed": MAX_SEED + 1}, "body.sampling.seed"),
    ("negative seed", {"seed": -1}, "body.sampling.seed"),
    ("max_tokens 10**9", {"max_tokens": 10**9}, "body.sampling.max_tokens"),
    ("max_tokens as text", {"max_tokens": "64"}, "body.sampling.max_tokens"),
    ("temperature as text", {"temperature": "0.5"}, "body.sampling.temperature"),
]


@pytest.mark.parametrize(("case", "sampling", "loc"), BAD_NUMBERS, ids=[c[0] for c in BAD_NUMBERS])
def test_out_of_range_sampling_is_refused(
    http: httpx.Client, redis_client: redis.Redis, case: str, sampling: Any, loc: str
) -> None:
    refused(http, redis_client, "/v1/rollouts", rollout(sampling=sampling), loc)


def test_token_budgets_are_bounded(http: httpx.Client, redis_client: redis.Redis) -> None:
    agent = {"max_total_tokens": 10**9}
    refused(http, redis_client, "/v1/rollouts", rollout(agent=agent), "body.agent.max_total_tokens")
    fine = http.post(
        "/v1/rollouts", json={"task": GOOD_TASK, "agent": {"max_total_tokens": MAX_TOKENS}}
    )
    assert fine.status_code == 202, fine.text


def test_the_time_budget_is_positive_and_bounded(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    for bad in (0, -1, "60"):
        agent = {"max_seconds": bad}
        refused(http, redis_client, "/v1/rollouts", rollout(agent=agent), "body.agent.max_seconds")
    over = {"max_seconds": 86400 * 2}
    refused(http, redis_client, "/v1/rollouts", rollout(agent=over), "body.agent.max_seconds")
    fine = http.post("/v1/rollouts", json={"task": GOOD_TASK, "agent": {"max_seconds": 90}})
    assert fine.status_code == 202, fine.text


def test_the_staleness_bound_is_checked_and_resolved(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    for bad in (-1, 1.5, "1"):
        agent = {"max_staleness": bad}
        refused(
            http, redis_client, "/v1/rollouts", rollout(agent=agent), "body.agent.max_staleness"
        )
    agent = {"max_staleness": 1, "on_stale": "keep"}
    refused(http, redis_client, "/v1/rollouts", rollout(agent=agent), "body.agent.on_stale")
    fine = http.post("/v1/rollouts", json={"task": GOOD_TASK, "agent": {"max_staleness": 0}})
    assert fine.status_code == 202, fine.text
    agent = JobStore(redis_client).get(fine.json()["job_id"]).agent
    assert (agent["max_staleness"], agent["on_stale"]) == (0, "rerun")


def test_every_samples_seed_must_fit_in_64_bits(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    # one job: the largest seed is fine
    alone = http.post("/v1/rollouts", json={"task": GOOD_TASK, "sampling": {"seed": MAX_SEED}})
    assert alone.status_code == 202, alone.text
    # a group of 4 uses seed .. seed + 3
    batch = {"tasks": [GOOD_TASK], "group_size": 4, "sampling": {"seed": MAX_SEED - 2}}
    item = refused(http, redis_client, "/v1/batches", json.dumps(batch), "body.sampling.seed")
    assert "seed + 3" in item["msg"]
    assert http.post("/v1/batches", json={**batch, "sampling": {"seed": MAX_SEED - 3}}).is_success
    # dynamic sampling: attempt a of a task samples with seed + a*group_size + i
    dynamic = {
        "tasks": [GOOD_TASK, GOOD_TASK],
        "group_size": 2,
        "sampling": {"seed": MAX_SEED - 4},
        "dynamic_sampling": {"target_groups": 1, "max_attempts_per_task": 3},
    }
    item = refused(http, redis_client, "/v1/batches", json.dumps(dynamic), "body.sampling.seed")
    assert "seed + 5" in item["msg"]
    dynamic["sampling"] = {"seed": MAX_SEED - 5}
    assert http.post("/v1/batches", json=dynamic).status_code == 202


def test_types_are_checked_as_the_schema_says(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    batch = json.dumps({"tasks": [GOOD_TASK], "group_size": True})
    refused(http, redis_client, "/v1/batches", batch, "body.group_size")
    dynamic = json.dumps(
        {"tasks": [GOOD_TASK], "group_size": 2, "dynamic_sampling": {"target_groups": "1"}}
    )
    refused(http, redis_client, "/v1/batches", dynamic, "body.dynamic_sampling.target_groups")


HANDLER_FIELDS = [
    ("shell timeout text", {**SHELL, "timeout": "x"}, "body.task.timeout"),
    ("shell timeout zero", {**SHELL, "timeout": 0}, "body.task.timeout"),
    ("shell timeout huge", {**SHELL, "timeout": 10**400}, "body.task.timeout"),
    ("shell timeout bool", {**SHELL, "timeout": True}, "body.task.timeout"),
    ("shell file escapes", {**SHELL, "files": {"/workspace/../etc/x": "y"}}, "body.task.files"),
    ("shell file is workspace", {**SHELL, "files": {"/workspace/.": "y"}}, "body.task.files"),
    ("shell file twice", {**SHELL, "files": {"/workspace/a": "1", "/workspace/./a": "2"}},
     "body.task.files"),
    ("shell file under file", {**SHELL, "files": {"/workspace/a": "1", "/workspace/a/b": "2"}},
     "body.task.files"),
    ("shell file not text", {**SHELL, "files": {"/workspace/a": 1}}, "body.task.files"),
    ("shell network", {**SHELL, "network": "yes"}, "body.task.network"),
    ("code time_limit huge", {**CODE, "time_limit": 10**400}, "body.task.time_limit"),
    ("code time_limit nanos", {**CODE, "time_limit": {"seconds": 1, "nanos": 10**400}},
     "body.task.time_limit.nanos"),
    ("code memory huge", {**CODE, "memory_limit_bytes": 10**400}, "body.task.memory_limit_bytes"),
    ("code tests nested", {**CODE, "tests": "[" * 5000 + "]" * 5000}, "body.task.tests"),
    ("code tests surrogate", {**CODE, "tests": '[{"input": "\\ud800", "output": "1"}]'},
     "body.task.tests"),
    ("swe timeout huge", {**SWE, "timeout": 10**400}, "body.task.timeout"),
    ("swe log_parser", {**SWE, "log_parser": "parse_log_nothing"}, "body.task.log_parser"),
    ("swe image relative", {**SWE, "environment": {"image": "swe.sif"}},
     "body.task.environment.image"),
    ("swe image instance", {**SWE, "environment": {"image": "instance://box"}},
     "body.task.environment.image"),
    ("swe tests nested", {**SWE, "FAIL_TO_PASS": "[" * 5000 + "]" * 5000},
     "body.task.FAIL_TO_PASS"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "task", "loc"), HANDLER_FIELDS, ids=[c[0] for c in HANDLER_FIELDS]
)
def test_handler_refuses_at_submission_what_would_fail_later(
    http: httpx.Client, redis_client: redis.Redis, case: str, task: dict[str, Any], loc: str
) -> None:
    refused(http, redis_client, "/v1/rollouts", rollout(task), loc)


def test_tasks_the_handlers_accept_are_queued(http: httpx.Client) -> None:
    shell = {**SHELL, "files": {"/workspace/sub/../x": "1"}, "timeout": 5}
    for task in (shell, CODE, SWE):
        answer = http.post("/v1/rollouts", json={"task": task})
        assert answer.status_code == 202, answer.text


MALFORMED_IDS = [
    "/v1/batches/{b}:jobs",
    "/v1/batches/{b}:done",
    "/v1/batches/{b}:jobs/results",
    "/v1/batches/{b}:spec",
    "/v1/rollouts/{b}:jobs",
    "/v1/rollouts/{j}:x",
    "/v1/batches/x",
]


def test_ids_of_no_possible_job_or_batch_are_404_before_reaching_a_key(
    http: httpx.Client, redis_client: redis.Redis
) -> None:
    accepted = http.post("/v1/batches", json={"tasks": [GOOD_TASK], "group_size": 2}).json()
    batch_id, job_id = accepted["batch_id"], accepted["jobs"][0]
    before = snapshot(redis_client)
    for template in MALFORMED_IDS:
        path = template.format(b=batch_id, j=job_id)
        bad_id = path.removesuffix("/results").rsplit("/", 1)[1]
        for method in ("GET", "DELETE"):
            if path.endswith("/results") and method == "DELETE":
                continue
            answer = http.request(method, path)
            assert answer.status_code == 404, (method, path, answer.text)
            assert bad_id in answer.json()["detail"]
    assert snapshot(redis_client) == before
    # well-formed ids still work
    assert http.get(f"/v1/batches/{batch_id}").status_code == 200
    assert http.get(f"/v1/rollouts/{job_id}").status_code == 200
    assert http.get(f"/v1/rollouts/{batch_id}-1-0").status_code == 404


def test_openapi_documents_every_error_status(redis_url: str) -> None:
    for token in (None, "t0ken"):
        app = create_app(Settings(redis_url=redis_url, api_token=token))
        schema = app.openapi()
        assert "ErrorBody" in schema["components"]["schemas"]
        for path, operations in schema["paths"].items():
            for method, operation in operations.items():
                codes = set(operation["responses"])
                where = f"{method.upper()} {path}"
                if "{" in path:
                    assert "404" in codes, where
                if "requestBody" in operation:
                    assert {"400", "413", "422"} <= codes, where
                if path.startswith("/v1/"):
                    assert "503" in codes, where
                    assert ("401" in codes) == (token is not None), where
                for code, response in operation["responses"].items():
                    if code.startswith(("4", "5")) and path.startswith("/v1/"):
                        ref = response["content"]["application/json"]["schema"]["$ref"]
                        assert ref.endswith("/ErrorBody"), (where, code)
        submit = schema["paths"]["/v1/rollouts"]["post"]["responses"]
        assert {"429", "503"} <= set(submit)
        assert "GetRollout" in submit["202"]["links"]
        secured = "securitySchemes" in schema.get("components", {})
        assert secured == (token is not None)


BACKEND_FIELDS = [
    ("policy version past 64 bits", "/v1/backends?verify=false",
     '{"url": "http://127.0.0.1:9", "model": "m", "policy_version": 100000000000000000000000}',
     "body.policy_version"),
    ("negative policy version on resume", "/v1/backends/resume",
     '{"policy_version": -1}', "body.policy_version"),
    ("model with a lone surrogate", "/v1/backends?verify=false",
     '{"url": "http://127.0.0.1:9", "model": "\\ud800"}', "body.model"),
    ("data_source past 256 characters", "/v1/rollouts",
     json.dumps({"task": {**GOOD_TASK, "data_source": "m" * 300}}), "body.task.data_source"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "path", "raw", "loc"), BACKEND_FIELDS, ids=[c[0] for c in BACKEND_FIELDS]
)
def test_backend_records_and_names_are_bounded(
    http: httpx.Client, redis_client: redis.Redis, case: str, path: str, raw: str, loc: str
) -> None:
    refused(http, redis_client, path, raw, loc)
