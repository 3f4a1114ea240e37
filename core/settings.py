"""The one settings object: every knob is a ``ROLLSERVE_*`` environment variable."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.egress import HostRule, parse_allow_list

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str | None) -> tuple[IPNetwork, ...]:
    """The networks of a comma-separated CIDR list (empty for None or blank text).

    Raises ValueError naming the first entry that is not a network.
    """
    if text is None:
        return ()
    networks: list[IPNetwork] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(
                f"{item!r} is not a network in CIDR notation (e.g. 10.0.0.0/8 or fd00::/8)"
            ) from None
    return tuple(networks)


class Settings(BaseSettings):
    """rollserve configuration, read from ``ROLLSERVE_*`` environment variables."""

    # Errors never echo values: tokens and URLs with passwords are among them.
    model_config = SettingsConfigDict(
        env_prefix="ROLLSERVE_", extra="ignore", hide_input_in_errors=True
    )

    redis_url: str | None = None
    """Redis for the broker and the job store. Unset: an embedded Redis is started."""
    data_dir: Path = Path(".rollserve")
    """Working files of `rollserve up`: the embedded Redis's data directory, logs."""
    redis_maxmemory: str = "25%"
    """Memory cap of the embedded Redis: a size (`4gb`, `512mb`), a share of this machine's
    RAM (`25%`) or `0` for none. It runs with `maxmemory-policy noeviction`, so job state is
    never evicted: when full, writes are refused and the gateway answers 503."""
    key_prefix: str = "rs:"
    """Prefix of every Redis key the job store and the backend pool write."""

    url: str = "http://127.0.0.1:8600"
    """Where client commands (`submit`, `status`) find the gateway."""
    host: str = "127.0.0.1"
    """Interface the gateway binds."""
    port: int = 8600
    """Port the gateway binds."""
    api_token: str | None = None
    """When set, every /v1 request (and `/metrics`) needs `Authorization: Bearer <token>`.
    It is the operator's (admin's) token: the only one that may change the fleet (backends,
    weights), see the fleet pages and every tenant's work."""
    tenant_tokens: str | None = None
    """More bearer tokens, one per tenant: `name:token,name:token`. Each tenant has its own
    quota of unfinished jobs (`ROLLSERVE_MAX_QUEUED_JOBS`) and sees, streams and cancels only
    its own batches and rollouts; `ROLLSERVE_API_TOKEN` is the tenant `default`."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body the gateway accepts (413 beyond)."""
    max_wait_seconds: float = 600.0
    """Longest a `?wait=true` request blocks before answering with the job as it is."""
    max_jobs_per_request: int = Field(default=10_000, ge=1)
    """Most jobs one submission may create (tasks x group size; for dynamic sampling, the
    groups in flight x group size); a bigger request is refused with a 413."""
    max_task_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    """Largest task (its JSON) a submission may carry; a bigger one is refused with a 413.
    A task is stored once per group, however many samples it has."""
    max_queued_jobs: int = Field(default=100_000, ge=1)
    """Most unfinished jobs one tenant (one API token, or everyone without a token) may have;
    a submission past it is refused with a 429."""
    broker_send_timeout: float = Field(default=30.0, gt=0)
    """Seconds a submission waits for a connection to the broker before it is refused with a
    503 (the broker is saturated or unreachable); nothing of it is kept."""

    init_soft_time_limit: float = 300.0
    """Seconds INIT may run before it is stopped and the job is timed out."""
    init_time_limit: float = 330.0
    """Hard limit for INIT: the worker process is killed past it."""
    run_soft_time_limit: float = 1800.0
    """Seconds RUN (the whole agent loop) may run."""
    run_time_limit: float = 1860.0
    """Hard limit for RUN."""
    eval_soft_time_limit: float = 600.0
    """Seconds EVAL may run."""
    eval_time_limit: float = 660.0
    """Hard limit for EVAL."""
    visibility_timeout: float | None = None
    """Seconds until Redis redelivers an unacked task (default: longest hard limit + 600)."""
    redelivery_check_interval: float = 10.0
    """Seconds between a worker's sweeps for tasks past the visibility timeout to redeliver."""
    redis_retry_seconds: float = Field(default=30.0, ge=0)
    """Seconds a worker's job-store commands keep retrying a lost Redis (reconnecting with
    backoff) before they fail: long enough for a restart or a replica's promotion. The gateway
    retries for at most 2 s of it, then answers 503."""
    broker_connection_max_retries: int = Field(default=10, ge=1)
    """Times a worker tries to reach a lost broker again (waiting 2, 4, ... up to 30 s between
    tries: 10 is about two minutes) before it exits with an error, for its supervisor to
    restart, instead of hanging."""
    result_expires: int = 86400
    """Seconds Celery keeps task results; job records expire after `job_ttl`."""
    job_ttl: int = 7 * 86400
    """Seconds a job's record stays in Redis (a finished job's, until it is delivered)."""
    results_dir: Path | None = None
    """Where finished trajectories are kept once they leave Redis (JSON Lines by batch and
    hour). Unset: `results` under `data_dir`. Every worker and gateway must see the same one
    (a shared file system), unless `results_url` is set."""
    results_url: str | None = None
    """`s3://bucket/prefix`: keep finished trajectories in an S3-compatible bucket instead of
    `results_dir` (needs the `s3` extra; credentials from the usual AWS settings)."""
    results_s3_endpoint: str | None = None
    """The S3 endpoint URL, for a server other than AWS (MinIO, Ceph...)."""
    results_keep: int = Field(default=7 * 86400, ge=3600)
    """Seconds finished trajectories are kept in the results store (pruned by the hour)."""
    results_stub_ttl: int = Field(default=600, ge=1)
    """Seconds a finished job's record stays in Redis once its trajectory was delivered (read
    by `GET /v1/rollouts/{id}` or streamed past); later reads find it in the results store."""

    backend_timeout: float = 600.0
    """Seconds one inference request may take."""
    backend_retries: int = 3
    """Attempts per inference request on connection errors and 5xx answers."""

    health_interval: float = 5.0
    """Seconds between health checks (`GET /health`) of every registered backend."""
    health_failures: int = Field(default=3, ge=1)
    """Consecutive failed health checks after which a backend gets no more work (it is
    re-admitted when a check succeeds)."""
    backend_wait: float = 600.0
    """Seconds a job waits between turns while no backend takes work (all draining for a
    weight update, or dead) before it fails."""
    backend_failovers: int = Field(default=3, ge=0)
    """Times one request is re-sent to another backend after losing its own (connection
    refused or reset, no answer)."""
    backend_networks: str | None = None
    """Networks inference backends may be registered in: comma-separated CIDRs (e.g.
    `10.0.0.0/8,127.0.0.0/8`), checked against every address a backend's host resolves to.
    Unset: any address but link-local and cloud metadata ones (169.254.0.0/16, fe80::/10),
    which are allowed only when a listed network lies within their range."""

    node_name: str = Field(default_factory=socket.gethostname)
    """This worker node's name: sandboxed jobs run RUN (and EVAL, when it grades in the
    sandbox) on the node whose INIT started their sandbox, through queues `run.<node>`."""
    sandbox_backend: str = "auto"
    """Where tool-using jobs run: `bwrap`, `apptainer`, `local` (no isolation) or `auto`."""
    sandbox_dir: Path = Path(".rollserve/sandboxes")
    """This host's sandbox state: one directory per live sandbox (sockets, workspaces)."""
    sandbox_memory_mb: int = Field(default=4096, ge=32)
    """MiB of memory one sandbox holds as a whole: all its processes together, and what they
    write to /tmp, /dev/shm and a workspace on the box's own disk (one cgroup per box, where
    the host enforces it: `GET /v1/stats` says). Past it the kernel kills one of the box's
    processes. A task may ask for less (`sandbox.limits.memory_mb`)."""
    sandbox_pids: int = Field(default=512, ge=16)
    """Processes and threads one sandbox may have at once, all together; a fork past it
    fails. A task may ask for fewer (`sandbox.limits.pids`)."""
    sandbox_cpu_shares: int = Field(default=1024, ge=2, le=262_144)
    """A sandbox's weight against the others when the CPUs are contended (cgroup v1
    `cpu.shares`, 1024 being one equal share; cgroup v2 `cpu.weight` is derived from it)."""
    sandbox_disk_mb: int = Field(default=2048, ge=1)
    """MiB one sandbox's workspace, /tmp and /dev/shm hold together (a tmpfs of its own per
    box, where the service may mount one: as root); a write past it fails with ENOSPC. Those
    pages are memory, counted against `sandbox_memory_mb` too, so keep this below it. A task
    may ask for less (`sandbox.limits.disk_mb`)."""
    sandbox_inodes: int = Field(default=262_144, ge=64)
    """Files and directories one sandbox's workspace, /tmp and /dev/shm hold together (the
    same tmpfs). A task may ask for fewer (`sandbox.limits.inodes`)."""
    sandbox_allow_local: bool = False
    """Let `ROLLSERVE_SANDBOX_BACKEND=auto` fall back to `local` (no isolation: the agent's
    commands run as the service) where neither apptainer nor bwrap works. Unset, it never
    does: tool-using jobs fail saying what is missing."""
    sandbox_allow_unlimited: bool = False
    """Let a box start where this host cannot hold its memory and process limits (no
    cgroups for boxes: not root, no delegated cgroup v2 subtree); it then has per-process
    rlimits only. Unset, such a box does not start."""
    sandbox_extra_paths: str | None = None
    """Host paths bubblewrap boxes see read-only besides the minimal root (the system's
    programs and libraries, the parts of /etc they read): absolute paths separated by `,` or
    `:`. The bwrap backend reads this variable from the environment of the process that makes
    the boxes."""
    cancel_grace: float = Field(default=1.0, ge=0.0)
    """Seconds a cancelled job's running stage gets to stop by itself (RUN notices within one
    turn) before it is terminated (Celery revoke with terminate, which costs a pool process)."""
    jobs_poll: float = Field(default=0.5, gt=0.0)
    """Seconds between the checks a many-jobs RUN worker (`--jobs N`) makes of whether its
    in-flight jobs are still live (one batched read for all of them)."""
    jobs_grace: float = Field(default=10.0, ge=0.0)
    """Seconds a cancelled job's task on a many-jobs RUN worker may take to stop before it is
    reported as ignoring cancellation."""
    reap_interval: float = 30.0
    """Seconds between a worker's sweeps for sandboxes whose job ended or whose lease expired."""
    tool_timeout: float = 120.0
    """Default seconds for one bash or ipython call of an agent."""
    harness_tool_parser: str = "hermes"
    """How a harness job's endpoint reads tool calls out of the generated text: the served
    model family's convention (`hermes`, `qwen3`, `qwen2.5`)."""
    session_host: str = "127.0.0.1"
    """The address a RUN worker serves a session's endpoint on (a free port), for the gateway
    to relay the caller's requests to: this node's address the gateways reach (loopback on
    one machine)."""
    session_wait: float = Field(default=120.0, gt=0)
    """Seconds the gateway holds a session's request while the session is still starting
    (queued, its sandbox coming up) before it answers 503."""
    harness_port: int = Field(default=4000, ge=1024, le=65535)
    """The loopback port inside a harness job's box at which its endpoint answers
    (`OPENAI_BASE_URL=http://127.0.0.1:PORT/v1`)."""
    heartbeat_interval: float = Field(default=5.0, gt=0)
    """Seconds between a worker's heartbeats (one key per worker process and per node)."""
    heartbeat_ttl: float = Field(default=20.0, gt=0)
    """Seconds a heartbeat lives: a worker (or a node) silent this long is taken as dead and
    the stages it held are sent again."""
    sweep_interval: float = Field(default=10.0, gt=0)
    """Seconds between sweeps for stages of dead workers, stages past their hard limit or
    their job's time budget, and jobs pinned to a dead node (one worker of the fleet sweeps
    per interval)."""
    max_attempts: int = Field(default=3, ge=1)
    """Times a job may be started on a stage whose worker or node then died (the first try
    counts); past it the job fails."""
    max_seconds_limit: float = Field(default=86400.0, gt=0)
    """Largest `agent.max_seconds` (a job's time budget across its stages) a request may ask."""

    # `rollserve autoscale`: the fleet autoscaler (deploy/autoscale).
    autoscale_interval: float = Field(default=5.0, gt=0)
    """Seconds between the autoscaler's decisions."""
    autoscale_concurrency: int = Field(default=1, ge=1)
    """Prefork processes (jobs at once) of each worker the autoscaler starts."""
    autoscale_run_jobs: int = Field(default=0, ge=0)
    """With N > 0, each RUN worker the autoscaler starts holds N jobs on one event loop
    (`rollserve worker run --jobs N`) instead of `autoscale_concurrency` processes."""
    autoscale_target_busy_share: float = Field(default=0.8, gt=0, le=1)
    """Share of the workers' slots that waiting and running jobs should fill: the
    autoscaler starts workers until they do."""
    autoscale_scale_out_cooldown: float = Field(default=10.0, ge=0)
    """Seconds after the autoscaler started workers on a queue before it starts more."""
    autoscale_scale_in_cooldown: float = Field(default=60.0, ge=0)
    """Seconds demand must stay low, and since the last change, before the autoscaler
    stops workers of a queue (each by warm shutdown: it finishes its jobs)."""
    sandbox_egress_allow: str | None = None
    """Hosts a sandbox with network may ever connect to: comma-separated host names and
    suffix patterns (`pypi.org,*.pythonhosted.org`), each with an optional `:port` (without
    one: 443 and 80). A task names the hosts it needs in `egress`; one outside this list is
    refused at submission. Unset: a box with network reaches no host outside."""
    sandbox_egress_networks: str | None = None
    """Private networks (comma-separated CIDRs, e.g. `10.20.0.0/16`) an allowed host of a
    box with network may resolve into: an internal mirror. Unset: a host that resolves to a
    private address (10/8, 172.16/12, 192.168/16, 100.64/10...) is refused. Loopback,
    link-local, cloud metadata and this host's own addresses are refused whatever it says."""
    swe_repo_roots: str | None = None
    """Directories `swe` tasks may name host repositories (`environment.repo_path`) under:
    absolute paths separated by `,` or `:`. Unset: tasks with a host repository are
    refused."""
    swe_image_roots: str | None = None
    """Directories `swe` tasks may name an image file or root directory
    (`environment.image`) under: absolute paths separated by `,` or `:`, resolved like
    `ROLLSERVE_SWE_REPO_ROOTS`. Unset: an image given as a path is refused (an image URI,
    `docker://...`, is not a path). Never the host's homes, /root, /run or the service's
    data and sandbox directories, whatever the roots say."""
    tokenizer_roots: str | None = None
    """Directories a backend's `tokenizer` (and an SGLang backend's model, which names its
    tokenizer when `tokenizer` is unset) may name local tokenizers under: absolute paths
    separated by `,` or `:`. The tiny model of the development server is always allowed, and
    so is a Hugging Face hub id already in the local cache; nothing is ever downloaded."""

    max_tokens: int = 1024
    """Default `sampling.max_tokens` (tokens per model call)."""
    max_turns: int = 8
    """Default `agent.max_turns`."""
    max_total_tokens: int = 8192
    """Default `agent.max_total_tokens` (all response ids of one job)."""

    dev_backend_port: int = 8601
    """Port of the development inference server that `rollserve up` starts."""
    tiny_model_dir: Path = Path(".rollserve/tiny-qwen3")
    """Where `up`/`demo` keep the tiny random Qwen3 model of the development server."""

    @field_validator("redis_maxmemory")
    @classmethod
    def _check_maxmemory(cls, value: str) -> str:
        maxmemory_bytes(value)  # raises ValueError naming the accepted forms
        return value

    @field_validator("backend_networks", "sandbox_egress_networks")
    @classmethod
    def _check_backend_networks(cls, value: str | None) -> str | None:
        parse_networks(value)  # raises ValueError naming the entry that is not a network
        return value

    @field_validator("sandbox_egress_allow")
    @classmethod
    def _check_sandbox_egress_allow(cls, value: str | None) -> str | None:
        parse_allow_list(value)  # raises ValueError naming the entry that is not a host
        return value

    @field_validator("swe_repo_roots", "tokenizer_roots", "swe_image_roots")
    @classmethod
    def _check_swe_repo_roots(cls, value: str | None) -> str | None:
        for root in _split_roots(value):
            if not os.path.isabs(root):
                raise ValueError(f"{root!r} is not an absolute path")
            if os.path.normpath(root) == os.sep:
                raise ValueError(
                    "/ would allow every path; name the directories of the repositories"
                )
        return value

    @field_validator("sandbox_extra_paths")
    @classmethod
    def _check_sandbox_extra_paths(cls, value: str | None) -> str | None:
        for path in _split_roots(value):
            if not os.path.isabs(path):
                raise ValueError(f"{path!r} is not an absolute path")
        return value

    @field_validator("tenant_tokens")
    @classmethod
    def _check_tenant_tokens(cls, value: str | None) -> str | None:
        if value is not None:
            parse_tenant_tokens(value)
        return value

    def tokens(self) -> dict[str, str]:
        """Every accepted bearer token with its tenant's name (empty: no auth)."""
        tokens = parse_tenant_tokens(self.tenant_tokens or "")
        if self.api_token:
            tokens[self.api_token] = "default"
        return tokens

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        if any(token.strip().upper() in PLACEHOLDER_TOKENS for token in self.tokens()):
            raise ValueError(
                "a token (ROLLSERVE_API_TOKEN or ROLLSERVE_TENANT_TOKENS) is still the "
                "placeholder CHANGE-ME of the example files: set a secret of your own, e.g. "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        if self.tenant_tokens and not self.api_token:
            raise ValueError(
                "ROLLSERVE_TENANT_TOKENS needs ROLLSERVE_API_TOKEN too: it is the operator's "
                "token, which the local stack and Flower use"
            )
        for stage in ("init", "run", "eval"):
            soft = getattr(self, f"{stage}_soft_time_limit")
            hard = getattr(self, f"{stage}_time_limit")
            if soft >= hard:
                raise ValueError(
                    f"ROLLSERVE_{stage.upper()}_SOFT_TIME_LIMIT ({soft}) must be below "
                    f"ROLLSERVE_{stage.upper()}_TIME_LIMIT ({hard})"
                )
        if self.heartbeat_ttl <= self.heartbeat_interval:
            raise ValueError(
                f"ROLLSERVE_HEARTBEAT_TTL ({self.heartbeat_ttl}) must exceed "
                f"ROLLSERVE_HEARTBEAT_INTERVAL ({self.heartbeat_interval}), "
                "or live workers are taken as dead"
            )
        if (
            self.visibility_timeout is not None
            and self.visibility_timeout <= self.longest_hard_limit
        ):
            raise ValueError(
                f"ROLLSERVE_VISIBILITY_TIMEOUT ({self.visibility_timeout}) must exceed the longest "
                f"hard time limit ({self.longest_hard_limit}), "
                "or tasks are redelivered while they run"
            )
        return self

    def as_env(self) -> dict[str, str]:
        """These settings as `ROLLSERVE_*` variables, for child processes to read back."""
        env = {}
        for name, value in self.model_dump().items():
            if value is not None:
                env[f"ROLLSERVE_{name.upper()}"] = str(value)
        return env

    @property
    def backend_network_list(self) -> tuple[IPNetwork, ...]:
        """`backend_networks` parsed (empty when unset)."""
        return parse_networks(self.backend_networks)

    @property
    def sandbox_egress_cap(self) -> tuple[HostRule, ...]:
        """`sandbox_egress_allow` parsed (empty when unset)."""
        return parse_allow_list(self.sandbox_egress_allow)

    @property
    def swe_repo_root_list(self) -> tuple[Path, ...]:
        """`swe_repo_roots` as paths, symlinks resolved (empty when unset)."""
        return tuple(Path(os.path.realpath(root)) for root in _split_roots(self.swe_repo_roots))

    @property
    def tokenizer_root_list(self) -> tuple[Path, ...]:
        """`tokenizer_roots` as paths, symlinks resolved (empty when unset)."""
        return tuple(Path(os.path.realpath(root)) for root in _split_roots(self.tokenizer_roots))

    @property
    def swe_image_root_list(self) -> tuple[Path, ...]:
        """`swe_image_roots` as paths, symlinks resolved (empty when unset)."""
        return tuple(Path(os.path.realpath(root)) for root in _split_roots(self.swe_image_roots))

    @property
    def results_path(self) -> Path:
        """`results_dir`, or `results` under the data directory."""
        return self.results_dir or self.data_dir / "results"

    @property
    def longest_hard_limit(self) -> float:
        return max(self.init_time_limit, self.run_time_limit, self.eval_time_limit)

    @property
    def effective_visibility_timeout(self) -> float:
        if self.visibility_timeout is not None:
            return self.visibility_timeout
        return self.longest_hard_limit + 600.0


def _split_roots(value: str | None) -> list[str]:
    """The entries of a `,`- or `os.pathsep`-separated list of paths."""
    if not value:
        return []
    return [part.strip() for part in re.split(f"[,{re.escape(os.pathsep)}]", value) if part.strip()]


PLACEHOLDER_TOKENS = frozenset({"CHANGE-ME", "CHANGEME", "CHANGE_ME"})
"""Tokens of the shipped example files, refused as real ones."""


def parse_tenant_tokens(text: str) -> dict[str, str]:
    """`name:token,name:token` as {token: name}; a ValueError naming what is malformed."""
    tokens: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, token = item.partition(":")
        name, token = name.strip(), token.strip()
        if not sep or not token or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(
                "ROLLSERVE_TENANT_TOKENS must be `name:token,...` with names of letters, digits, "
                "`_`, `.` or `-` (the token is not shown)"
            )
        if token in tokens:
            raise ValueError(f"ROLLSERVE_TENANT_TOKENS gives tenant {name!r} a token in use")
        if name == "default":
            raise ValueError(
                "ROLLSERVE_TENANT_TOKENS names a tenant `default`: that is the operator's "
                "(ROLLSERVE_API_TOKEN); give the tenant another name"
            )
        tokens[token] = name
    return tokens


_MEMORY_RE = re.compile(r"(?i)\s*(\d+(?:\.\d+)?)\s*(%|b|k|kb|m|mb|g|gb|t|tb)?\s*")
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1024,
    "m": 1000**2, "mb": 1024**2,
    "g": 1000**3, "gb": 1024**3,
    "t": 1000**4, "tb": 1024**4,
}  # fmt: skip


def total_memory() -> int:
    """Bytes of physical memory on this machine."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def maxmemory_bytes(value: str) -> int:
    """A memory cap as Redis spells it (`4gb`, `512mb`, `1000000`) or a share of this
    machine's RAM (`25%`), in bytes; `0` means no cap."""
    match = _MEMORY_RE.fullmatch(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not a memory size: use a number of bytes with an optional unit "
            "(b, kb, mb, gb, tb; k, m, g, t for powers of 1000) or a share of RAM such as 25%"
        )
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if unit == "%":
        if number > 100:
            raise ValueError(f"{value!r}: a share of RAM cannot exceed 100%")
        return int(total_memory() * number / 100)
    return int(number * _UNITS[unit])


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
