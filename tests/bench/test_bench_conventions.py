"""Every benchmark keeps the report convention: its last stdout line is one JSON object, and a
baseline that fails is recorded there as failed while ours are still reported (exit 0).

The heavy parts (stacks, servers, models, timed loops) are replaced by canned figures; only
bench/routing.py --quick, a second or so, runs for real.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from bench.support.report import failure, finite, json_line, run_baseline
from core.schemas import ModelTurn

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted((ROOT / "bench").glob("*.py"))
FIGURES = {"p50_ms": 1.0, "p99_ms": 2.0, "n": 10}


def bench(name: str) -> ModuleType:
    """The benchmark script `bench/<name>.py` as a module (its `main` not run)."""
    return importlib.import_module(f"bench.{name}")


def strict(value: float | str) -> Any:
    raise ValueError(f"not JSON: {value}")


def last_json(out: str) -> dict[str, Any]:
    """The last stdout line, which must be one strict JSON object."""
    lines = out.rstrip("\n").splitlines()
    assert lines, "nothing printed"
    result = json.loads(lines[-1], parse_constant=strict)
    assert isinstance(result, dict), lines[-1]
    return result


def boom(*_args: Any, **_kwargs: Any) -> Any:
    raise TimeoutError("no answer within 30 s")


# ----------------------------------------------------------------------------- the helpers


def test_a_failing_baseline_becomes_its_failure_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_baseline("fine", lambda: {"p50_ms": 1.0}) == {"p50_ms": 1.0}
    assert run_baseline("slow", lambda: boom()) == {"failed": "TimeoutError: no answer within 30 s"}
    assert "baseline slow failed" in capsys.readouterr().err  # the traceback goes to stderr
    assert failure(RuntimeError()) == {"failed": "RuntimeError"}


def test_the_json_line_is_strict_json_on_one_line() -> None:
    results = {"ratio": float("inf"), "steady": [1.0, float("nan")], "text": "a\nb"}
    line = json_line(results)
    assert "\n" not in line
    assert json.loads(line, parse_constant=strict) == {
        "ratio": None,
        "steady": [1.0, None],
        "text": "a\nb",
    }
    assert finite({"t": (1.5, float("-inf"))}) == {"t": [1.5, None]}


def test_every_benchmark_main_ends_by_printing_its_json() -> None:
    """`make bench` runs bench/*.py: each is a benchmark whose `main` prints the JSON last."""
    assert [p.name for p in BENCHMARKS] == [
        "autoscale.py",
        "chaos.py",
        "dapo.py",
        "gateway_starve.py",
        "pipeline.py",
        "proxy.py",
        "routing.py",
        "routing_vllm.py",
        "scale.py",
        "tokens.py",
        "tools.py",
        "train.py",
        "weights.py",
    ]
    for path in BENCHMARKS:
        tree = ast.parse(path.read_text())
        main = next(
            node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"
        )
        calls = sorted(
            (node.lineno, node.func.id)
            for node in ast.walk(main)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("print", "print_json")
        )
        prints = [name for _, name in calls]
        assert prints and prints[-1] == "print_json", path.name
        assert prints.count("print_json") == 1, path.name
        ends = main.body[-2:]
        assert isinstance(ends[0], ast.Expr) and isinstance(ends[0].value, ast.Call), path.name
        assert ast.unparse(ends[0].value.func) == "print_json", path.name
        assert ast.unparse(ends[1]) == "return 0", path.name


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda path: path.stem)
def test_every_benchmark_takes_the_path_of_its_figure(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--figure PATH` is accepted (`--help` ends the parse after reading it), and its default
    is bench/figures/<bench>.png."""
    with pytest.raises(SystemExit) as exit_:
        bench(path.stem).main(["--figure", "elsewhere.png", "--help"])
    assert exit_.value.code == 0
    assert "--figure" in capsys.readouterr().out
    source = path.read_text()
    assert f'add_figure_option(parser, "{path.stem}")' in source or (
        f'"figures" / "{path.stem}.png"' in source
    )


# ----------------------------------------------------------------------------- routing


def test_routing_quick_prints_its_json_last(tmp_path: Path) -> None:
    figure = tmp_path / "routing.png"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "routing.py"), "--quick", "--figure", str(figure)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = last_json(run.stdout)
    assert result["bench"] == "routing" and result["quick"] is True
    assert result["results"]["rollserve"]["throughput_vs_round_robin"] > 0
    assert result["figure"] == str(figure) and figure.stat().st_size > 0


def test_routing_records_a_failed_baseline_policy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    routing = bench("routing")
    simulate = routing.simulate

    def failing_round_robin(params: Any, name: str, jobs: Any) -> Any:
        if name == "round-robin":
            raise RuntimeError("the simulation broke")
        return simulate(params, name, jobs)

    monkeypatch.setattr(routing, "simulate", failing_round_robin)
    small = ["--jobs", "30", "--slots", "8", "--backends", "2", "--big", "1"]
    small += ["--figure", str(tmp_path / "routing.png")]
    assert routing.main([*small, "--policies", "round-robin,rollserve"]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["results"]["round-robin"] == {"failed": "RuntimeError: the simulation broke"}
    ours = result["results"]["rollserve"]
    assert ours["jobs"] == 30 and ours["throughput_vs_round_robin"] is None

    def failing_rollserve(params: Any, name: str, jobs: Any) -> Any:
        raise RuntimeError("our policy broke")

    monkeypatch.setattr(routing, "simulate", failing_rollserve)
    with pytest.raises(RuntimeError, match="our policy broke"):  # ours is not a baseline
        routing.main([*small, "--policies", "rollserve"])


# ----------------------------------------------------------------------------- tools


@contextlib.contextmanager
def no_tool_server(work: Path, port: int) -> Iterator[Path]:
    yield work / "tools.sock"


@pytest.mark.parametrize("failing", ["bench_swerex", "bench_tmux"])
def test_tools_records_a_failed_baseline_and_reports_ours(
    failing: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    tools = bench("tools")
    per_workload = {"true": FIGURES, "100k": FIGURES}
    monkeypatch.setattr(tools, "tool_server", no_tool_server)
    monkeypatch.setattr(
        tools, "bench_ours", lambda *_: {w: {"unix": FIGURES, "tcp": FIGURES} for w in per_workload}
    )
    monkeypatch.setattr(tools, "bench_ipython", lambda *_: {"direct": FIGURES, "http": FIGURES})
    monkeypatch.setattr(tools, "bench_tmux", lambda *_: {"0ms": per_workload})
    monkeypatch.setattr(tools, "bench_swerex", lambda *_: per_workload)
    monkeypatch.setattr(tools, "bench_startup", lambda *_: {"ready": FIGURES, "stop": FIGURES})
    monkeypatch.setattr(tools.shutil, "which", lambda name: "/bin/tmux" if name == "tmux" else None)
    monkeypatch.setattr(tools, failing, boom)

    assert tools.main(["--quick", "--figure", str(tmp_path / "tools.png")]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["figure"] == str(tmp_path / "tools.png")  # drawn with the baseline failed
    failed = {"failed": "TimeoutError: no answer within 30 s"}
    true = result["bash"]["true"]
    assert true["ours_unix"] == FIGURES and true["ours_tcp"] == FIGURES
    assert result["ratios"]["tcp/unix_true_p50"] == 1.0
    if failing == "bench_swerex":
        assert true["swerex"] == failed and result["bash"]["100k"]["swerex"] == failed
        assert result["ratios"]["swerex/ours_true_p50"] is None
        assert result["aims"]["at_least_50x_faster_than_swerex"] is None
        assert result["ratios"]["tmux_best/ours_true_p50"] == 1.0
    else:
        assert true["tmux_best"] == failed and "tmux" not in true
        assert result["ratios"]["tmux_best/ours_true_p50"] is None
        assert result["aims"]["at_least_5x_faster_than_best_tmux"] is None
        assert true["swerex"] == FIGURES


def test_an_interleaved_baseline_stops_at_its_first_failure() -> None:
    tools = bench("tools")
    calls = iter([None, None, "fail"])

    def flaky() -> None:
        if next(calls) == "fail":
            raise TimeoutError("timed out")

    theirs = tools.Timed("hop", flaky, baseline=True)
    for _ in range(5):
        theirs.run()
    assert len(theirs.times) == 2 and theirs.figures() == {"failed": "TimeoutError: timed out"}

    ours = tools.Timed("ours", boom)
    with pytest.raises(TimeoutError):
        ours.run()


# ----------------------------------------------------------------------------- pipeline


class FakeClient:
    """Stands in for `RolloutClient` where the measuring functions are canned."""

    def __init__(self, url: str, **_: Any) -> None:
        self.url = url
        self.cancelled: list[str] = []

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def cancel_batch(self, batch_id: str) -> None:
        self.cancelled.append(batch_id)


@contextlib.contextmanager
def fake_stack_cm(*_args: Any) -> Iterator[SimpleNamespace]:
    yield SimpleNamespace(gateway_url="http://127.0.0.1:9", redis_url="redis://127.0.0.1:9/0")


def fake_stack(*args: Any, vllm: bool = False) -> Any:
    """A started stack, as `start` returns it; one with a real vLLM cannot start here."""
    if vllm:
        raise RuntimeError("cannot start vLLM: .vllm-venv has no vllm (run `make vllm`)")
    return fake_stack_cm(*args)


def test_pipeline_records_a_failed_celery_floor(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pipeline = bench("pipeline")
    monkeypatch.setattr(pipeline, "make_tiny_model", lambda path: path)
    monkeypatch.setattr(pipeline, "measure_celery_floor", boom)
    monkeypatch.setattr(pipeline, "start", fake_stack)
    monkeypatch.setattr(pipeline, "RolloutClient", FakeClient)
    monkeypatch.setattr(
        pipeline,
        "measure_overhead",
        lambda *_: {
            "overhead_p50_ms": 40.0,
            "overhead_p99_ms": 55.0,
            "total_p50_ms": 60.0,
            "overhead_parts_p50_ms": {"hops": 20.0, "run_without_model": 10.0},
        },
    )
    monkeypatch.setattr(
        pipeline,
        "measure_turn_overhead",
        lambda *_: {"turn_overhead_p50_ms": 5.0, "turn_overhead_p99_ms": 9.0, "turns": 40},
    )
    monkeypatch.setattr(pipeline, "measure_throughput", lambda _c, _j, workers: 3.0 * workers)

    assert pipeline.main(["--quick", "--figure", str(tmp_path / "pipeline.png")]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["figure"] == str(tmp_path / "pipeline.png")
    assert result["celery_3hop_floor_p50_ms"] == {"failed": "TimeoutError: no answer within 30 s"}
    assert result["overhead_vs_celery_floor"] is None
    assert result["overhead_p50_ms"] == 40.0 and result["scaling_4_vs_1"] == 4.0
    # No vLLM here: its row says why, and ours are still reported.
    assert result["real_vllm"] == {
        "failed": "RuntimeError: cannot start vLLM: .vllm-venv has no vllm (run `make vllm`)"
    }


# ----------------------------------------------------------------------------- dapo


def test_dapo_records_a_failed_baseline_mode_and_cancels_its_batches(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    dapo = bench("dapo")
    clients: list[FakeClient] = []

    def client(url: str, **kwargs: Any) -> FakeClient:
        clients.append(FakeClient(url, **kwargs))
        return clients[-1]

    def run_mode(run: Any, *_args: Any) -> Any:
        run.batch_ids.append(f"batch-{run.mode}")
        if run.mode == "b":
            raise TimeoutError("the stream stalled")
        run.steps_to_target = [2.0, 2.0] if run.mode == "a" else [1.0, 1.0]
        run.settled = 5.0
        run.groups_drawn = 10
        run.seconds = {"used": 10.0, "filtered": 5.0, "wasted": 5.0}
        return run

    monkeypatch.setattr(dapo, "make_tiny_model", lambda path: path)
    monkeypatch.setattr(dapo, "start", fake_stack)
    monkeypatch.setattr(dapo, "RolloutClient", client)
    monkeypatch.setattr(dapo, "warm_up", lambda *_: None)
    monkeypatch.setattr(dapo, "run_mode", run_mode)

    assert dapo.main(["--quick", "--figure", str(tmp_path / "dapo.png")]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["figure"] == str(tmp_path / "dapo.png")
    assert result["b"] == {"failed": "TimeoutError: the stream stalled"}
    assert clients[0].cancelled == ["batch-b"]
    assert result["ratios"]["b"] == {"to_target_speedup_vs_a": None, "wasted_seconds_vs_a": None}
    assert result["ratios"]["c"]["to_target_speedup_vs_a"] == 2.0
    assert result["c"]["to_target_all_steps_s_median"] == 2.0


# ----------------------------------------------------------------------------- tokens


def one_turn_record(tokens: ModuleType) -> Any:
    """A recorded trajectory of one model turn, its record exactly what was generated."""
    turn = ModelTurn(
        prompt_ids=[1, 2, 3], output_ids=[7, 8], logprobs=[-0.5, -0.25],
        finish_reason="stop", text="",
    )  # fmt: skip
    return tokens.Recorded(
        messages=[{"role": "user", "content": "hi"}],
        tools=None,
        prompt_ids=[1, 2, 3],
        turns=[turn],
        response_ids=[7, 8],
        loss_mask=[1, 1],
        replies=[],
        closing=[9],
        calls=[tokens.Call([1, 2, 3], [7, 8], [-0.5, -0.25])],
        stop_reason="answer",
    )


class SmallTokenizer:
    def __len__(self) -> int:
        return 100


def test_tokens_records_a_failed_retokenizing_baseline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tokens = bench("tokens")
    for name in ("TIKTOKEN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):  # main sets them if unset
        monkeypatch.setenv(name, str(tmp_path))
    monkeypatch.setattr(tokens, "retokenize_drift", boom)
    recs = [one_turn_record(tokens), one_turn_record(tokens)]
    row = tokens.summarize("bigram", "in-process", recs, SmallTokenizer(), 0.5)
    assert row.baseline_failure == {"failed": "TimeoutError: no answer within 30 s"}
    assert (row.trajectories, row.model_turns, row.generated_tokens) == (2, 2, 4)
    assert (row.record_differing_sequences, row.record_mismatched_tokens) == (0, 0)
    ours = tokens.Row("scripted", "server", trajectories=1, model_turns=1, generated_tokens=2)

    async def canned_bench(args: Any, work: Path) -> tuple[dict[str, Any], list[Any]]:
        sizes = tokens.QUICK
        corpus = {"modules": 1, "chars": 10, "tokens": 4}
        params = {"sizes": vars(sizes), "corpus": corpus, "tokenizer": "t", "chat_template": "c"}
        return params, [ours, row]

    monkeypatch.setattr(tokens, "bench", canned_bench)
    assert tokens.main(["--quick", "--figure", str(tmp_path / "tokens.png")]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["figure"] == str(tmp_path / "tokens.png")
    first, second = result["rows"]
    assert first["drift_trajectories_pct"] == 0.0 and "retokenized" not in first
    assert second["retokenized"] == {"failed": "TimeoutError: no answer within 30 s"}
    assert "drift_tokens" not in second and second["record_differing_sequences"] == 0


# ----------------------------------------------------------------------------- chaos


def chaos_figures(lost: int = 0, duplicated: int = 0, recover_s: float = 20.0) -> dict[str, Any]:
    return {
        "submitted": 16, "completed": 16 - lost, "failed": 0, "errors": {},
        "duplicated": duplicated, "lost": lost, "recover_s": recover_s, "batch_s": 30.0,
    }  # fmt: skip


def test_chaos_records_faults_it_cannot_stage_and_judges_the_aims(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    chaos = bench("chaos")
    monkeypatch.setattr(chaos, "make_tiny_model", lambda path: path)
    outcomes = {
        "none": chaos_figures(recover_s=3.0) | {"batch_s": 10.0},
        "redis_killed": chaos_figures(recover_s=12.0),
        "pool_child_killed": chaos_figures(lost=1),
    }

    def fake_measure(fault: Any, *_: Any) -> dict[str, Any]:
        if fault.name == "backend_killed":
            raise RuntimeError("the stack did not come up")
        return dict(outcomes[fault.name])

    monkeypatch.setattr(chaos, "measure", fake_measure)
    monkeypatch.setattr(chaos.NodeLost, "unavailable", lambda self: "bubblewrap is missing")
    only = "redis_killed,backend_killed,node_lost"
    figure = ["--figure", str(tmp_path / "chaos.png")]
    assert chaos.main(["--quick", "--only", only, *figure]) == 0
    result = last_json(capsys.readouterr().out)
    faults = result["faults"]
    assert faults["redis_killed"]["slowdown"] == 3.0  # 30 s against the baseline's 10 s
    assert faults["backend_killed"] == {"failed": "RuntimeError: the stack did not come up"}
    assert faults["node_lost"] == {"skipped": "bubblewrap is missing"}
    assert result["all_met"] is False  # a fault that could not be staged did not meet them
    assert chaos.main(["--only", "redis_killed", *figure]) == 0
    assert last_json(capsys.readouterr().out)["all_met"] is True
    assert chaos.main(["--only", "pool_child_killed", *figure]) == 0
    assert last_json(capsys.readouterr().out)["all_met"] is False  # one job lost
    with pytest.raises(SystemExit):
        chaos.main(["--only", "cosmic_rays", *figure])
    assert "unknown fault(s) cosmic_rays" in capsys.readouterr().err
