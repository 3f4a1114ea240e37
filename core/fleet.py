"""The wire format of the inference fleet: registering backends, drain and resume, weight
updates (re-exported by `core.schemas`, the one place the wire format is imported from)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, field_validator

from core.values import MAX_POLICY_VERSION, Text


class BackendSpec(BaseModel):
    """Body of `POST /v1/backends`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    url: str = Field(pattern=r"^https?://[^\s/]+(:\d+)?(/[^\s]*)?$", max_length=2048)
    """Base URL of the inference server, e.g. `http://gpu-node-3:8000`: `http` or `https`, a
    host (a DNS name or an IP address, in ASCII), an optional port and path; no credentials,
    query or fragment."""
    kind: Literal["vllm", "sglang"] = "vllm"
    model: Text = Field(min_length=1, max_length=1024)
    """Model name the server serves (its `--served-model-name`)."""
    id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    """Stable id; derived from the URL when absent."""
    policy_version: int | None = Field(default=None, ge=0, le=MAX_POLICY_VERSION)
    """Version of the weights this server holds; copied into trajectories."""
    api: Literal["completions", "generate"] = "completions"
    """vLLM only: `completions` speaks `/v1/completions` (token ids in, `return_token_ids`),
    `generate` speaks `/inference/v1/generate` (tokens in, tokens out). SGLang always speaks
    its native `/generate`."""
    capacity: float = Field(default=1.0, gt=0.0, le=1e6)
    """Relative capacity (e.g. GPUs or batch slots): a backend with capacity 2 is assigned
    twice the jobs of one with capacity 1 before it counts as equally loaded."""
    tokenizer: Text | None = Field(default=None, min_length=1, max_length=1024)
    """SGLang only: the Hugging Face tokenizer (a path on the workers, or a hub name they can
    load) that renders chat templates, since SGLang's `/tokenize` cannot; `model` when
    absent. vLLM renders through its own `/tokenize`."""
    api_key: str | None = Field(default=None, pattern=r"^[!-~]{8,512}$")
    """The bearer token the server asks for (vLLM's and SGLang's `--api-key`; the servers
    `rollserve up` starts always have one). Workers send it with every request; it is never
    shown back (`GET /v1/backends` says only `api_key_set`)."""

    # The `after` check is defined before `_mask_credentials`, which makes the masking run
    # first and every error about the URL (pattern, length, this check) show the masked
    # value, never the credentials.
    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        """Parse the URL (urllib's parser) and refuse what a backend URL cannot be."""
        import ipaddress
        import re
        from urllib.parse import urlsplit

        if not value.isascii() or not value.isprintable() or " " in value or "\\" in value:
            raise ValueError(
                "must be printable ASCII without spaces or backslashes (write an international "
                "host name in its xn-- form)"
            )
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError:
            raise ValueError("is not a valid URL (host or port malformed)") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError("must start with http:// or https://")
        if "@" in parts.netloc:
            raise ValueError(
                "must not carry credentials (user:password@): backend records hold no "
                "secrets; serve the backend on a network only the workers reach"
            )
        if "?" in value or "#" in value:
            raise ValueError("must not have a query or a fragment")
        host = parts.hostname
        if not host:
            raise ValueError("needs a host")
        if port == 0:
            raise ValueError("has port 0")
        if ":" in host or re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError("has a host that is not a valid IP address") from None
        else:
            label = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
            if len(host) > 253 or not re.fullmatch(rf"{label}(?:\.{label})*\.?", host):
                raise ValueError("has a host that is not a valid DNS name")
        if not re.fullmatch(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*", parts.path):
            raise ValueError("has characters a URL path cannot hold")
        return value

    @field_validator("url", mode="before")
    @classmethod
    def _mask_credentials(cls, value: Any) -> Any:
        """`user:password@` in the URL becomes `***@`: the value is refused by `_check_url`,
        and the 422 shows this masked form."""
        import re

        if not isinstance(value, str):
            return value
        # Text that cannot be encoded (lone surrogates) is shown escaped; refused anyway.
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
        if "@" not in value:
            return value
        masked = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@", r"\1***@", value)
        if re.fullmatch(r"https?://(\*\*\*@)?[^/?#@]*(/[^?#]*)?", masked):
            return masked  # `@` left, if any, is in the path
        return re.sub(r"[^/@]*@", "***@", masked)  # refused anyway: mask every `...@`


class ResumeRequest(BaseModel):
    """Body of `POST /v1/backends/{id}/resume` and `POST /v1/backends/resume` (optional)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    policy_version: int | None = Field(default=None, ge=0, le=MAX_POLICY_VERSION)
    """The version of the weights the backend now holds; every later turn records it."""


MAX_WEIGHT_UPDATE_TIMEOUT = 3600.0
"""Longest `timeout` of a weight update, in seconds."""


class WeightUpdateRequest(BaseModel):
    """Body of `POST /v1/backends/update_weights`: drain, load `model_path`, resume with
    `policy_version`, on every backend named (all when `backends` is absent)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model_path: Text = Field(min_length=1, max_length=4096)
    """A checkpoint directory (Hugging Face format) on the inference servers' machines."""
    policy_version: int = Field(ge=0, le=MAX_POLICY_VERSION)
    """The version of the new weights; every later turn records it."""
    backends: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]] | None = Field(
        default=None, min_length=1, max_length=1024
    )
    """Backend ids to update; None: every registered backend."""
    timeout: float = Field(default=600.0, gt=0.0, le=MAX_WEIGHT_UPDATE_TIMEOUT)
    """Seconds each backend may take to become idle and then to load (each, separately)."""


class Backend(BaseModel):
    """A registered inference server as `GET /v1/backends` shows it."""

    id: str
    url: str
    kind: Literal["vllm", "sglang"]
    model: str
    policy_version: int | None = None
    api: Literal["completions", "generate"] = "completions"
    capacity: float = 1.0
    tokenizer: str | None = None
    in_flight: int = 0
    """Jobs currently holding this backend."""
    state: Literal["healthy", "draining", "dead"] = "healthy"
    """`healthy` takes jobs; `draining` takes none and lets running requests finish;
    `dead` failed its health checks (or a request) and is re-admitted when it answers."""
    idle: bool = True
    """No job holds it: after a drain, the moment weights can be swapped."""
    failures: int = 0
    """Consecutive failed health checks."""
    registered_at: float
    max_model_len: int | None = None
    """The context length the server reported when it was registered (`max_model_len` of
    its `/v1/models`); None when unknown (not reported, or registered with `verify=false`)."""
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    """The server's bearer token, for the workers' requests; never serialised."""
    weights_path: str | None = None
    """The checkpoint its last weight update loaded (None: the weights it was started with).
    An engine that restarts is loaded with it again before it takes work."""
    started_at: float | None = None
    """When the engine's process started, as its `/metrics` says
    (`process_start_time_seconds`); a new value means it restarted."""
    note: str | None = None
    """Why the service drained it on its own (an engine that restarted and is being loaded
    with its weights again, or could not be), until it takes work again."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def api_key_set(self) -> bool:
        """Whether requests to the server carry a bearer token."""
        return self.api_key is not None


class BackendWeightUpdate(BaseModel):
    """How one backend's weight update went."""

    id: str
    ok: bool
    """Loaded and resumed with the new policy version; False: it stays drained."""
    drain_seconds: float
    """From the drain until no job held it."""
    load_seconds: float | None = None
    """The engine's load (None when it was not reached)."""
    total_seconds: float
    error: str | None = None
    """Why it failed, naming what the engine said."""


class WeightUpdateReport(BaseModel):
    """Answer of `POST /v1/backends/update_weights`."""

    model_path: str
    policy_version: int
    ok: bool
    """Every backend took the new weights."""
    backends: list[BackendWeightUpdate]
    error: str | None = None
    """Which backends failed, when any did."""
