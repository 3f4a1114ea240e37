"""The two engines of the development inference server: a local model, or scripted answers.

Both produce what vLLM's engine produces for a completion request: the generated token ids,
the raw logprob of each (log-softmax of the unprocessed logits, vLLM's default `raw_logprobs`),
the detokenized text, and why generation ended, with vLLM's stopping rules (EOS, stop token
ids, `max_tokens`, stop strings and `include_stop_str_in_output`). A completion whose plan's
`cancel` event is set stops before its next token and finishes with `"abort"`.

A model whose output layer is wider than its tokenizer (Qwen pads 151,669 ids to 151,936) never
generates an id the tokenizer lacks: those logits are set to -inf before anything else, so
sampling, greedy decoding and every logprob (generated or scored) are those of the
distribution renormalised over the ids the tokenizer defines.

torch and transformers are imported only when an engine is loaded.
"""

from __future__ import annotations

import inspect
import json
import random
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from routing.devserver.protocol import SAMPLING_EPS

DEFAULT_TEXT = "I do not know."
"""What the scripted engine answers when no script entry applies."""

DEFAULT_TURN_MARKER = "<|im_start|>assistant"
"""Counted in the decoded prompt to tell which turn of a scripted conversation is asked for."""


@dataclass
class SamplingParams:
    """The sampling and stopping parameters of one completion, already validated."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    logprobs: int | None = None
    """Top alternatives to report per position; None: no logprobs at all."""


@dataclass
class Plan:
    """What one completion will do, decided before it waits for the model."""

    prompt_ids: list[int]
    params: SamplingParams
    delay: float = 0.0
    """Seconds to wait before answering."""
    error_status: int | None = None
    """Answer with this HTTP error instead of a completion (scripted fault)."""
    script_text: str | None = None
    """Scripted mode: the text to answer with (before stopping rules cut it)."""
    cancel: threading.Event = field(default_factory=threading.Event)
    """Set to abort: generation stops before its next token, finishing with `"abort"`."""


@dataclass
class Generation:
    """One finished sequence."""

    token_ids: list[int]
    logprobs: list[float]
    """Raw logprob of each generated id."""
    top_logprobs: list[list[tuple[int, float]]] | None
    """Per position: the sampled id first, then the `logprobs` most likely ids."""
    text: str
    finish_reason: str
    stop_reason: int | str | None
    cached_tokens: int = 0
    """Prompt ids served from the prefix cache (set by the server)."""


class OutputTracker:
    """Applies vLLM's stopping and detokenization rules one generated id at a time."""

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        *,
        prompt_len: int,
        max_model_len: int,
        eos_token_id: int | None,
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._prompt_len = prompt_len
        self._max_model_len = max_model_len
        self._eos = eos_token_id
        self._stop_ids = set(params.stop_token_ids)
        self._decoded_upto = 0
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_id: int) -> bool:
        """Append one generated id; returns True once the sequence is finished."""
        if self.finished:
            raise RuntimeError("sequence already finished")
        p = self._params
        self.token_ids.append(token_id)
        stop_terminated = False
        # The scheduler's order: EOS, then stop token ids, then the length caps.
        if not p.ignore_eos and token_id == self._eos:
            self.finish_reason, stop_terminated = "stop", True
        elif token_id in self._stop_ids:
            self.finish_reason, self.stop_reason, stop_terminated = "stop", token_id, True
        elif (
            self._prompt_len + len(self.token_ids) >= self._max_model_len
            or len(self.token_ids) >= p.max_tokens
        ):
            self.finish_reason = "length"

        # The detokenizer leaves out the stopping token unless it is to be kept.
        upto = len(self.token_ids)
        if stop_terminated and not p.include_stop_str_in_output:
            upto -= 1
        before = len(self.text)
        self._decode_to(upto)
        new_chars = len(self.text) - before
        if p.stop and new_chars > 0:
            hit = find_stop_string(self.text, new_chars, p.stop, p.include_stop_str_in_output)
            if hit is not None:
                stop_str, cut = hit
                self.text = self.text[:cut]
                self.finish_reason, self.stop_reason = "stop", stop_str
        return self.finished

    def _decode_to(self, upto: int) -> None:
        if upto <= self._decoded_upto:
            return
        piece = self._tokenizer.decode(
            self.token_ids[self._decoded_upto : upto],
            skip_special_tokens=self._params.skip_special_tokens,
        )
        # Hold back ids that end inside a multi-byte character until it is complete, as
        # vLLM's incremental detokenizer does.
        if piece.endswith("\ufffd"):
            return
        self.text += piece
        self._decoded_upto = upto


def find_stop_string(
    text: str, new_chars: int, stops: list[str], include: bool
) -> tuple[str, int] | None:
    """The stop string completed by the last `new_chars` characters of `text`, if any.

    Returns the stop string and the length the text is cut to (after the stop string when
    `include`, before it otherwise). When several complete, the one ending first wins.
    """
    best: tuple[str, int, int] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index < 0:
            continue
        end = index + len(stop)
        if best is None or end < best[2]:
            best = (stop, index, end)
    if best is None:
        return None
    stop, index, end = best
    return stop, (end if include else index)


# ----------------------------------------------------------------------------- engines


class Engine:
    """A tokenizer and a way to produce completions; the server's view of a model."""

    kind = "base"

    def __init__(
        self,
        model_dir: Path,
        *,
        served_model_name: str | None = None,
        max_model_len: int = 4096,
        delay: float = 0.0,
        delay_max: float | None = None,
        chat_template: str | None = None,
    ) -> None:
        from routing.hf_tokenizer import load_tokenizer

        self.model_dir = Path(model_dir)
        self.weights_path = self.model_dir
        """Where the served weights were loaded from (changed by a weight update)."""
        self.served_model_name = served_model_name or self.model_dir.name
        self.max_model_len = max_model_len
        self.delay = delay
        self.delay_max = delay if delay_max is None else max(delay, delay_max)
        """With `delay_max` above `delay`, each request waits a uniformly drawn time between
        them (a fleet whose answers take 1-5 s, say)."""
        self._delays = random.Random(0)
        self.tokenizer: Any = load_tokenizer(self.model_dir)
        self.chat_template = chat_template
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        self.vocab_size = len(self.tokenizer)
        path = self.model_dir / "generation_config.json"
        generation = json.loads(path.read_text()) if path.is_file() else {}
        # vLLM stops on every eos id of generation_config.json; those other than the
        # tokenizer's eos act as stop token ids (and are reported as the stop_reason).
        eos = generation.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.extra_stop_token_ids = [i for i in eos_ids if i != self.eos_token_id]
        # vLLM also takes the model's sampling defaults for fields a request leaves out.
        self.default_sampling: dict[str, float] = {
            k: generation[k] for k in ("temperature", "top_p", "top_k") if k in generation
        }

    # --- tokenizer operations (cheap; run on the event loop)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_str(self, token_id: int) -> str:
        """One id decoded on its own, as vLLM reports it in `logprobs.tokens`."""
        return str(self.tokenizer.decode([token_id]))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The ids of `messages` rendered by the chat template, as vLLM's `/tokenize` does."""
        kwargs = dict(chat_template_kwargs or {})
        template = chat_template or self.chat_template
        if template is not None:
            kwargs["chat_template"] = template
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
        return self.encode(str(text), add_special_tokens=add_special_tokens)

    def set_threads(self, threads: int) -> None:
        """Threads of the model's computations (an engine without a model has none)."""

    # --- completions

    def request_delay(self) -> float:
        """Seconds the next request waits before it is answered."""
        if self.delay_max <= self.delay:
            return self.delay
        return self._delays.uniform(self.delay, self.delay_max)

    def plan(self, prompt_ids: list[int], params: SamplingParams) -> Plan:
        """Decide what a completion will do (cheap; runs on the event loop)."""
        return Plan(prompt_ids=prompt_ids, params=params, delay=self.request_delay())

    def generate(self, plan: Plan) -> Generation:
        """Run the completion (blocking; the server calls it in a thread, one at a time)."""
        raise NotImplementedError

    def tracker(self, plan: Plan) -> OutputTracker:
        params = plan.params
        if self.extra_stop_token_ids:
            stop_ids = list(dict.fromkeys([*params.stop_token_ids, *self.extra_stop_token_ids]))
            params = replace(params, stop_token_ids=stop_ids)
        return OutputTracker(
            self.tokenizer,
            params,
            prompt_len=len(plan.prompt_ids),
            max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id,
        )


class ModelEngine(Engine):
    """A Hugging Face causal LM run by transformers on the CPU."""

    kind = "model"

    def __init__(self, model_dir: Path, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            str(self.model_dir), dtype=torch.float32
        ).eval()
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`; accept either.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params

    def set_threads(self, threads: int) -> None:
        self._torch.set_num_threads(threads)

    def _forward(
        self, ids: list[int], *, keep: int, cache: Any = None, use_cache: bool
    ) -> tuple[Any, Any]:
        """Logits of the last `keep` positions (-inf past the tokenizer's ids), and the KV
        cache to continue from."""
        torch = self._torch
        kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids]), "use_cache": use_cache}
        if cache is not None:
            kwargs[self._cache_arg] = cache
        if self._keeps_logits:
            kwargs["logits_to_keep"] = keep
        out = self.model(**kwargs)
        logits = out.logits[0, -keep:].float()
        if logits.shape[-1] > self.vocab_size:
            # Ids past the tokenizer are never sampled, and the logprobs are renormalised over
            # the others (what a teacher-forced pass with the same mask gives).
            logits = logits.clone()
            logits[:, self.vocab_size :] = float("-inf")
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return logits, new_cache

    def score(
        self, prompt_ids: list[int], output_ids: list[int], top: int | None
    ) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
        """Raw logprobs of `output_ids` after `prompt_ids`, from one teacher-forced pass
        (over the ids the tokenizer defines, as generation samples them)."""
        torch = self._torch
        if not output_ids:
            return [], ([] if top is not None else None)
        with torch.inference_mode():
            full = prompt_ids + output_ids
            logits, _ = self._forward(full[:-1], keep=len(output_ids), use_cache=False)
            logp = torch.log_softmax(logits, dim=-1)
            picked = logp.gather(1, torch.tensor(output_ids).unsqueeze(1)).squeeze(1)
            lps = [float(x) for x in picked]
            tops = None
            if top is not None:
                tops = [
                    self._top(row, tok, lp, top)
                    for row, tok, lp in zip(logp, output_ids, lps, strict=True)
                ]
        return lps, tops

    def _top(self, logp: Any, token: int, lp: float, k: int) -> list[tuple[int, float]]:
        entries = [(token, lp)]
        if k > 0:
            values, indices = self._torch.topk(logp, k)
            entries += [(int(i), float(v)) for v, i in zip(values, indices, strict=True)]
        return entries

    def _generator(self, seed: int | None) -> Any:
        gen = self._torch.Generator()
        gen.manual_seed(seed if seed is not None else random.getrandbits(63))
        return gen

    def _sample(self, logits: Any, p: SamplingParams, gen: Any) -> int:
        torch = self._torch
        if p.temperature < SAMPLING_EPS:
            return int(torch.argmax(logits))
        scaled = logits / p.temperature
        if 0 < p.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest set of most likely ids whose mass reaches top_p.
            drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) > p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen))

    def generate(self, plan: Plan) -> Generation:
        torch = self._torch
        p = plan.params
        tracker = self.tracker(plan)
        gen = self._generator(p.seed)
        lps: list[float] = []
        tops: list[list[tuple[int, float]]] | None = [] if p.logprobs is not None else None
        with torch.inference_mode():
            logits, cache = self._forward(plan.prompt_ids, keep=1, use_cache=True)
            while True:
                if plan.cancel.is_set():
                    tracker.finish_reason = "abort"
                    break
                row = logits[-1]
                logp = torch.log_softmax(row, dim=-1)
                token = self._sample(row, p, gen)
                lp = float(logp[token])
                lps.append(lp)
                if tops is not None:
                    tops.append(self._top(logp, token, lp, p.logprobs or 0))
                if tracker.add(token):
                    break
                logits, cache = self._forward([token], keep=1, cache=cache, use_cache=True)
        return Generation(
            token_ids=tracker.token_ids,
            logprobs=lps,
            top_logprobs=tops,
            text=tracker.text,
            finish_reason=tracker.finish_reason or "stop",
            stop_reason=tracker.stop_reason,
        )


@dataclass
class ScriptEntry:
    """One line of a script file."""

    match: str
    samples: list[list[str]]
    delay: float | None = None
    errors: list[int] = field(default_factory=list)
    line: int = 0
    served: int = 0
    """Requests that picked this entry so far (drives `errors` and the round robin)."""


def load_script(path: Path) -> list[ScriptEntry]:
    """Parse a script file: JSON lines of `{"match", "samples", "delay"?, "errors"?}`.

    `samples` is a list of conversations, each a list of assistant turns (a bare string is a
    one-turn conversation). `errors` lists HTTP statuses that the first requests picking the
    entry get instead of a completion. Blank lines are skipped.
    """
    entries: list[ScriptEntry] = []
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON: {e}") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("match"), str):
            raise ValueError(f'{where}: an entry needs a string "match"')
        samples = obj.get("samples")
        if not isinstance(samples, list) or not samples:
            raise ValueError(f'{where}: "samples" must be a non-empty list')
        turns_list = [[s] if isinstance(s, str) else s for s in samples]
        for turns in turns_list:
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{where}: each sample must be a list of strings")
        delay = obj.get("delay")
        if delay is not None and (not isinstance(delay, int | float) or delay < 0):
            raise ValueError(f'{where}: "delay" must be a number >= 0')
        errors = obj.get("errors", [])
        if not isinstance(errors, list) or not all(
            isinstance(s, int) and 400 <= s <= 599 for s in errors
        ):
            raise ValueError(f'{where}: "errors" must be a list of HTTP error statuses')
        entries.append(
            ScriptEntry(
                match=obj["match"],
                samples=turns_list,
                delay=None if delay is None else float(delay),
                errors=list(errors),
                line=number,
            )
        )
    return entries


class ScriptEngine(ModelEngine):
    """Scripted completions, scored by a real model so that their logprobs are real.

    The entry whose `match` occurs in the decoded prompt answers (the longest match wins, then
    the earliest line); its sample is `seed % len(samples)` (a round robin per entry when the
    seed is null) and the turn is the number of assistant turns already in the prompt.
    """

    kind = "script"

    def __init__(
        self,
        model_dir: Path,
        script: Path,
        *,
        default_text: str = DEFAULT_TEXT,
        turn_marker: str = DEFAULT_TURN_MARKER,
        **kwargs: Any,
    ) -> None:
        self._use_script(script, default_text, turn_marker)
        super().__init__(model_dir, **kwargs)

    def _use_script(self, script: Path | None, default_text: str, turn_marker: str) -> None:
        self.entries = load_script(script) if script is not None else []
        self.script_path = Path(script) if script is not None else None
        self.default_text = default_text
        self.turn_marker = turn_marker

    def pick(self, prompt_text: str) -> ScriptEntry | None:
        """The entry that answers a prompt with this text, if any."""
        best: ScriptEntry | None = None
        for entry in self.entries:
            if entry.match in prompt_text and (best is None or len(entry.match) > len(best.match)):
                best = entry
        return best

    def plan(self, prompt_ids: list[int], params: SamplingParams) -> Plan:
        prompt_text = self.decode(prompt_ids)
        entry = self.pick(prompt_text)
        if entry is None:
            return Plan(
                prompt_ids, params, delay=self.request_delay(), script_text=self.default_text
            )
        served = entry.served
        entry.served += 1
        delay = self.request_delay() if entry.delay is None else entry.delay
        if served < len(entry.errors):
            return Plan(prompt_ids, params, delay=delay, error_status=entry.errors[served])
        counter = served - len(entry.errors)
        index = (params.seed if params.seed is not None else counter) % len(entry.samples)
        turns = entry.samples[index]
        turn = max(0, prompt_text.count(self.turn_marker) - 1)
        text = turns[turn] if turn < len(turns) else self.default_text
        return Plan(prompt_ids, params, delay=delay, script_text=text)

    def generate(self, plan: Plan) -> Generation:
        p = plan.params
        ids = self.encode(plan.script_text or "", add_special_tokens=False)
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        tracker = self.tracker(plan)
        for token in ids:
            if plan.cancel.is_set():
                tracker.finish_reason = "abort"
                break
            if tracker.add(token):
                break
        if not tracker.finished:  # ran out of script (only with ignore_eos)
            tracker.finish_reason = "stop"
        lps, tops = self.score(plan.prompt_ids, tracker.token_ids, p.logprobs)
        return Generation(
            token_ids=tracker.token_ids,
            logprobs=lps,
            top_logprobs=tops,
            text=tracker.text,
            finish_reason=tracker.finish_reason or "stop",
            stop_reason=tracker.stop_reason,
        )


class UnscoredScriptEngine(ScriptEngine):
    """Scripted completions whose logprobs are made up, with no model loaded: a stand-in
    for a fleet under load tests, where the server must answer hundreds of requests a second
    on a shared CPU. Every generated id gets `LOGPROB` (the alternatives a little less)."""

    kind = "script-unscored"
    LOGPROB = -0.5

    def __init__(
        self,
        model_dir: Path,
        script: Path | None,
        *,
        default_text: str = DEFAULT_TEXT,
        turn_marker: str = DEFAULT_TURN_MARKER,
        **kwargs: Any,
    ) -> None:
        self._use_script(script, default_text, turn_marker)
        Engine.__init__(self, model_dir, **kwargs)

    def set_threads(self, threads: int) -> None:
        Engine.set_threads(self, threads)  # no model, no torch

    def score(
        self, prompt_ids: list[int], output_ids: list[int], top: int | None
    ) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
        lps = [self.LOGPROB] * len(output_ids)
        if top is None:
            return lps, None
        tops = [
            [(tok, self.LOGPROB)] + [(alt, self.LOGPROB - 1 - alt) for alt in range(top)]
            for tok in output_ids
        ]
        return lps, tops
