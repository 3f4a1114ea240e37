"""Which tokenizer the viewer decodes a job's ids with."""

from __future__ import annotations

from pathlib import Path

from api.ui.tokens import tokenizer_source
from core.schemas import Backend


def backend(model: str) -> Backend:
    return Backend(id="b", url="http://127.0.0.1:9", model=model, kind="vllm", registered_at=0.0)


def test_a_model_directory_the_gateway_knows_by_name_is_used(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny-qwen3"
    tiny.mkdir()
    assert tokenizer_source(backend("tiny-qwen3"), [tiny]) == str(tiny)
    assert tokenizer_source(backend("Qwen/Qwen3-8B"), [tiny]) is None
    assert tokenizer_source(None, [tiny]) is None


def test_a_model_named_by_its_directory_wins(tmp_path: Path) -> None:
    named = tmp_path / "weights"
    named.mkdir()
    assert tokenizer_source(backend(str(named)), [], [tmp_path.resolve()]) == str(named.resolve())
    assert tokenizer_source(backend("tiny-qwen3"), [tmp_path / "tiny-qwen3"]) is None  # absent


def test_a_directory_outside_the_allowed_roots_is_never_read(tmp_path: Path) -> None:
    named = tmp_path / "weights"
    named.mkdir()
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    assert tokenizer_source(backend(str(named)), [], [allowed.resolve()]) is None
    assert tokenizer_source(backend(str(named)), []) is None
