"""A gateway no client can starve: `/healthz` and a submission while one tenant holds hundreds
of long-polls and idle results streams open.

One gateway (`uvicorn api.main:app`, its own process, one event loop, as `rollserve gateway`
runs it) on an embedded Redis, with a backend registered (nothing listens there and no worker
runs, so every job stays queued). The attacker, a tenant of its own, opens `--holders`
requests at once: half `POST /v1/rollouts?wait=true` (each waits out its timeout, as no job
ends) and half `GET /v1/batches/{id}/results` of a batch that never finishes (keep-alive lines
only). A prober, with the operator's token and fresh connections, then times `--probes`
`GET /healthz` and as many `POST /v1/rollouts` (no wait), one after the other.

The baseline is the same probes against the same gateway before the attacker opened anything,
measured in the same run. A probe that gets no answer within `PROBE_TIMEOUT` seconds counts as
that long and as a timeout.

    .venv/bin/python bench/gateway_starve.py [--quick] [--holders 500] [--probes 200]
        [--figure PATH]

The last line printed is one JSON object with every figure (ms) and the conditions; the figure
(`--figure PATH`, default bench/figures/gateway_starve.png) compares p50 and p99 of each probe
with and without the held requests.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this directory would come first on sys.path, and bench/routing.py beside
# this script would shadow the `routing` package: the repository comes first instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import contextlib
import math
import os
import platform
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx

from bench.support.plot import add_figure_option, write_figure
from bench.support.report import print_json
from broker.embedded import EmbeddedRedis

REPO = Path(__file__).resolve().parent.parent
OPERATOR = "bench-operator-token"
ATTACKER = "bench-attacker-token"
TASK = {"data_source": "math", "problem": "What is 2+2?", "answer": "4"}
PROBE_TIMEOUT = 10.0
"""Seconds a probe waits for its answer before it counts as a timeout."""
HOLD_SECONDS = 120
"""The `timeout` of every held long-poll: longer than the whole measurement."""
SETTLE_SECONDS = 3.0
"""Seconds given to the held requests to reach the gateway before the probes begin."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def gateway(redis_url: str, work: Path) -> Iterator[str]:
    """A gateway process on a free loopback port; yields its URL, stops it after."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    env.update(
        ROLLSERVE_REDIS_URL=redis_url,
        ROLLSERVE_DATA_DIR=str(work / "data"),
        ROLLSERVE_API_TOKEN=OPERATOR,
        ROLLSERVE_TENANT_TOKENS=f"attacker:{ATTACKER}",
        ROLLSERVE_MAX_WAIT_SECONDS=str(HOLD_SECONDS),
        PYTHONPATH=str(REPO),
    )
    command = [sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--log-level", "warning", "--timeout-graceful-shutdown", "2"]
    log = (work / "gateway.log").open("wb")
    proc = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited: see {work / 'gateway.log'}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not answer within 60 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def percentile(values: list[float], share: float) -> float:
    """The `share` (0..1) percentile of `values`, nearest rank."""
    ordered = sorted(values)
    rank = max(1, math.ceil(share * len(ordered)))
    return ordered[rank - 1]


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(samples, 0.5),
        "p99_ms": percentile(samples, 0.99),
        "max_ms": max(samples),
        "n": len(samples),
        "timeouts": sum(1 for s in samples if s >= PROBE_TIMEOUT * 1000),
    }


async def probe(url: str, method: str, path: str, count: int) -> list[float]:
    """Milliseconds each of `count` requests took, one after the other, on the prober's own
    connection (the attacker's connections are not the prober's)."""
    samples = []
    headers = {"Authorization": f"Bearer {OPERATOR}"}
    body = {"task": TASK} if method == "POST" else None
    async with httpx.AsyncClient(base_url=url, timeout=PROBE_TIMEOUT, headers=headers) as c:
        for _ in range(count):
            began = time.perf_counter()
            try:
                answer = await c.request(method, path, json=body)
                answer.raise_for_status()
                samples.append((time.perf_counter() - began) * 1000)
            except httpx.TimeoutException:
                samples.append(PROBE_TIMEOUT * 1000)
    return samples


async def hold_long_poll(client: httpx.AsyncClient) -> None:
    with contextlib.suppress(httpx.HTTPError):
        await client.post(f"/v1/rollouts?wait=true&timeout={HOLD_SECONDS}", json={"task": TASK})


async def hold_stream(client: httpx.AsyncClient, batch_id: str, opened: list[int]) -> None:
    with contextlib.suppress(httpx.HTTPError):
        async with client.stream("GET", f"/v1/batches/{batch_id}/results") as answer:
            opened.append(answer.status_code)
            async for _ in answer.aiter_lines():
                pass


async def measure(url: str, holders: int, probes: int) -> dict[str, Any]:
    baseline = {
        "healthz": summary(await probe(url, "GET", "/healthz", probes)),
        "submit": summary(await probe(url, "POST", "/v1/rollouts", probes)),
    }
    limits = httpx.Limits(max_connections=holders + 10, max_keepalive_connections=holders + 10)
    headers = {"Authorization": f"Bearer {ATTACKER}"}
    async with httpx.AsyncClient(
        base_url=url, timeout=HOLD_SECONDS + 30, limits=limits, headers=headers
    ) as attacker:
        batch = await attacker.post("/v1/batches", json={"tasks": [TASK]})
        batch.raise_for_status()
        batch_id = batch.json()["batch_id"]
        opened: list[int] = []
        polls = holders // 2
        tasks = [asyncio.create_task(hold_long_poll(attacker)) for _ in range(polls)]
        tasks += [
            asyncio.create_task(hold_stream(attacker, batch_id, opened))
            for _ in range(holders - polls)
        ]
        try:
            await asyncio.sleep(SETTLE_SECONDS)
            loaded = {
                "healthz": summary(await probe(url, "GET", "/healthz", probes)),
                "submit": summary(await probe(url, "POST", "/v1/rollouts", probes)),
            }
            still_held = sum(1 for task in tasks if not task.done())
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "baseline": baseline,
        "held": loaded,
        "long_polls": polls,
        "streams": holders - polls,
        "streams_opened": len(opened),
        "still_held_after_probes": still_held,
    }


def draw(results: dict[str, Any], path: Path) -> Path | None:
    """p50 and p99 of each probe, idle gateway against held requests."""

    def figure(plt: Any) -> Any:
        if "held" not in results:
            return None
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, name in zip(axes, ("healthz", "submit"), strict=True):
            labels, values, colours = [], [], []
            for arm, colour in (("baseline", "tab:grey"), ("held", "tab:orange")):
                for stat in ("p50_ms", "p99_ms"):
                    labels.append(f"{'idle' if arm == 'baseline' else 'held'}\n{stat[:3]}")
                    values.append(results[arm][name][stat])
                    colours.append(colour)
            ax.bar(labels, values, color=colours)
            ax.set_ylim(bottom=0)
            ax.set_ylabel("ms")
            ax.set_title("GET /healthz" if name == "healthz" else "POST /v1/rollouts")
            ax.grid(axis="y", alpha=0.3)
        fig.suptitle(
            f"{results['long_polls']} long-polls + {results['streams']} idle streams held open"
        )
        return fig

    return write_figure(path, figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 holders and 30 probes")
    parser.add_argument("--holders", type=int, default=500, help="requests the attacker holds")
    parser.add_argument("--probes", type=int, default=200, help="timed requests of each kind")
    add_figure_option(parser, "gateway_starve")
    args = parser.parse_args(argv)
    holders, probes = (100, 30) if args.quick else (args.holders, args.probes)
    with (
        tempfile.TemporaryDirectory(prefix="rollserve-bench-starve-") as tmp,
        EmbeddedRedis(Path(tmp) / "redis") as server,
        gateway(server.url, Path(tmp)) as url,
    ):
        registered = httpx.post(
            f"{url}/v1/backends?verify=false",
            json={"url": "http://127.0.0.1:9", "model": "m", "id": "b0"},
            headers={"Authorization": f"Bearer {OPERATOR}"},
        )
        registered.raise_for_status()
        figures = asyncio.run(measure(url, holders, probes))
    print(f"{'probe':<10} {'arm':<9} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'timeouts':>9}")
    for name in ("healthz", "submit"):
        for arm in ("baseline", "held"):
            row = figures[arm][name]
            print(
                f"{name:<10} {arm:<9} {row['p50_ms']:>9.1f} {row['p99_ms']:>9.1f} "
                f"{row['max_ms']:>9.1f} {row['timeouts']:>9}"
            )
    results = {
        "benchmark": "gateway_starve",
        **figures,
        "holders": holders,
        "probes": probes,
        "probe_timeout_s": PROBE_TIMEOUT,
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
    }
    figure = draw(results, args.figure)
    results["figure"] = str(figure) if figure else None
    print_json(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
