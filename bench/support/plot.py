"""matplotlib for the benchmarks' figures, drawn off-screen; absent, a bench reports no figure."""

from __future__ import annotations

from typing import Any


def pyplot() -> tuple[Any, str | None]:
    """`matplotlib.pyplot` with the Agg backend and None, or None and why it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return None, f"matplotlib is not installed: {exc}"
    return plt, None
