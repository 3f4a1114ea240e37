"""The prefix-cache hit rate read from each engine kind's own `/metrics` text."""

from __future__ import annotations

import pytest

from api.ui.engines import prefix_hit_rate

VLLM = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
"""

SGLANG = """\
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.25
"""


def test_vllm_hit_rate_is_hits_over_queries() -> None:
    reading = prefix_hit_rate("vllm", VLLM)
    assert reading.hit_rate == pytest.approx(0.25)
    assert "100 of 400" in reading.detail


def test_sglang_hit_rate_is_its_gauge() -> None:
    assert prefix_hit_rate("sglang", SGLANG).hit_rate == pytest.approx(0.25)


def test_an_engine_without_the_counters_has_no_rate_and_says_why() -> None:
    reading = prefix_hit_rate("vllm", SGLANG)
    assert reading.hit_rate is None
    assert "vllm:prefix_cache" in reading.detail


def test_no_queries_yet_is_no_rate() -> None:
    text = VLLM.replace("400.0", "0.0").replace("100.0", "0.0")
    assert prefix_hit_rate("vllm", text).hit_rate is None
