"""The console in headless Chromium against a whole stack (embedded Redis, development
server with the tiny model, prefork workers, gateway): every page loads without a browser
console error, the batch is listed, the viewer marks as many generated tokens as the loss
mask has ones, and the cancel button cancels a running batch.

Screenshots go to the test's temporary directory (its path is printed) and, with
`ROLLSERVE_UI_SCREENSHOTS=<dir>`, there too."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.client import RolloutClient
from deploy.stack import Stack
from tests.support.stack import ROOMY_LIMITS, start_stack

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.browser


def _missing() -> str | None:
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        return "needs Debian's chromium and chromium-driver (`make system-deps`)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium (the `dev` extra)"
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless Chromium through the system chromedriver (Selenium downloads nothing)."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path_factory.mktemp("chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1000",
        f"--user-data-dir={profile}",
        "--no-first-run",
        "--disable-background-networking",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(profile / "driver.log"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SE_OFFLINE", "true")  # Selenium Manager: never download a driver
        driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def stack(
    browser: Any, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("stack")
    running = start_stack(data, tiny_model_dir, **ROOMY_LIMITS)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("screenshots")
    print(f"console screenshots: {where}")
    return where


def screenshot(driver: Any, shots: Path, name: str) -> None:
    path = shots / f"{name}.png"
    driver.save_screenshot(str(path))
    extra = os.environ.get("ROLLSERVE_UI_SCREENSHOTS")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(extra) / path.name)


def console_errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def wait_until(check: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def math_tasks(n: int) -> list[dict[str, Any]]:
    lines = (REPO / "examples" / "math_tasks.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()][:n]


@pytest.fixture(scope="module")
def demo_batch(stack: Stack) -> tuple[str, list[str]]:
    """A small finished batch: 3 tasks x 2 samples."""
    with RolloutClient(stack.gateway_url, timeout=120) as client:
        accepted = client.submit_batch(
            math_tasks(3), group_size=2, sampling={"max_tokens": 24}, agent={"max_turns": 2}
        )
        wait_until(lambda: client.batch_progress(accepted.batch_id).done, 240, "the demo batch")
    return accepted.batch_id, accepted.jobs


def open_page(driver: Any, url: str) -> None:
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(url)
    wait_until(
        lambda: driver.execute_script("return document.readyState") == "complete",
        30,
        f"{url} to load",
    )
    time.sleep(0.5)  # htmx's first requests (on load, on reveal)


def test_batches_page_lists_the_batch(
    browser: Any, stack: Stack, demo_batch: tuple[str, list[str]], shots: Path
) -> None:
    from selenium.webdriver.common.by import By

    batch_id, _ = demo_batch
    open_page(browser, f"{stack.gateway_url}/ui/batches")
    links = browser.find_elements(By.CSS_SELECTOR, f'a[href="/ui/batches/{batch_id}"]')
    assert links, browser.page_source[:2000]
    screenshot(browser, shots, "batches")
    assert console_errors(browser) == []


def test_batch_page_shows_its_jobs(
    browser: Any, stack: Stack, demo_batch: tuple[str, list[str]], shots: Path
) -> None:
    from selenium.webdriver.common.by import By

    batch_id, jobs = demo_batch
    open_page(browser, f"{stack.gateway_url}/ui/batches/{batch_id}")
    assert browser.find_element(By.ID, "finished").text == str(len(jobs))
    assert browser.find_elements(By.ID, "histogram")
    rows = browser.find_elements(By.CSS_SELECTOR, "#job-table a")
    assert sorted(r.text for r in rows) == sorted(jobs)
    screenshot(browser, shots, "batch")
    assert console_errors(browser) == []


def test_viewer_marks_as_many_generated_tokens_as_the_loss_mask_has_ones(
    browser: Any, stack: Stack, demo_batch: tuple[str, list[str]], shots: Path
) -> None:
    from selenium.webdriver.common.by import By

    _, jobs = demo_batch
    with RolloutClient(stack.gateway_url, timeout=60) as client:
        trajectory = client._request("GET", f"/v1/rollouts/{jobs[0]}").json()
    ones = sum(trajectory["loss_mask"])
    assert ones > 0
    open_page(browser, f"{stack.gateway_url}/ui/rollouts/{jobs[0]}")
    screenshot(browser, shots, "rollout")
    tokens = browser.find_element(By.ID, "tokens")
    browser.execute_script("arguments[0].scrollIntoView()", tokens)

    def loaded() -> bool:
        more = browser.find_elements(By.CSS_SELECTOR, "#tokens [hx-get]")
        if more:
            browser.execute_script("arguments[0].scrollIntoView()", more[-1])
        return not more and bool(browser.find_elements(By.CSS_SELECTOR, "#tokens .tok"))

    wait_until(loaded, 30, "every token chunk")
    generated = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok.gen")
    shown = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    assert len(generated) == ones
    assert len(shown) == len(trajectory["prompt_ids"]) + len(trajectory["response_ids"])
    assert "logprob" in generated[0].get_attribute("title")
    browser.execute_script("arguments[0].scrollIntoView({block: 'end'})", tokens)
    screenshot(browser, shots, "rollout-tokens")
    assert console_errors(browser) == []


def test_fleet_and_backends_pages_load(
    browser: Any, stack: Stack, demo_batch: tuple[str, list[str]], shots: Path
) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, f"{stack.gateway_url}/ui/fleet")
    assert browser.find_element(By.ID, "queues")
    screenshot(browser, shots, "fleet")
    assert console_errors(browser) == []
    open_page(browser, f"{stack.gateway_url}/ui/backends")
    wait_until(
        lambda: (
            "%" in browser.find_element(By.ID, "backends").text
            or "queries" in browser.find_element(By.ID, "backends").text
        ),
        15,
        "the engine's prefix-cache reading",
    )
    screenshot(browser, shots, "backends")
    assert console_errors(browser) == []


def test_cancel_button_cancels_a_running_batch(
    browser: Any, stack: Stack, demo_batch: tuple[str, list[str]], shots: Path
) -> None:
    from selenium.webdriver.common.by import By

    with RolloutClient(stack.gateway_url, timeout=120) as client:
        accepted = client.submit_batch(
            math_tasks(10), group_size=4, sampling={"max_tokens": 256}, agent={"max_turns": 3}
        )
        open_page(browser, f"{stack.gateway_url}/ui/batches/{accepted.batch_id}")
        browser.find_element(By.ID, "cancel-batch").click()
        wait_until(
            lambda: client.batch_progress(accepted.batch_id).done, 120, "the cancelled batch"
        )
        progress = client.batch_progress(accepted.batch_id)
    assert progress.counts.get("cancelled", 0) > 0
    wait_until(
        lambda: browser.find_element(By.ID, "batch-state").text == "done",
        30,
        "the page to show the batch done",
    )
    assert not browser.find_elements(By.ID, "cancel-batch")
    screenshot(browser, shots, "batch-cancelled")
    assert console_errors(browser) == []
