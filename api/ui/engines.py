"""What each inference engine says about itself on its own `/metrics`: the prefix-cache hit
rate (vLLM and the development server: `vllm:prefix_cache_hits_total` over
`vllm:prefix_cache_queries_total`; SGLang: `sglang:cache_hit_rate`).

Reads are short (`ENGINE_TIMEOUT`) and cached per backend for `CACHE_SECONDS`, so a slow or
dead engine costs one page fragment a second at most and never holds other requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from threading import Lock

import httpx
from prometheus_client.parser import text_string_to_metric_families

from core.schemas import Backend
from routing.vllm import bearer

ENGINE_TIMEOUT = 1.0
CACHE_SECONDS = 5.0


@dataclass
class EngineReading:
    """The prefix-cache hit rate (0..1) an engine reports, or why there is none."""

    hit_rate: float | None
    detail: str


def sample_sums(text: str) -> dict[str, float]:
    """Each sample name of a Prometheus text exposition, summed over its label sets."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    return sums


def prefix_hit_rate(kind: str, text: str) -> EngineReading:
    """The hit rate in an engine's `/metrics` text, by the names its kind exports."""
    sums = sample_sums(text)
    if kind == "sglang":
        if "sglang:cache_hit_rate" not in sums:
            return EngineReading(None, "no sglang:cache_hit_rate in its /metrics")
        return EngineReading(sums["sglang:cache_hit_rate"], "sglang:cache_hit_rate")
    hits = sums.get("vllm:prefix_cache_hits_total")
    queries = sums.get("vllm:prefix_cache_queries_total")
    if hits is None or queries is None:
        return EngineReading(None, "no vllm:prefix_cache_* counters in its /metrics")
    if queries <= 0:
        return EngineReading(None, "no prefix-cache queries yet")
    return EngineReading(hits / queries, f"{hits:.0f} of {queries:.0f} prompt tokens")


class EngineMetrics:
    """Hit rates of the registered engines, read on demand and cached briefly."""

    def __init__(self, timeout: float = ENGINE_TIMEOUT, ttl: float = CACHE_SECONDS) -> None:
        self.timeout = timeout
        self.ttl = ttl
        self._cache: dict[str, tuple[float, EngineReading]] = {}
        self._lock = Lock()

    def reading(self, backend: Backend) -> EngineReading:
        with self._lock:
            cached = self._cache.get(backend.id)
            if cached is not None and time.monotonic() - cached[0] < self.ttl:
                return cached[1]
        reading = self._read(backend)
        with self._lock:
            self._cache[backend.id] = (time.monotonic(), reading)
        return reading

    def _read(self, backend: Backend) -> EngineReading:
        url = backend.url.rstrip("/") + "/metrics"
        try:
            answer = httpx.get(url, timeout=self.timeout, headers=bearer(backend.api_key))
        except httpx.HTTPError as exc:
            return EngineReading(None, f"its /metrics did not answer ({type(exc).__name__})")
        if answer.status_code != 200:
            return EngineReading(None, f"its /metrics answered {answer.status_code}")
        try:
            return prefix_hit_rate(backend.kind, answer.text)
        except ValueError:
            return EngineReading(None, "its /metrics is not Prometheus text")
