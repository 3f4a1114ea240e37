"""Prometheus metrics of the development server, named and counted as vLLM's v1 engine does.

The prefix-cache counters come from a block-level cache of token sequences like vLLM's
automatic prefix caching: prompts are cut into blocks of 16 ids, each block is identified by
a hash chained over everything before it, and a prompt hits on the longest run of leading
blocks that an earlier sequence left in the cache. A request's `cache_salt` is mixed into the
hash of its first block, as vLLM does, so a prefix cached under one salt (or none) is not a hit
under another.

Aborted requests (client disconnected, or SGLang's `/abort_request`) are counted in vLLM's
`vllm:request_success_total{finished_reason="abort"}`, the series vLLM exports for them.
"""

from __future__ import annotations

from collections import OrderedDict

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

BLOCK_SIZE = 16
"""Ids per KV-cache block (vLLM's default block size)."""

REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's buckets of `vllm:e2e_request_latency_seconds`."""


class PrefixCache:
    """Which full blocks of earlier sequences are cached; least recently used ones go first."""

    def __init__(self, block_size: int = BLOCK_SIZE, capacity_blocks: int = 1 << 16) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _hashes(self, ids: list[int], n_blocks: int, salt: str | None) -> list[int]:
        hashes: list[int] = []
        parent = 0 if salt is None else hash(("cache_salt", salt))
        for b in range(n_blocks):
            block = tuple(ids[b * self.block_size : (b + 1) * self.block_size])
            parent = hash((parent, block))
            hashes.append(parent)
        return hashes

    def lookup(self, prompt_ids: list[int], salt: str | None = None) -> int:
        """Prompt ids served from the cache (for a request with this `cache_salt`).

        As in vLLM, the last prompt id is always computed, so at most the full blocks within
        the first `len(prompt_ids) - 1` ids can hit.
        """
        hits = 0
        n_blocks = max(0, len(prompt_ids) - 1) // self.block_size
        for h in self._hashes(prompt_ids, n_blocks, salt):
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hits += self.block_size
        return hits

    def clear(self) -> None:
        """Forget every cached block (after new weights are loaded)."""
        self._blocks.clear()

    def insert(self, ids: list[int], salt: str | None = None) -> None:
        """Cache the full blocks of a sequence whose KV was computed."""
        for h in self._hashes(ids, len(ids) // self.block_size, salt):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


class ServerMetrics:
    """The counters and gauges behind `GET /metrics`, in a registry of their own."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        # As vLLM's (the default registry's): `process_start_time_seconds` and the rest.
        ProcessCollector(registry=self.registry)
        labels = ["model_name", "engine"]
        self._labels = {"model_name": model_name, "engine": "0"}
        self.prefix_cache = PrefixCache()
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=self.registry,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            labels,
            registry=self.registry,
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            registry=self.registry,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=self.registry,
        )
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(**self._labels, finished_reason=reason)
        for metric in (
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.prompt_tokens,
            self.generation_tokens,
            self.running,
            self.waiting,
            self.e2e_latency,
        ):
            metric.labels(**self._labels)  # export zeros before the first request

    def record_prompt(self, prompt_ids: list[int], salt: str | None = None) -> int:
        """Count a scheduled prompt against the prefix cache; returns the cached ids."""
        hits = self.prefix_cache.lookup(prompt_ids, salt)
        self.prefix_cache_queries.labels(**self._labels).inc(len(prompt_ids))
        self.prefix_cache_hits.labels(**self._labels).inc(hits)
        self.prompt_tokens.labels(**self._labels).inc(len(prompt_ids))
        return hits

    def record_finished(
        self,
        prompt_ids: list[int],
        output_ids: list[int],
        reason: str,
        salt: str | None = None,
        seconds: float | None = None,
    ) -> None:
        """Count a finished sequence and cache its blocks (all but the last id have KV);
        `seconds` from its arrival to its end (`vllm:e2e_request_latency_seconds`)."""
        self.prefix_cache.insert((prompt_ids + output_ids)[:-1], salt)
        self.generation_tokens.labels(**self._labels).inc(len(output_ids))
        if seconds is not None:
            self.e2e_latency.labels(**self._labels).observe(seconds)
        self.request_success.labels(**self._labels, finished_reason=reason).inc()

    def record_aborted(self) -> None:
        """Count a request aborted before it was scheduled."""
        self.request_success.labels(**self._labels, finished_reason="abort").inc()

    def gauge(self, name: str) -> Gauge:
        """`running` or `waiting`, bound to this server's labels."""
        metric = self.running if name == "running" else self.waiting
        return metric.labels(**self._labels)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
