"""The deployment recipes agree with the code they deploy: the Kubernetes manifests, the
Apptainer definition and the systemd units name real commands, flags, settings and queues.

No kubectl, kubeconform or apptainer runs here; `systemd-analyze verify` does where it is
installed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import stat
import subprocess
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.routes.system import open_router
from broker.celery_app import QUEUES, TASK_NAMES, create_celery
from core.settings import Settings
from deploy.cli import build_parser
from deploy.stack import gateway_bind_refusal

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SYSTEMD = ROOT / "deploy" / "systemd"
APPTAINER_DEF = ROOT / "deploy" / "apptainer" / "rollserve.def"

SETTING_VARS = {f"ROLLSERVE_{name.upper()}" for name in Settings.model_fields}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def settings_from(env: dict[str, str]) -> Settings:
    """Settings from `ROLLSERVE_*` variables alone (nothing of this process's environment)."""
    fields = {key.removeprefix("ROLLSERVE_").lower(): value for key, value in env.items()}
    return Settings.model_validate(fields)


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """`rollserve ARGV` as the real command line parses it; fails the test if it refuses."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`rollserve {shlex.join(argv)}` is refused by the CLI (exit {exc.code})")


# ----------------------------------------------------------------------------- Kubernetes


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@cache
def documents() -> list[dict[str, Any]]:
    """Every YAML document of deploy/k8s but the kustomization (parsed once; read only)."""
    docs = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append(doc)
    return docs


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents() if doc["kind"] == kind]


def named(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in of_kind(kind)}


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def rollserve_containers() -> Iterator[tuple[dict[str, Any], dict[str, Any], argparse.Namespace]]:
    """(workload, container, parsed arguments) of every container running `rollserve`."""
    for kind in WORKLOAD_KINDS:
        for workload in of_kind(kind):
            for container in containers(workload):
                command = [*container.get("command", []), *container.get("args", [])]
                if command and command[0] == "rollserve":
                    yield workload, container, parse_cli(command[1:])


def worker_deployments() -> dict[str, dict[str, Any]]:
    """The Deployment consuming each shared queue, found by the worker commands its containers
    run (workers with `--node-only` take only their pod's own queue)."""
    found: dict[str, dict[str, Any]] = {}
    for workload, _container, args in rollserve_containers():
        if args.command == "worker" and not args.node_only:
            assert args.queue not in found, f"two workloads consume queue {args.queue}"
            assert workload["kind"] == "Deployment"
            found[args.queue] = workload
    return found


def worker_containers(
    workload: dict[str, Any],
) -> dict[str, tuple[dict[str, Any], argparse.Namespace]]:
    """The workload's worker containers by the queue they run, with their parsed arguments."""
    found: dict[str, tuple[dict[str, Any], argparse.Namespace]] = {}
    for container in containers(workload):
        command = [*container.get("command", []), *container.get("args", [])]
        if command[:2] == ["rollserve", "worker"]:
            args = parse_cli(command[1:])
            assert args.queue not in found, f"{workload['metadata']['name']}: two {args.queue}"
            found[args.queue] = (container, args)
    return found


def expand(value: str, env: dict[str, str]) -> str:
    """`$(NAME)` references in a container's command, as the kubelet expands them."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's plain environment: the ConfigMaps it loads and its literal values."""
    configmaps = named("ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = "from-a-reference"
    return env


def test_every_manifest_parses_and_names_its_kind_and_itself() -> None:
    docs = documents()
    assert docs, "no manifests in deploy/k8s"
    for doc in docs:
        assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], doc
        assert isinstance(doc.get("kind"), str) and doc["kind"], doc
        name = doc.get("metadata", {}).get("name")
        assert isinstance(name, str) and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), doc
        # Namespace-agnostic: `kubectl apply -k ... -n NS` places everything.
        assert "namespace" not in doc["metadata"], f"{doc['kind']} {name} fixes its namespace"


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), "a resource listed twice"
    assert sorted(listed) == [p.name for p in manifest_files()]


def test_every_rollserve_container_runs_a_real_command() -> None:
    commands = [args.command for _w, _c, args in rollserve_containers()]
    assert "gateway" in commands
    workers = [args for _w, _c, args in rollserve_containers() if args.command == "worker"]
    # A shared worker per queue, and the node-local RUN and EVAL beside INIT.
    assert sorted(a.queue for a in workers if not a.node_only) == sorted(QUEUES)
    assert sorted(a.queue for a in workers if a.node_only) == ["eval", "run"]


def test_each_queue_has_one_worker_deployment() -> None:
    assert set(worker_deployments()) == set(QUEUES)


def test_scaled_objects_scale_the_worker_of_the_queue_they_watch() -> None:
    workers = worker_deployments()
    deployments = named("Deployment")
    routes = create_celery(Settings(), "redis://unused:6379/0").conf.task_routes
    scaled = of_kind("ScaledObject")
    assert len(scaled) == len(QUEUES)
    for obj in scaled:
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        target = obj["spec"]["scaleTargetRef"]["name"]
        assert target in deployments, f"ScaledObject {obj['metadata']['name']} targets {target}"
        queue = next(q for q, d in workers.items() if d["metadata"]["name"] == target)
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "redis"
        # The Redis list Celery's transport keeps the queue's waiting tasks in.
        assert trigger["metadata"]["listName"] == routes[TASK_NAMES[queue]]["queue"] == queue


def test_scaled_objects_aim_at_one_waiting_stage_per_worker_slot() -> None:
    slots = {}
    for workload, _container, args in rollserve_containers():
        if args.command == "worker" and not args.node_only:
            slots[workload["metadata"]["name"]] = getattr(args, "jobs", None) or args.concurrency
    for obj in of_kind("ScaledObject"):
        (trigger,) = obj["spec"]["triggers"]
        assert (
            int(trigger["metadata"]["listLength"]) == slots[obj["spec"]["scaleTargetRef"]["name"]]
        )


def test_scaled_objects_reach_the_stack_redis() -> None:
    services = named("Service")
    auths = named("TriggerAuthentication")
    secrets = named("Secret")
    for obj in of_kind("ScaledObject"):
        (trigger,) = obj["spec"]["triggers"]
        meta = trigger["metadata"]
        host, _, port = meta["address"].partition(":")
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
        assert int(meta["listLength"]) >= 1
        assert int(meta.get("activationListLength", "0")) >= 0
        assert int(meta.get("databaseIndex", "0")) >= 0
        auth = auths[trigger["authenticationRef"]["name"]]
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["parameter"] in ("password", "username")
            assert ref["key"] in secrets[ref["name"]]["stringData"]


def test_run_keeps_a_pod_and_init_and_eval_scale_to_zero() -> None:
    workers = worker_deployments()
    minimum = {
        queue: obj["spec"]["minReplicaCount"]
        for obj in of_kind("ScaledObject")
        for queue, deployment in workers.items()
        if deployment["metadata"]["name"] == obj["spec"]["scaleTargetRef"]["name"]
    }
    assert minimum["run"] >= 1
    assert minimum["init"] == minimum["eval"] == 0
    for obj in of_kind("ScaledObject"):
        assert obj["spec"]["maxReplicaCount"] >= max(1, obj["spec"]["minReplicaCount"])


def test_environment_names_are_settings_or_feed_one() -> None:
    for name in named("ConfigMap")["rollserve-config"]["data"]:
        assert name in SETTING_VARS, f"config.yaml sets {name}, which is no setting"
    for kind in WORKLOAD_KINDS:
        for workload in of_kind(kind):
            for container in containers(workload):
                env = container.get("env", [])
                used = " ".join(
                    [*container.get("command", []), *container.get("args", [])]
                    + [v.get("value", "") for v in env]
                )
                for var in env:
                    name = var["name"]
                    if name.startswith("ROLLSERVE_"):
                        assert name in SETTING_VARS, f"{container['name']} sets {name}"
                    else:  # only there to be expanded into another value
                        assert f"$({name})" in used, f"{container['name']}: {name} is unused"


def test_configured_settings_are_valid() -> None:
    for _workload, container, _args in rollserve_containers():
        env = container_env(container)
        settings_from({k: v for k, v in env.items() if k.startswith("ROLLSERVE_")})


def test_references_name_existing_secrets_and_config_maps() -> None:
    secrets, configmaps = named("Secret"), named("ConfigMap")
    for kind in WORKLOAD_KINDS:
        for workload in of_kind(kind):
            for container in containers(workload):
                for source in container.get("envFrom", []):
                    assert source["configMapRef"]["name"] in configmaps
                for var in container.get("env", []):
                    ref = var.get("valueFrom", {}).get("secretKeyRef")
                    if ref is not None:
                        assert ref["key"] in secrets[ref["name"]]["stringData"]


def test_workers_take_their_node_name_from_the_pod() -> None:
    for _workload, container, args in rollserve_containers():
        if args.command != "worker":
            continue
        (node,) = [v for v in container["env"] if v["name"] == "ROLLSERVE_NODE_NAME"]
        assert node["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", container["name"]


def test_worker_grace_period_outlasts_the_stage_hard_limits() -> None:
    """A stopping pod's workers end one after another (an INIT pod's RUN, then its EVAL, then
    its INIT), each finishing the stages it runs: the grace period covers them all."""
    deployments = {d["metadata"]["name"]: d for d in worker_deployments().values()}
    for deployment in deployments.values():
        limits = []
        for queue, (container, _args) in worker_containers(deployment).items():
            settings = settings_from(
                {k: v for k, v in container_env(container).items() if k.startswith("ROLLSERVE_")}
            )
            limits.append(getattr(settings, f"{queue}_time_limit"))
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > sum(limits), deployment["metadata"]["name"]


def init_pods() -> list[dict[str, Any]]:
    """The workloads whose pods run an INIT worker."""
    found = []
    for kind in WORKLOAD_KINDS:
        for workload in of_kind(kind):
            if "init" in worker_containers(workload):
                found.append(workload)
    assert found, "no pod runs an INIT worker"
    return found


def test_pods_that_run_init_run_their_sandboxed_jobs_run_and_eval() -> None:
    """INIT pins a sandboxed job's RUN (and EVAL, grading in the box) to `run.<node>` and
    `eval.<node>` of its own node: the same pod must consume them, share the boxes' directory
    with INIT, and call itself by the same node name."""
    for workload in init_pods():
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        workers = worker_containers(workload)
        assert set(workers) == set(QUEUES), name
        for queue in ("run", "eval"):
            assert workers[queue][1].node_only, f"{name}: its {queue} worker takes shared work"
        volumes = {v["name"]: v for v in pod["volumes"]}
        sandbox_volumes, node_sources = set(), []
        for queue, (container, _args) in workers.items():
            env = container_env(container)
            settings = settings_from({k: v for k, v in env.items() if k.startswith("ROLLSERVE_")})
            (mount,) = [
                m
                for m in container.get("volumeMounts", [])
                if Path(m["mountPath"]) == settings.sandbox_dir
            ] or [None]
            assert mount is not None, f"{name}/{queue}: {settings.sandbox_dir} is not a volume"
            assert "emptyDir" in volumes[mount["name"]], f"{name}: boxes belong to the pod"
            sandbox_volumes.add(mount["name"])
            (node,) = [v for v in container["env"] if v["name"] == "ROLLSERVE_NODE_NAME"]
            node_sources.append(node["valueFrom"])
            assert container.get("securityContext", {}).get("procMount") == "Unmasked", queue
        assert len(sandbox_volumes) == 1, f"{name}: its workers see different boxes"
        assert all(source == node_sources[0] for source in node_sources), name
        # The keepers INIT starts are reached by pid and peer credentials from RUN and EVAL.
        assert pod.get("shareProcessNamespace") is True, name
        assert pod.get("hostUsers") is False, name


def test_init_pods_stop_run_then_eval_then_init() -> None:
    """The boxes are processes of the INIT container, killed when its main process exits:
    RUN (a main container) stops first, then the sidecars in reverse order, EVAL then INIT."""
    for workload in init_pods():
        pod = workload["spec"]["template"]["spec"]
        sidecars = [
            c["name"] for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"
        ]
        assert len(sidecars) == len(pod.get("initContainers", [])), "a one-shot init container"
        workers = worker_containers(workload)
        run, evaluate, init = (workers[q][0]["name"] for q in ("run", "eval", "init"))
        assert sidecars == [init, evaluate]
        assert [c["name"] for c in pod["containers"]] == [run]


@pytest.fixture
def stub_celery(tmp_path: Path) -> Path:
    """A `celery` on PATH that records its arguments, and answers `inspect` as a worker that
    no longer answers."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "celery"
    stub.write_text(
        '#!/bin/sh\necho "$*" >> "$CALLS"\n'
        'case "$*" in *" inspect "*) echo "Error: No nodes replied" >&2; exit 69;; esac\n'
    )
    stub.chmod(0o755)
    return bin_dir


def test_run_worker_stops_init_intake_before_it_stops(stub_celery: Path, tmp_path: Path) -> None:
    """The RUN worker's preStop hook is installed by the image and tells this pod's INIT worker
    (by the Celery node name its command sets) to stop taking jobs from `init`."""
    containerfile = (K8S / "Containerfile").read_text()
    installed = dict(
        (target, source)
        for source, target in re.findall(r"^COPY (\S+) (/usr/local/bin/\S+)$", containerfile, re.M)
    )
    node = "rollserve-worker-init-5d8c9-x7k2p"
    for workload in init_pods():
        workers = worker_containers(workload)
        _init, init_args = workers["init"]
        hostname = expand(init_args.hostname, {"ROLLSERVE_NODE_NAME": node})
        assert hostname == f"init@{node}"
        (program,) = workers["run"][0]["lifecycle"]["preStop"]["exec"]["command"]
        script = ROOT / installed[f"/usr/local/bin/{program}"]
        assert os.access(script, os.X_OK), f"{script} is not executable"
        calls = tmp_path / "calls"
        env = {"PATH": f"{stub_celery}:{os.environ['PATH']}", "CALLS": str(calls)}
        done = subprocess.run(
            [str(script)], env={**env, "ROLLSERVE_NODE_NAME": node}, timeout=60, check=False
        )
        assert done.returncode == 0
        first, *rest = [shlex.split(line) for line in calls.read_text().splitlines()]
        assert first == [
            "-A", "broker.worker_app", "control", "cancel_consumer", "init", "-d", hostname
        ]  # fmt: skip
        assert rest and all("inspect" in call and hostname in call for call in rest)
        calls.unlink()


def test_unmasked_proc_only_in_pods_with_their_own_user_namespace() -> None:
    for kind in WORKLOAD_KINDS:
        for workload in of_kind(kind):
            pod = workload["spec"]["template"]["spec"]
            for container in containers(workload):
                if container.get("securityContext", {}).get("procMount") == "Unmasked":
                    assert pod.get("hostUsers") is False, workload["metadata"]["name"]


def test_gateway_probes_real_routes_and_may_bind_beyond_loopback() -> None:
    routes = {getattr(route, "path", None) for route in open_router.routes}
    (gateway,) = [(w, c, a) for w, c, a in rollserve_containers() if a.command == "gateway"]
    _workload, container, args = gateway
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path and path in routes
        assert get["port"] in ports and ports[get["port"]] == args.port
    env = container_env(container)
    settings = settings_from({k: v for k, v in env.items() if k.startswith("ROLLSERVE_")})
    assert gateway_bind_refusal(args.host, settings) is None


def test_services_select_pods_and_name_their_ports() -> None:
    workloads = [w for kind in WORKLOAD_KINDS for w in of_kind(kind)]
    for service in of_kind("Service"):
        selector = service["spec"]["selector"]
        chosen = [
            w
            for w in workloads
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(chosen) == 1, f"Service {service['metadata']['name']} selects {len(chosen)}"
        port_names = {p.get("name") for c in containers(chosen[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names


def test_mounts_name_volumes_and_claims_that_exist() -> None:
    claims = set(named("PersistentVolumeClaim"))
    for kind in WORKLOAD_KINDS:
        for workload in of_kind(kind):
            spec = workload["spec"]
            pod = spec["template"]["spec"]
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            templates = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
            for container in containers(workload):
                for mount in container.get("volumeMounts", []):
                    assert mount["name"] in volumes.keys() | templates, mount
            for volume in volumes.values():
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["claimName"] in claims


def test_every_rollserve_pod_shares_one_results_store() -> None:
    """Workers write finished trajectories and the gateway reads them: a store on a pod's own
    disk would lose them for every other pod."""
    stores = set()
    for workload, container, _args in rollserve_containers():
        env = container_env(container)
        settings = settings_from({k: v for k, v in env.items() if k.startswith("ROLLSERVE_")})
        if settings.results_url:
            stores.add(settings.results_url)
            continue
        path = settings.results_path
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        holding = [
            m
            for m in container.get("volumeMounts", [])
            if path == Path(m["mountPath"]) or Path(m["mountPath"]) in path.parents
        ]
        assert holding, f"{workload['metadata']['name']}: {path} is on the container's own disk"
        mount = max(holding, key=lambda m: len(m["mountPath"]))  # the innermost one
        claim = volumes[mount["name"]].get("persistentVolumeClaim")
        assert claim is not None, f"{workload['metadata']['name']}: {path} is not shared"
        stores.add(f"{claim['claimName']}:{path.relative_to(mount['mountPath'])}")
    assert len(stores) == 1, stores


def test_redis_keeps_an_append_only_file_and_never_evicts() -> None:
    (redis,) = of_kind("StatefulSet")
    (container,) = containers(redis)
    args = container["args"]
    options = dict(zip(args[::2], args[1::2], strict=True))
    assert options["--appendonly"] == "yes"
    assert options["--maxmemory-policy"] == "noeviction"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert options["--dir"] in mounts


# ----------------------------------------------------------------------------- Apptainer


def definition() -> tuple[dict[str, str], dict[str, list[str]]]:
    """The definition file's header keywords and its sections' lines (comments dropped)."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in APPTAINER_DEF.read_text().splitlines():
        line = raw.strip()
        match = re.fullmatch(r"%(\w+)(\s.*)?", line)
        if match:
            current = sections.setdefault(match.group(1), [])
        elif current is not None:
            if line and not line.startswith("#"):
                current.append(line)
        elif line and not line.startswith("#"):
            key, _, value = line.partition(":")
            header[key.strip()] = value.strip()
    return header, sections


def test_apptainer_definition_has_its_header_and_sections() -> None:
    header, sections = definition()
    assert next(iter(header)) == "Bootstrap", "Bootstrap must come first"
    assert header["Bootstrap"] == "docker"
    assert header["From"].startswith("python:3.11-slim")
    for name in ("files", "post", "environment", "runscript", "help", "labels"):
        assert sections.get(name), f"%{name} is missing or empty"
    assert any("bubblewrap" in line for line in sections["post"])


def test_apptainer_runscript_runs_a_real_worker_command() -> None:
    _header, sections = definition()
    (line,) = [line for line in sections["runscript"] if "rollserve" in line]
    words = shlex.split(line)
    assert words[:2] == ["exec", "rollserve"] and words[-1] == "$@"
    for queue in QUEUES:
        args = parse_cli([*words[2:-1], queue, "--concurrency", "2"])
        assert (args.command, args.queue) == ("worker", queue)


def test_apptainer_test_section_runs_real_commands() -> None:
    _header, sections = definition()
    checks = [shlex.split(line) for line in sections["test"] if line.startswith("rollserve")]
    assert checks
    for words in checks:
        argv = [w for w in words[1:] if not w.startswith(">")]
        with pytest.raises(SystemExit) as exc:  # --help prints and exits 0
            build_parser().parse_args(argv)
        assert exc.value.code == 0, words


def test_apptainer_image_gets_the_whole_distribution() -> None:
    _header, sections = definition()
    sources = [line.split()[0] for line in sections["files"]]
    for source in sources:
        assert (ROOT / source).exists(), f"%files copies {source}, which is not in the repository"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [pattern.rstrip("*") for pattern in include]
    assert set(packages) | {"pyproject.toml", pyproject["project"]["readme"]} <= set(sources)
    assert any(line.startswith("pip install") for line in sections["post"])


def test_apptainer_environment_sets_real_settings() -> None:
    _header, sections = definition()
    exported = [re.match(r"export (\w+)=", line) for line in sections["environment"]]
    names = [m.group(1) for m in exported if m]
    assert names
    assert set(names) <= SETTING_VARS


# ----------------------------------------------------------------------------- systemd


def unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections as (key, value) pairs in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path.name}: {line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not KEY=VALUE"
        current.append((key.strip(), value.strip()))
    return sections


def values(sections: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in sections.get(section, []) if k == key]


def seconds(value: str) -> float:
    """A systemd time span such as `90`, `90s`, `31min` or `1h 5min`, in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "hr": 3600}
    total = 0.0
    for number, suffix in re.findall(r"(\d+)\s*([a-z]*)", value):
        total += int(number) * units[suffix]
    return total


def rollserve_argv(exec_start: str, instance: str = "") -> list[str]:
    words = exec_start.replace("%i", instance).split()
    assert words[0].startswith("/") and Path(words[0]).name == "rollserve", exec_start
    return [w for w in words[1:] if not w.startswith("$")]  # $WORKER_ARGS: empty by default


def test_worker_unit_runs_each_queue_and_stops_warm() -> None:
    worker = unit(SYSTEMD / "rollserve-worker@.service")
    (exec_start,) = values(worker, "Service", "ExecStart")
    for queue in QUEUES:
        args = parse_cli(rollserve_argv(exec_start, queue))
        assert (args.command, args.queue) == ("worker", queue)
    assert values(worker, "Service", "KillSignal") == ["SIGTERM"]
    # SIGTERM to the main process only: pool processes and keepers end their stages on it.
    assert values(worker, "Service", "KillMode") == ["mixed"]
    (timeout,) = values(worker, "Service", "TimeoutStopSec")
    assert seconds(timeout) > Settings().longest_hard_limit
    assert values(worker, "Service", "Restart") == ["on-failure"]
    assert values(worker, "Service", "EnvironmentFile")


def test_gateway_unit_runs_the_gateway() -> None:
    gateway = unit(SYSTEMD / "rollserve-gateway.service")
    (exec_start,) = values(gateway, "Service", "ExecStart")
    assert parse_cli(rollserve_argv(exec_start)).command == "gateway"
    assert values(gateway, "Service", "Restart") == ["on-failure"]
    assert values(gateway, "Service", "EnvironmentFile")


def test_units_need_no_local_redis() -> None:
    for name in ("rollserve-gateway.service", "rollserve-worker@.service"):
        sections = unit(SYSTEMD / name)
        for key in ("Requires", "Wants", "BindsTo", "Requisite"):
            for value in values(sections, "Unit", key):
                assert "rollserve-redis" not in value, f"{name}: {key}={value}"


def test_environment_example_holds_valid_settings() -> None:
    """Valid once its placeholders are replaced, as the operator is told to; left as shipped,
    the placeholder token is refused rather than served."""
    env = {}
    for line in (SYSTEMD / "rollserve.env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    assert set(env) <= SETTING_VARS
    with pytest.raises(ValueError, match="CHANGE-ME"):
        settings_from(env)
    filled = {key: value.replace("CHANGE-ME", "a-real-secret-0123") for key, value in env.items()}
    settings = settings_from(filled)
    assert settings.redis_url
    assert gateway_bind_refusal(settings.host, settings) is None


@pytest.fixture
def installed_units(tmp_path: Path) -> Path:
    """The units with every program they start replaced by a stub that exists here."""
    stub = tmp_path / "bin" / "program"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    units = tmp_path / "units"
    units.mkdir()
    for path in SYSTEMD.glob("*.service"):
        text = re.sub(
            r"^(Exec\w+=[-@:+!]*)(\S+)", rf"\g<1>{stub}", path.read_text(), flags=re.MULTILINE
        )
        (units / path.name).write_text(text)
    return units


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian package `systemd`)",
)
def test_systemd_analyze_verifies_the_units(installed_units: Path) -> None:
    names = [p.name for p in sorted(installed_units.glob("*.service")) if "@" not in p.name]
    names += [f"rollserve-worker@{queue}.service" for queue in QUEUES]
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *names],
        cwd=installed_units,
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{installed_units}:"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    # verify exits 0 on many problems (an unknown KillMode is only "ignoring"): any word is one.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")
