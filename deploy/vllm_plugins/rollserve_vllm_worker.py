"""A worker extension of vLLM that loads new weights from a directory, safely, on any build.

vLLM imports this module from its own virtualenv (`deploy.engine.vllm_env` puts this
directory on its `PYTHONPATH`, `deploy.engine.vllm_argv` names the class with
`--worker-extension-cls`); it imports nothing of rollserve. Its method is called through
vLLM's development-mode `POST /collective_rpc`:

    {"method": "rollserve_load_weights", "args": ["/path/to/checkpoint"]}

It does what vLLM 0.32's own `reload_weights` leaves undone:

1. it refuses a directory whose `config.json` differs from the served model's (bookkeeping
   fields aside) before anything is touched: `reload_weights` itself checks nothing, and
   loads a checkpoint of another shape into the running model without a word (seen here:
   `intermediate_size` 256 into a 128 model, answered 200, output garbage afterwards);
2. it calls the worker's `reload_weights(weights_path=...)` (in-place, layer by layer);
3. it re-processes an output layer tied to the input embeddings: the reload gives such a
   head no weights of its own, so it skips the head's post-load processing, and on the CPU
   build that processing is a prepacked copy of the matrix for its GEMM (oneDNN): the head
   would go on computing logits with the old embeddings (seen here: logprobs equal to the
   new model's hidden states times the old embedding matrix).
"""

from __future__ import annotations

from typing import Any

REFUSED = "rollserve_load_weights refused"
"""Starts the error of a load refused before the served weights were touched."""

IGNORED_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "_attn_implementation_autoset",
        "_commit_hash",
    }
)
"""`config.json` fields that do not change what the weights compute."""


def _config(path: str) -> dict[str, Any]:
    from transformers import AutoConfig

    return dict(AutoConfig.from_pretrained(path).to_dict())


class RollserveWorker:
    """Mixed into vLLM's worker class (`--worker-extension-cls`)."""

    def rollserve_load_weights(self: Any, weights_path: str) -> dict[str, Any]:
        """Check, load and finish loading the checkpoint in `weights_path` (a directory)."""
        import os

        if not isinstance(weights_path, str) or not os.path.isfile(
            os.path.join(weights_path, "config.json")
        ):
            raise ValueError(f"{REFUSED}: {weights_path!r} is not a directory with a config.json")
        served_path = str(self.model_config.model)
        try:
            served, new = _config(served_path), _config(weights_path)
        except Exception as e:
            raise ValueError(f"{REFUSED}: the configs cannot be read: {e}") from e
        keys = (served.keys() | new.keys()) - IGNORED_CONFIG_KEYS
        differing = sorted(k for k in keys if served.get(k) != new.get(k))
        if differing:
            raise ValueError(
                f"{REFUSED}: the model at {weights_path} does not have the served model's "
                f"architecture: its config differs in {', '.join(differing[:10])}"
            )
        self.reload_weights(weights_path=weights_path)
        refreshed = self._rollserve_refresh_tied_heads()
        return {"weights_path": weights_path, "refreshed": refreshed}

    def _rollserve_refresh_tied_heads(self: Any) -> list[str]:
        """Run the post-load processing again on every output layer sharing its matrix with
        an input embedding; returns their names."""
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        model = self.model_runner.get_model()
        embeddings = {
            module.weight.data_ptr()
            for module in model.modules()
            if isinstance(module, VocabParallelEmbedding)
            and not isinstance(module, ParallelLMHead)
            and getattr(module, "weight", None) is not None
        }
        refreshed = []
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            tied = weight is not None and weight.data_ptr() in embeddings
            if isinstance(module, ParallelLMHead) and tied:
                module.quant_method.process_weights_after_loading(module)
                refreshed.append(name)
        return refreshed
