"""A real single-node Slurm cluster on localhost for tests: munged, slurmctld and slurmd.

`SlurmCluster(directory).start()` writes a munge key, a `slurm.conf` and a `cgroup.conf` into
`directory`, starts the three daemons in the foreground (each in its own process group, tied
to this process's life), and waits until `sinfo` shows the node idle. `env()` is the
environment the Slurm commands (`sbatch`, `squeue`, `scancel`, `sinfo`) need to reach it:
`SLURM_CONF` (the configuration names the munge socket). `stop()` cancels every job and stops
the daemons by process group.

Process tracking is `proctrack/linuxproc` and there is no task plugin, so no cgroup is needed
and the cluster runs in a container as it does on a laptop; the node claims 8 CPUs
(`SlurmdParameters=config_overrides`) so a gateway job and a few worker jobs fit at once on a
2-core machine.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.processes import free_port, spawn, stop_group
from tests.support.wait import wait_until

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "squeue", "scancel", "sinfo")
SBIN = ("/usr/sbin", "/sbin")
NODE_CPUS = 8


def find_program(name: str) -> str | None:
    """`name` on PATH or in the sbin directories (where Debian puts the daemons)."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))


def missing_programs() -> list[str]:
    """The Slurm and munge programs that are not installed."""
    return [name for name in (*DAEMONS, *COMMANDS) if find_program(name) is None]


def slurm_conf(directory: Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    """A one-node configuration: everything in `directory`, root runs the daemons."""
    return "\n".join(
        [
            "ClusterName=rollserve-test",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={directory / 'munge.socket'}",
            f"StateSaveLocation={directory / 'state'}",
            f"SlurmdSpoolDir={directory / 'spool'}",
            f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
            f"SlurmdPidFile={directory / 'slurmd.pid'}",
            f"SlurmctldLogFile={directory / 'slurmctld.log'}",
            f"SlurmdLogFile={directory / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MinJobAge=2",
            "KillWait=5",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} RealMemory=1000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


class SlurmCluster:
    """munged, slurmctld and slurmd for this host, configured and kept in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.node = socket.gethostname().split(".")[0]
        self.conf = directory / "slurm.conf"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def env(self) -> dict[str, str]:
        """The environment for Slurm's commands: this cluster's configuration, sbin on PATH."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
        return env

    def start(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        d = self.directory
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf.write_text(slurm_conf(d, self.node, free_port(), free_port()))
        # Read by the cgroup plugins only; none is configured, so it only has to parse.
        (d / "cgroup.conf").write_text("CgroupAutomount=no\n")
        env = self.env()
        self._spawn(
            "munged",
            [
                str(find_program("munged")), "--foreground", "--force",
                f"--socket={d / 'munge.socket'}", f"--key-file={key}",
                f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}",
                f"--log-file={d / 'munged.log'}",
            ],
            env,
        )  # fmt: skip
        wait_until(lambda: (d / "munge.socket").exists(), 20, "munged's socket")
        self._spawn("slurmctld", [str(find_program("slurmctld")), "-D", "-i"], env)
        self._spawn("slurmd", [str(find_program("slurmd")), "-D", "-N", self.node], env)
        wait_until(self._node_idle, 60, f"sinfo to show {self.node} idle ({d}/*.log)")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = self.directory / f"{name}.out"
        self.procs[name] = spawn(argv, env=env, log_path=str(log))

    def _node_idle(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode}; see {self.directory}/{name}.log"
                )
        answer = self.run("sinfo", "--noheader", "--format=%T", check=False)
        return answer.returncode == 0 and answer.stdout.split() == ["idle"]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one of Slurm's commands against this cluster."""
        return subprocess.run(
            [str(find_program(argv[0]) or argv[0]), *argv[1:]],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=check,
        )

    def stop(self) -> None:
        """Cancel every job (their processes die with slurmd's), then stop the daemons."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
            self.run("scancel", "--user=root", check=False)
        for name in reversed(DAEMONS):
            proc = self.procs.pop(name, None)
            if proc is not None:
                stop_group(proc, timeout=15)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running one-node Slurm cluster; skips naming what is missing when it is not
    installed (`make system-deps` installs `slurm-wlm` and `munge`), or when not root."""
    missing = missing_programs()
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}; apt-get install "
                    "slurm-wlm munge, or `make system-deps` as root)")  # fmt: skip
    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster runs its daemons as root; not root here")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()
