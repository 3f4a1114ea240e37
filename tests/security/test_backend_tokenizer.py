"""A backend's tokenizer name never makes a gateway or a worker read a directory the operator
did not allow, nor download anything: through a real gateway, an SGLang backend naming a
tokenizer (or, without one, a model) outside `ROLLSERVE_TOKENIZER_ROOTS` is refused naming the
field; and the loader itself refuses such names and reads the hub's cache only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from core.settings import Settings
from routing import sglang
from routing.sglang import TokenizerRefused, check_tokenizer_name
from tests.support.gateway import field_locs, serve

SPEC = {"url": "http://127.0.0.1:9", "model": "qwen", "kind": "sglang"}


@pytest.fixture
def allowed(tmp_path: Path) -> Path:
    root = tmp_path / "tokenizers"
    (root / "qwen").mkdir(parents=True)
    return root


@pytest.fixture
def gateway(redis_url: str, allowed: Path, tmp_path: Path) -> Iterator[str]:
    settings = Settings(
        redis_url=redis_url, tokenizer_roots=str(allowed), tiny_model_dir=tmp_path / "tiny"
    )
    with serve(create_app(settings)) as url:
        yield url


@pytest.mark.parametrize(
    "field, name",
    [
        ("tokenizer", "/etc"),
        ("tokenizer", "/root/.ssh"),
        ("tokenizer", "TOKENIZERS/../../outside"),
        ("tokenizer", "../../secrets"),
        ("tokenizer", "./relative"),
        ("tokenizer", "https://example.com/tok"),
        ("model", "/home/someone/weights"),
    ],
)
def test_a_tokenizer_outside_the_allowed_roots_is_refused_naming_the_field(
    gateway: str, allowed: Path, field: str, name: str
) -> None:
    body = {**SPEC, field: name.replace("TOKENIZERS", str(allowed))}
    answer = httpx.post(f"{gateway}/v1/backends?verify=false", json=body)
    assert answer.status_code == 422, answer.text
    assert field_locs(answer) == [f"body.{field}"]
    assert httpx.get(f"{gateway}/v1/backends").json() == []


def test_tokenizers_under_the_roots_and_hub_ids_are_taken(gateway: str, allowed: Path) -> None:
    for name in (str(allowed / "qwen"), "Qwen/Qwen3-8B"):
        answer = httpx.post(f"{gateway}/v1/backends?verify=false", json={**SPEC, "tokenizer": name})
        assert answer.status_code == 201, answer.text


def test_a_symlink_out_of_the_roots_is_followed_and_refused(allowed: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (allowed / "link").symlink_to(outside)
    with pytest.raises(TokenizerRefused):
        check_tokenizer_name(str(allowed / "link"), [allowed.resolve()])
    assert check_tokenizer_name(str(allowed / "qwen"), [allowed.resolve()]) == str(
        (allowed / "qwen").resolve()
    )


def test_the_loader_reads_no_relative_path_and_never_downloads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import transformers

    calls: list[tuple[str, dict[str, Any]]] = []

    def spy(name: str, **kwargs: Any) -> object:
        calls.append((name, kwargs))
        return object()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    for name in ("../../secrets", "./here", "https://example.com/tok"):
        with pytest.raises(TokenizerRefused):
            sglang._load_tokenizer(name)
    (tmp_path / "Qwen").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TokenizerRefused):
        sglang._load_tokenizer("Qwen")  # a directory of the working directory, not a hub id
    sglang._load_tokenizer("Qwen/Qwen3-8B")
    sglang._load_tokenizer(str(tmp_path))
    assert [name for name, _ in calls] == ["Qwen/Qwen3-8B", str(tmp_path.resolve())]
    assert all(kwargs.get("local_files_only") is True for _, kwargs in calls)
