"""Loading new weights into the development server while it runs, as SGLang and vLLM do.

SGLang: `POST /update_weights_from_disk` with SGLang's `UpdateWeightFromDiskReqInput`
(`model_path`, `load_format`, `abort_all_requests`, `weight_version`, `flush_cache`, ...) and
its answer `{"success", "message", "num_paused_requests"}` (200, or 400 when `success` is
false); `GET /model_info` and `GET /get_model_info` report the loaded `model_path` and
`weight_version`. As in SGLang (its `model_update_lock`), an update waits until the requests
in flight have finished (or aborts them first, with `abort_all_requests`) and holds new ones
back until the new weights are in: a request is answered by one set of weights from its first
token to its last, never a mix. The new weights are read before that wait, so requests keep
being served meanwhile; `flush_cache` (the default) empties the prefix cache.

vLLM (its development-mode endpoints, served by vLLM with `VLLM_SERVER_DEV_MODE=1`):
`POST /pause?mode=abort|wait|keep` (new requests wait; `abort` aborts those in flight, `wait`
and `keep` let them finish, as the development server cannot freeze a running generation),
`POST /resume`, `GET /is_paused`, `POST /reset_prefix_cache` and `POST /collective_rpc` with
the worker method `reload_weights` (`kwargs.weights_path`: the directory to load; the served
one when absent), answering `{"results": [null]}` like a one-worker vLLM. The swap waits for
the sequence being generated, so no sequence mixes weights either.

Refused, with the old weights kept: a directory whose `config.json` differs from the served
model's in anything but bookkeeping fields (`_name_or_path`, `transformers_version`, `dtype`,
...), or whose checkpoint lacks, adds or reshapes a tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from routing.devserver.engine import ModelEngine
from routing.devserver.protocol import error_body

if TYPE_CHECKING:
    from routing.devserver.server import DevServer

T = TypeVar("T")

SUCCESS_MESSAGE = "Succeeded to update model weights."
"""SGLang's message for a successful update."""
REFUSED = "rollserve_load_weights refused"
"""How rollserve's vLLM worker extension starts the error of a checkpoint it refused."""

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

LOAD_FORMATS = {None: None, "auto": None, "safetensors": True, "pt": False}
"""`load_format` values the development server reads, to transformers' `use_safetensors`."""


class WeightLoadError(ValueError):
    """New weights that cannot replace the served ones; the served ones are kept."""


class UpdateWeightFromDiskReqInput(BaseModel):
    """Body of SGLang's `POST /update_weights_from_disk`, with SGLang's field names.

    Only `model_path`, `load_format`, `abort_all_requests`, `weight_version` and `flush_cache`
    change what the development server does; the others (GPU and scheduler options) are
    accepted and have no effect here.
    """

    model_config = ConfigDict(extra="ignore")

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


def config_differences(served: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The `config.json` fields (bookkeeping ones aside) whose values differ."""
    keys = (served.keys() | new.keys()) - IGNORED_CONFIG_KEYS
    return sorted(k for k in keys if served.get(k) != new.get(k))


def read_weights(
    engine: ModelEngine, path: Path, load_format: str | None = None, *, check_config: bool = True
) -> Any:
    """The model at `path` in float32, checked to have the served model's architecture
    (`check_config`: its `config.json` too, not only its tensors; blocking; raises
    `WeightLoadError` saying what differs)."""
    if load_format not in LOAD_FORMATS:
        formats = ", ".join(str(f) for f in LOAD_FORMATS if f)
        raise WeightLoadError(
            f"load_format {load_format!r} is not supported by the development server "
            f"(use one of {formats})"
        )
    if not (path / "config.json").is_file():
        raise WeightLoadError(f"{path} is not a model directory (it has no config.json)")
    from transformers import AutoConfig

    try:
        new_config = AutoConfig.from_pretrained(str(path)).to_dict()
        served_config = AutoConfig.from_pretrained(str(engine.weights_path)).to_dict()
    except Exception as e:  # an unreadable or malformed config.json
        raise WeightLoadError(f"the config at {path} cannot be read: {e}") from e
    differing = config_differences(served_config, new_config)
    if differing and check_config:
        shown = ", ".join(differing[:10]) + (", ..." if len(differing) > 10 else "")
        raise WeightLoadError(
            f"the model at {path} does not have the served model's architecture: its "
            f"config.json differs in {shown}"
        )
    import torch
    from transformers import AutoModelForCausalLM

    model: Any
    info: dict[str, Any]
    try:
        model, info = AutoModelForCausalLM.from_pretrained(  # type: ignore[misc]
            str(path),
            dtype=torch.float32,
            use_safetensors=LOAD_FORMATS[load_format],
            output_loading_info=True,
        )
    except Exception as e:  # a missing or corrupt checkpoint: say so, keep the old weights
        raise WeightLoadError(f"the weights at {path} cannot be loaded: {e}") from e
    kinds = ("missing_keys", "unexpected_keys", "mismatched_keys")
    problems = {k: sorted(map(str, info[k]))[:5] for k in kinds if info.get(k)}
    if problems:
        raise WeightLoadError(
            f"the checkpoint at {path} does not fit the served model: "
            + "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in problems.items())
        )
    served = {k: tuple(v.shape) for k, v in engine.model.state_dict().items()}
    loaded = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if served != loaded:
        raise WeightLoadError(f"the tensors at {path} differ in name or shape from the served ones")
    return model.eval()


class WeightGate:
    """Admission of requests around weight updates: an update (or vLLM's pause) holds new
    requests back and waits until those in flight have finished."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._updates = 0
        self.paused = False

    @property
    def active(self) -> int:
        """Requests being served now."""
        return self._active

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Await `work` as one request: once no update or pause holds requests back."""
        try:
            async with self._cond:
                await self._cond.wait_for(lambda: not self.paused and not self._updates)
                self._active += 1
        except BaseException:  # cancelled while held back (the client went away)
            work.close()
            raise
        try:
            return await work
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold new requests back and wait until none is in flight (SGLang's writer lock)."""
        async with self._cond:
            self._updates += 1
        try:
            async with self._cond:
                await self._cond.wait_for(lambda: self._active == 0)
            yield
        finally:
            async with self._cond:
                self._updates -= 1
                self._cond.notify_all()

    async def pause(self, *, wait: bool) -> None:
        """Hold new requests back; with `wait`, return once none is in flight."""
        async with self._cond:
            self.paused = True
            if wait:
                await self._cond.wait_for(lambda: self._active == 0)

    async def resume(self) -> None:
        async with self._cond:
            self.paused = False
            self._cond.notify_all()


class WeightUpdater:
    """The weight-update operations of one development server."""

    def __init__(self, server: DevServer) -> None:
        self.server = server
        self.gate = WeightGate()
        self.weight_version = "default"
        """SGLang's `weight_version` (its default is `"default"`)."""

    @property
    def engine(self) -> ModelEngine:
        engine = self.server.engine
        if not isinstance(engine, ModelEngine):
            raise WeightLoadError("this engine has no weights to replace")
        return engine

    def flush_cache(self) -> None:
        """Forget every cached prefix (nothing computed with old weights is reused)."""
        self.server.metrics.prefix_cache.clear()

    async def _swap(self, model: Any, path: Path) -> None:
        """Put `model` in place once the sequence being generated (if any) has ended."""
        async with self.server._lock:
            engine = self.engine
            engine.model = model
            engine.weights_path = path

    async def update_from_disk(self, req: UpdateWeightFromDiskReqInput) -> dict[str, Any]:
        """SGLang's update; raises `WeightLoadError` with the old weights kept."""
        path = Path(req.model_path)
        model = await asyncio.to_thread(read_weights, self.engine, path, req.load_format)
        if req.abort_all_requests:
            self.server.abort("", abort_all=True)
        async with self.gate.exclusive():
            await self._swap(model, path)
            if req.flush_cache:
                self.flush_cache()
        message = SUCCESS_MESSAGE
        if req.weight_version is not None:
            self.weight_version = req.weight_version
            message += f" Weight version updated to {req.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": 0}

    async def reload_weights(self, weights_path: str | None, *, check: bool = True) -> None:
        """vLLM's worker `reload_weights` (`check=False`: the architecture is not compared,
        only the tensors must fit) or rollserve's `rollserve_load_weights`: the weights at
        `weights_path` (the served directory when None) replace the served ones between two
        sequences."""
        path = self.engine.weights_path if weights_path is None else Path(weights_path)
        model = await asyncio.to_thread(read_weights, self.engine, path, check_config=check)
        await self._swap(model, path)

    def model_info(self) -> dict[str, Any]:
        """SGLang's `/model_info` answer."""
        engine = self.engine
        config = engine.model.config
        return {
            "model_path": str(engine.weights_path),
            "tokenizer_path": str(engine.model_dir),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }


def attach_weight_routes(app: FastAPI, updater: WeightUpdater) -> None:
    """SGLang's and vLLM's weight-update routes on the development server's `app`."""

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            req = UpdateWeightFromDiskReqInput.model_validate(body)
        except ValueError as e:  # not JSON, or not the request: FastAPI's 422, as SGLang
            detail = e.errors(include_context=False) if isinstance(e, ValidationError) else str(e)
            return JSONResponse({"detail": detail}, status_code=422)
        try:
            return JSONResponse(await updater.update_from_disk(req))
        except WeightLoadError as e:
            message = f"Failed to update weights: {e}. The served weights are kept."
            body = {"success": False, "message": message, "num_paused_requests": 0}
            return JSONResponse(body, status_code=400)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse(updater.model_info())

    @app.post("/pause")
    async def pause(
        mode: Literal["abort", "wait", "keep"] = Query("abort"), clear_cache: bool = Query(True)
    ) -> JSONResponse:
        if mode == "abort":
            updater.server.abort("", abort_all=True)
        await updater.gate.pause(wait=True)
        if clear_cache and mode != "keep":
            updater.flush_cache()
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        await updater.gate.resume()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": updater.gate.paused})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        updater.flush_cache()
        return JSONResponse({"success": True})

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> JSONResponse:
        # vLLM's checks and messages. The worker methods served: `reload_weights`
        # (`weights_path`) and rollserve's worker extension's `rollserve_load_weights`.
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            raise HTTPException(400, f"JSON decode error: {e}") from e
        if not isinstance(body, dict):
            raise HTTPException(400, "Request body must be a JSON object")
        method = body.get("method")
        if method is None:
            raise HTTPException(400, "Missing 'method' in request body")
        try:
            result = await _worker_call(updater, method, body.get("args"), body.get("kwargs"))
        except (WeightLoadError, TypeError) as e:
            message = (
                f"Call to collective_rpc method failed: Worker failed with error '{e}', "
                "please check the stack trace above for the root cause"
            )
            body = error_body(message, 500, kind="InternalServerError")
            return JSONResponse(body, status_code=500)
        return JSONResponse({"results": [result]})


async def _worker_call(updater: WeightUpdater, method: Any, args: Any, kwargs: Any) -> Any:
    """What one vLLM worker answers to `method(*args, **kwargs)`."""
    args = [] if args is None else args
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise TypeError("args must be a list and kwargs an object")
    if method == "reload_weights" and not args and set(kwargs) <= {"weights_path"}:
        path = kwargs.get("weights_path")
        if path is not None and not isinstance(path, str):
            raise TypeError("weights_path must be a string")
        await updater.reload_weights(path, check=False)
        return None
    if method == "rollserve_load_weights":
        given = [*args, *kwargs.values()]
        if len(given) != 1 or set(kwargs) - {"weights_path"} or not isinstance(given[0], str):
            raise TypeError("rollserve_load_weights takes one argument, weights_path (a string)")
        try:
            await updater.reload_weights(given[0])
        except WeightLoadError as e:  # checked before the swap: refused, as the extension says
            raise WeightLoadError(f"{REFUSED}: {e}") from e
        return {"weights_path": given[0], "refreshed": []}
    raise WeightLoadError(f"'DevServer' object has no attribute {method!r}")
