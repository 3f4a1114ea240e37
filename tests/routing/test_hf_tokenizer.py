"""`load_tokenizer`: the tokenizer AutoTokenizer would load, without torch when it can."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from routing.hf_tokenizer import generic_fast, load_tokenizer

TEXTS = [
    "Hello, world!",
    "  spaces  and\ttabs\n",
    "<|im_start|>user\nwhat is 2+2?<|im_end|>",
    "日本語",
]


def test_the_generic_fast_tokenizer_is_the_one_autotokenizer_loads(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    assert generic_fast(tiny_model_dir)
    fast, auto = load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(fast) is type(auto)
    assert len(fast) == len(auto) and fast.eos_token_id == auto.eos_token_id
    for text in TEXTS:
        ids = auto.encode(text, add_special_tokens=False)
        assert fast.encode(text, add_special_tokens=False) == ids
        assert fast.decode(ids) == auto.decode(ids)
        assert fast.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    options = {"tokenize": False, "add_generation_prompt": True}
    assert fast.apply_chat_template(messages, **options) == auto.apply_chat_template(
        messages, **options
    )


def test_loading_it_does_not_import_torch(tiny_model_dir: Path) -> None:
    code = (
        "import sys; from routing.hf_tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(tiny_model_dir)!r}); "
        "print(len(t), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(len(load_tokenizer(tiny_model_dir))), "False"]


def test_any_other_tokenizer_class_goes_through_autotokenizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "renamed"
    shutil.copytree(tiny_model_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert not generic_fast(copy)
    renamed = load_tokenizer(copy)
    assert type(renamed).__name__ == "Qwen2Tokenizer"
    assert renamed.encode(TEXTS[2]) == load_tokenizer(tiny_model_dir).encode(TEXTS[2])
    (copy / "tokenizer_config.json").write_text("{not json")
    assert not generic_fast(copy)
    (copy / "tokenizer_config.json").unlink()
    assert not generic_fast(copy)
