"""A vLLM logits processor (`--logits-processors scripted_tool_calls:ScriptedToolCalls`) that
makes the random tiny model call tools: loaded by the vLLM server of the tests, from vLLM's own
virtualenv (so it imports only torch and vLLM).

Only a request whose prompt holds the `trigger` id (`<tool_call>`, which a chat template with
tools puts in the system prompt) is touched; a prompt without tools is sampled as ever. Such a
request is made to emit script `k` (a list of ids), where `k` is how many times the prompt holds
the `turn_marker` id (`<tool_response>`: the tool results so far), the last script once past the
end: at each step every logit but the scripted id's is set to -inf, so the sampler can only pick
it. The logprobs vLLM returns are the raw model's (`logprobs_mode` `raw_logprobs`, computed
before any processor), so they still equal a recomputation of the model.

A request whose prompt holds the `endless` id (`<|fim_pad|>`, which no template puts anywhere)
cannot end by itself: every `end_ids` logit is set to -inf, so it runs to its `max_tokens`
(as vLLM's `min_tokens` would; rollserve's sampling parameters do not carry that).

Configured by the environment: `ROLLSERVE_SCRIPTED_TOOL_CALLS`, JSON
`{"trigger": id, "turn_marker": id, "scripts": [[id, ...], ...], "endless": id,
"end_ids": [id, ...]}`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

CONFIG = "ROLLSERVE_SCRIPTED_TOOL_CALLS"


class ScriptedToolCalls(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        config = json.loads(os.environ.get(CONFIG) or '{"trigger": -1, "scripts": [[]]}')
        self.trigger: int = config["trigger"]
        self.turn_marker: int = config.get("turn_marker", -1)
        self.scripts: list[list[int]] = config["scripts"]
        self.endless: int = config.get("endless", -1)
        self.end_ids: list[int] = config.get("end_ids", [])
        self.active: dict[int, tuple[list[int], list[int]]] = {}
        """Batch index: (its script, its output ids so far, a live list vLLM updates)."""
        self.unending: set[int] = set()
        """Batch indices of requests that cannot end by themselves."""

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.active.pop(index, None)
            self.unending.discard(index)
        for index, _params, prompt, output in batch_update.added:
            self.active.pop(index, None)
            self.unending.discard(index)
            if prompt is not None and self.endless in prompt:
                self.unending.add(index)
            if prompt is not None and self.trigger in prompt:
                turn = min(list(prompt).count(self.turn_marker), len(self.scripts) - 1)
                self.active[index] = (self.scripts[turn], output)
        for first, second, direction in batch_update.moved:
            a, b = self.active.pop(first, None), self.active.pop(second, None)
            if a is not None:
                self.active[second] = a
            if b is not None and direction.name == "SWAP":
                self.active[first] = b
            c, d = first in self.unending, second in self.unending
            self.unending.difference_update((first, second))
            if c:
                self.unending.add(second)
            if d and direction.name == "SWAP":
                self.unending.add(first)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (script, output) in self.active.items():
            step = len(output)
            if step < len(script):
                kept = logits[index, script[step]].clone()
                logits[index] = float("-inf")
                logits[index, script[step]] = kept
        for index in self.unending:
            logits[index, self.end_ids] = float("-inf")
        return logits
