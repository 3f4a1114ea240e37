"""Schema fuzzing of the gateway: schemathesis reads `/openapi.json`, generates requests for
every operation (valid ones, invalid ones, and sequences that follow ids from one answer to the
next), sends them over real HTTP to the real app on a real Redis, and checks every answer with
all of its checks: no server error, a documented status and content type, a body matching the
documented schema, authentication enforced, invalid data refused.

No worker runs here: accepted submissions stay queued in Redis. `max_wait_seconds` is one
second, so `?wait=true` (and every other wait the fuzzer asks for) answers within a second.
Backend URLs the fuzzer registers name arbitrary hosts; the registration check's requests go
through a proxy address where nothing listens, so they fail at once and never leave this
machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from broker.processes import free_port
from core.settings import Settings
from tests.support.gateway import serve

ST = Path(sys.executable).with_name("st")
TOKEN = "fuzz-token"
EXAMPLES = 100
"""Cases per operation and phase; with a fixed seed the run is the same each time."""
SEED = 1
RUN_TIMEOUT = 240.0

# Expectations the schema cannot state (schemathesis.toml).
CONFIG = """
# DELETE of a job or batch cancels it: its record and trajectory stay readable afterwards.
[checks.use_after_free]
enabled = false

# /readyz answers 503 while no worker consumes the queues, as here (documented, by design).
[[operations]]
include-path = "/readyz"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503"]

# A weight update none of whose backends takes the weights answers 502 (documented): the
# fuzzer's backends name servers that do not answer.
[[operations]]
include-path = "/v1/backends/update_weights"
checks.not_a_server_error.expected-statuses = ["2xx", "4xx", "502"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "404", "409", "422", "502"]

# A schema-valid task can still be one its handler refuses (a task's fields other than
# `data_source` and `instance_id` belong to its handler: the schema leaves them free), and a
# schema-valid backend URL can name a server that does not answer: those are 422s.
[[operations]]
include-path-regex = "^/v1/(rollouts|batches|backends)$"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = [
    "2xx", "401", "404", "409", "413", "422", "429", "503",
]
"""

pytestmark = [
    pytest.mark.skipif(not ST.exists(), reason="schemathesis is not installed (dev extra)"),
    pytest.mark.full,
]


@pytest.fixture
def no_egress(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Outgoing HTTP of this process goes to a closed local port (loopback excepted)."""
    proxy = f"http://127.0.0.1:{free_port()}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, proxy)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    yield


def fuzz(base_url: str, work: Path, headers: dict[str, str]) -> dict[str, Any]:
    """Run schemathesis against the gateway at `base_url`; returns its JSON report."""
    config = work / "schemathesis.toml"
    config.write_text(CONFIG)
    report = work / "report.json"
    command = [
        str(ST),
        "--config-file",
        str(config),
        "run",
        f"{base_url}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        str(SEED),
        "--workers",
        "1",
        "--request-timeout",
        "20",
        "--generation-database",
        "none",
        "--report",
        "json",
        "--report-json-path",
        str(report),
        "--no-color",
    ]
    for name, value in headers.items():
        command += ["-H", f"{name}: {value}"]
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    run = subprocess.run(
        command, cwd=work, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    if not report.exists():
        pytest.fail(f"schemathesis wrote no report:\n{run.stdout[-5000:]}\n{run.stderr[-5000:]}")
    result: dict[str, Any] = json.loads(report.read_text())
    result["output"] = run.stdout
    return result


def test_fuzzing_finds_no_server_error_and_every_answer_matches_its_schema(
    redis_url: str, tmp_path: Path, no_egress: None
) -> None:
    """One run, on a gateway with a token: every case is sent with it, and schemathesis's
    `ignored_auth` check sends each operation again without it (a 401 is expected). The open
    gateway (no token) is what every other test of tests/api/ talks to."""
    settings = Settings(
        redis_url=redis_url,
        api_token=TOKEN,
        max_wait_seconds=1.0,
        max_body_bytes=1 << 20,
    )
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with serve(create_app(settings)) as url:
        registered = httpx.post(
            f"{url}/v1/backends?verify=false",
            json={"url": "http://127.0.0.1:9", "model": "m", "id": "b0"},
            headers=headers,
        )
        assert registered.status_code == 201, registered.text
        result = fuzz(url, tmp_path, headers)
    cases = result["test_cases"]
    print(
        f"schemathesis {result['schemathesis_version']}: {cases['generated']} cases in "
        f"{result['running_time']:.1f} s, {cases['unique_failures']} unique failures"
    )
    assert result["complete"], result["output"][-5000:]
    assert not result["errors"], result["output"][-5000:]
    assert cases["generated"] > 0
    assert cases["unique_failures"] == 0, result["output"][-20000:]
