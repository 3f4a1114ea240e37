"""The policy the example starts from: the project's tiny random Qwen3, taught for a minute to
answer a casing task with words of mixed case.

A random model spreads its output over 151,669 ids, so a reward on a class of words would
move only the few ids it happens to sample. A short supervised warm start on synthetic answers
(common words, each written in lower case with probability `lower_share`, capitalised
otherwise) gives a policy that writes words, in both cases, with mixed rewards from its first
batch: what reinforcement learning then has to move is the share of lower case.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollserve_casing.handler import instruction

WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "music",
    "paper",
    "light",
    "water",
    "forest",
    "silver",
    "window",
    "garden",
    "winter",
    "orange",
    "summer",
    "basket",
    "candle",
    "market",
    "pepper",
)
MARKER = "rollserve-casing-policy.json"


@dataclass(frozen=True)
class WarmStart:
    steps: int = 60
    batch: int = 16
    lr: float = 1e-2
    lower_share: float = 0.4
    seed: int = 0


def answer(rng: random.Random, words: int, lower_share: float) -> str:
    chosen = [rng.choice(WORDS) for _ in range(words)]
    return " ".join(w if rng.random() < lower_share else w.capitalize() for w in chosen)


def make_policy(base_dir: Path, out_dir: Path, params: WarmStart = WarmStart()) -> Path:
    """The warm-started policy in `out_dir` (built from `base_dir` unless it is there already
    with the same parameters); returns `out_dir`."""
    want = {"base": str(base_dir), **asdict(params)}
    marker = out_dir / MARKER
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out_dir
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    torch.manual_seed(params.seed)
    rng = random.Random(params.seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = Qwen3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    end: int = tokenizer.convert_tokens_to_ids("<|im_end|>")  # type: ignore[assignment]
    pad = int(tokenizer.pad_token_id)
    optimizer = torch.optim.Adam(model.parameters(), lr=params.lr)
    for _ in range(params.steps):
        rows = []
        for _ in range(params.batch):
            words = rng.randint(3, 6)
            prompt = prompt_ids(tokenizer, words, "lower")
            target = [*tokenizer.encode(answer(rng, words, params.lower_share)), end]
            rows.append((prompt, target))
        loss = sequence_loss(model, rows, pad)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    staging = Path(tempfile.mkdtemp(prefix=".policy-", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        for extra in ("generation_config.json", "chat_template.jinja"):
            if (base_dir / extra).exists():
                shutil.copy(base_dir / extra, staging / extra)
        (staging / MARKER).write_text(json.dumps(want) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def prompt_ids(tokenizer: Any, words: int, case: str) -> list[int]:
    """The first prompt of a casing task, rendered as the service renders it."""
    messages = [{"role": "user", "content": instruction(words, case)}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def sequence_loss(model: Any, rows: list[tuple[list[int], list[int]]], pad: int) -> Any:
    """Mean negative log-likelihood of each row's target after its prompt (logits are taken
    only where a target token is predicted: the output layer is 151,669 wide)."""

    logp, mask = token_logprobs(model, rows, pad)
    return -(logp * mask).sum() / mask.sum()


def token_logprobs(model: Any, rows: list[tuple[list[int], list[int]]], pad: int) -> Any:
    """Per row, the log-probability of each target token after its prompt (right-padded to
    the longest target) and the mask of real targets."""
    import torch

    width = max(len(p) + len(t) for p, t in rows)
    span = max(len(t) for _, t in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    where = torch.zeros((len(rows), span), dtype=torch.long)
    targets = torch.full((len(rows), span), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), span))
    for i, (prompt, target) in enumerate(rows):
        seq = prompt + target
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        n = len(target)
        # The logits at position k predict token k + 1.
        where[i, :n] = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
        targets[i, :n] = torch.tensor(target)
        mask[i, :n] = 1.0
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    picked = hidden.gather(1, where.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    logits = model.lm_head(picked).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, mask
