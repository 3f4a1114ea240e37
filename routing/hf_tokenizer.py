"""Loading a Hugging Face tokenizer without what it does not need.

`AutoTokenizer.from_pretrained` reads the model's configuration to pick a tokenizer class,
and that import pulls in torch: about 2 s of CPU in every process that loads a tokenizer (the
development server, the console, the SGLang client). A local directory whose tokenizer is the
generic fast one (`tokenizer_class` `TokenizersBackend`, or `PreTrainedTokenizerFast`, with a
`tokenizer.json`) is loaded by that class directly: the class AutoTokenizer would have chosen,
from the same files. Anything else goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""`tokenizer_class` values that name the generic fast tokenizer."""


def generic_fast(directory: Path) -> bool:
    """Whether `directory` holds a tokenizer AutoTokenizer would load as the generic fast one."""
    if not (directory / "tokenizer.json").is_file():
        return False
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_CLASSES


def load_tokenizer(source: str | Path, **kwargs: Any) -> Any:
    """`AutoTokenizer.from_pretrained(source, **kwargs)`, without torch for a local directory
    holding the generic fast tokenizer."""
    path = Path(source)
    if path.is_dir() and generic_fast(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source), **kwargs)
