"""The console's own defences, through a real gateway: the example files' placeholder token is
refused at startup, its cookies are Secure behind TLS, and no other site can frame it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from core.settings import Settings
from tests.support.gateway import serve

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "console-s3cret"


@pytest.fixture
def gateway(redis_url: str) -> Iterator[str]:
    with serve(create_app(Settings(redis_url=redis_url, api_token=TOKEN))) as url:
        yield url


@pytest.mark.parametrize(
    "fields",
    [
        {"api_token": "CHANGE-ME"},
        {"api_token": "change-me"},
        {"api_token": "s3cret", "tenant_tokens": "team:CHANGE-ME"},
    ],
)
def test_the_placeholder_token_is_refused_when_settings_load(fields: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="placeholder CHANGE-ME"):
        Settings(**fields)  # type: ignore[arg-type]


def test_a_gateway_configured_with_the_placeholder_exits_saying_why(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    env.update(ROLLSERVE_API_TOKEN="CHANGE-ME", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "gateway", "--port", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "CHANGE-ME" in done.stderr and "Traceback" not in done.stderr


def test_no_tenant_may_take_the_operators_name(redis_url: str) -> None:
    """`default` is the operator's tenant: a tenant token by that name would own its work."""
    with pytest.raises(ValueError, match="operator"):
        Settings(redis_url=redis_url, api_token=TOKEN, tenant_tokens="default:other-s3cret")


def cookies_of(answer: httpx.Response) -> dict[str, str]:
    """Each cookie the answer sets, by name, with its attributes."""
    found = {}
    for header in answer.headers.get_list("set-cookie"):
        found[header.split("=", 1)[0]] = header
    return found


def test_behind_tls_the_console_cookies_are_secure(gateway: str) -> None:
    with httpx.Client(base_url=gateway, timeout=30) as browser:
        form = browser.get("/ui/signin", headers={"X-Forwarded-Proto": "https"})
        assert "secure" in cookies_of(form)["rollserve_csrf"].lower()
        signed = browser.post(
            "/ui/signin",
            data={"token": TOKEN},
            headers={"X-Forwarded-Proto": "https"},
            follow_redirects=False,
        )
        assert signed.status_code == 303
        assert "secure" in cookies_of(signed)["rollserve_token"].lower()


def test_over_plain_http_the_cookies_still_work(gateway: str) -> None:
    with httpx.Client(base_url=gateway, timeout=30) as browser:
        signed = browser.post("/ui/signin", data={"token": TOKEN}, follow_redirects=False)
        assert "secure" not in cookies_of(signed)["rollserve_token"].lower()
        assert browser.get("/ui/batches").status_code == 200


@pytest.mark.parametrize("path", ["/ui/signin", "/ui/batches", "/healthz"])
def test_no_page_can_be_framed_by_another_site(gateway: str, path: str) -> None:
    answer = httpx.get(f"{gateway}{path}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200
    assert answer.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
