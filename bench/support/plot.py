"""matplotlib for the benchmarks' figures, drawn off-screen; absent, a bench reports no figure.

Every benchmark writes one PNG beside its JSON, `bench/figures/<bench>.png` unless
`--figure PATH` says otherwise (`add_figure_option`), drawn from the run's own figures by a
`draw(results, path)` of its own through `write_figure`. A baseline that failed has no bar:
the figure shows what was measured and names what was not (`compare_bars`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FIGURES = Path(__file__).resolve().parent.parent / "figures"


def pyplot() -> tuple[Any, str | None]:
    """`matplotlib.pyplot` with the Agg backend and None, or None and why it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return None, f"matplotlib is not installed: {exc}"
    return plt, None


def add_figure_option(parser: argparse.ArgumentParser, bench: str) -> None:
    """`--figure PATH`, by default `bench/figures/<bench>.png`."""
    parser.add_argument(
        "--figure",
        type=Path,
        default=FIGURES / f"{bench}.png",
        help="where to write the run's figure (PNG)",
    )


def write_figure(path: Path, draw: Callable[[Any], Any]) -> Path | None:
    """The PNG at `path` of the figure `draw(plt)` returns; None, with the reason on stderr,
    when matplotlib is missing or there is nothing measured to draw (`draw` returns None)."""
    plt, missing = pyplot()
    if plt is None:
        print(f"{missing}: no figure", file=sys.stderr)
        return None
    fig = draw(plt)
    if fig is None:
        print("nothing measured to draw: no figure", file=sys.stderr)
        return None
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def measured(entry: object) -> bool:
    """Whether `entry` holds figures: a dict, neither `{"failed": ...}` nor `{"skipped": ...}`."""
    return isinstance(entry, dict) and "failed" not in entry and "skipped" not in entry


def number(value: float) -> str:
    """`value` for a label: three significant digits, thousands as 81,500 rather than 8.15e+04."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def compare_bars(
    ax: Any,
    bars: Sequence[tuple[str, float | None]],
    *,
    unit: str,
    reference: str | None = None,
    log: bool = False,
    highlight: str | None = None,
    speedup: bool = False,
) -> None:
    """One bar per arm, each labelled with its value and, when `reference` names a measured
    arm, its ratio to that arm's value (with `speedup`, the reference's over its own: "Nx
    faster"). An arm whose value is None (its baseline failed) has no bar; the axis's x label
    names it as not measured."""
    shown = [(label, value) for label, value in bars if value is not None]
    missing = [label for label, value in bars if value is None]
    base = dict(shown).get(reference) if reference is not None else None
    colours = [
        "tab:orange" if label == highlight else "tab:blue" if label == reference else "tab:gray"
        for label, _ in shown
    ]
    positions = range(len(shown))
    ax.bar(positions, [value for _, value in shown], color=colours)
    ax.set_xticks(list(positions), [label for label, _ in shown], rotation=20, ha="right")
    if log:
        ax.set_yscale("log")
    for x, (label, value) in zip(positions, shown, strict=True):
        text = f"{number(value)} {unit}".strip()
        if base and value and label != reference:
            text += f"\n{base / value:.3g}x faster" if speedup else f"\n{value / base:.3g}x"
        ax.annotate(
            text, (x, value), xytext=(0, 2), textcoords="offset points",
            ha="center", va="bottom", fontsize=8,
        )  # fmt: skip
    ax.margins(y=0.25)
    ax.set_ylabel(unit)
    ax.grid(axis="y", alpha=0.3, which="both")
    if missing:
        ax.set_xlabel("not measured: " + ", ".join(missing), fontsize=8)
