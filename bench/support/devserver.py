"""The environment a benchmark gives the development inference server it starts."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def devserver_env(home: Path) -> dict[str, str]:
    """This process's environment for a development server working under `home`: its temp
    files, torch's compile cache and the hub's home there, nothing fetched from the network,
    and the project importable."""
    env = dict(os.environ)
    env.update(
        TMPDIR=str(home / "tmp"),
        TORCHINDUCTOR_CACHE_DIR=str(home / "inductor"),
        TIKTOKEN_CACHE_DIR="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(home / "hf"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    return env
