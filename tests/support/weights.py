"""Checkpoints for weight-update tests: the tiny model with perturbed weights (same
architecture), one of another shape, and a float32 teacher-forced recomputation."""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class WeightDirs:
    original: Path
    """The tiny model the servers start with."""
    perturbed: Path
    """The same architecture, every tensor perturbed (the embeddings too)."""
    perturbed_again: Path
    """Another perturbation."""
    mismatched: Path
    """Another shape (`intermediate_size` 256 instead of 128)."""


def perturbed_copy(src: Path, dst: Path, seed: int, scale: float = 0.5) -> Path:
    """`src` with every parameter moved by `scale` of its own spread (Gaussian, `seed`)."""
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.add_(noise * scale * param.std().clamp(min=1e-3))
    model.save_pretrained(str(dst))
    return dst


def mismatched_copy(src: Path, dst: Path) -> Path:
    """`src`'s tokenizer with a random model of another MLP width."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(src, dst)
    config = AutoConfig.from_pretrained(str(src))
    config.intermediate_size = 2 * config.intermediate_size
    AutoModelForCausalLM.from_config(config).save_pretrained(str(dst))
    assert json.loads((dst / "config.json").read_text())["intermediate_size"] == 256
    return dst


@pytest.fixture(scope="session")
def weight_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> WeightDirs:
    root = tmp_path_factory.mktemp("checkpoints")
    return WeightDirs(
        original=tiny_model_dir,
        perturbed=perturbed_copy(tiny_model_dir, root / "step-1", seed=1),
        perturbed_again=perturbed_copy(tiny_model_dir, root / "step-2", seed=2),
        mismatched=mismatched_copy(tiny_model_dir, root / "wider"),
    )


@functools.lru_cache(maxsize=2)
def _float32_model(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def teacher_forced(model_dir: Path, prompt: list[int], output: list[int]) -> list[float]:
    """Logprobs of `output` after `prompt` under the model in `model_dir`, in float32."""
    import torch

    model = _float32_model(Path(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, token]) for i, token in enumerate(output)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
