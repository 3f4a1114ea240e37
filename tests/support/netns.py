"""Hosts on one machine for multi-host tests: network namespaces joined by a bridge.

`Network` makes one namespace per host, named `<prefix>-<host>` (the prefix carries the test
process's pid, so parallel runs never meet), with loopback up. The first host is the hub: it
holds a bridge, and every other host hangs on it by a veth pair, each with its own address in
a private /24 that no route of this machine uses. Nothing is added to the machine's own
network namespace: the links live inside the namespaces and go with them.

A host's processes enter only its network namespace (`nsenter --net`), not a mount namespace
of their own: `ip netns exec` would give each process a private mount namespace with a fresh
sysfs, so a node's workers would not see one another's mounts (a box's own disk) and none
would see the cgroup hierarchy — unlike the processes of one real machine. Each process runs
in its own session (process group), tied to this process's life, and is stopped by its group.

The test's own thread talks to the hub from inside the hub's namespace (`Network.entered`):
network namespaces are per thread, so only the calling thread moves.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from broker.processes import spawn, stop_group

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
BRIDGE = "rsbr0"
PRIVATE_RANGE = ipaddress.IPv4Network("10.231.0.0/16")
"""Where a host network's /24 is picked from."""


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 util-linux)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def _routed_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this machine's own namespace has routes or addresses for."""
    found: list[ipaddress.IPv4Network] = []
    for args in (["-4", "route", "show", "table", "all"], ["-4", "-o", "addr", "show"]):
        text = subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout
        for word in text.split():
            with contextlib.suppress(ValueError):
                net = ipaddress.ip_network(word, strict=False)
                if isinstance(net, ipaddress.IPv4Network):
                    found.append(net)
    return found


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 of `PRIVATE_RANGE` that overlaps nothing routed on this machine."""
    used = _routed_networks()
    for subnet in PRIVATE_RANGE.subnets(new_prefix=24):
        if not any(subnet.overlaps(net) for net in used if net.prefixlen > 0):
            return subnet
    raise RuntimeError(f"every /24 of {PRIVATE_RANGE} is in use on this machine")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc().setns(fd, CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns: {os.strerror(code)}")


def namespace_inode(netns: str) -> int:
    """The inode that names the namespace `netns` (as `/proc/PID/ns/net` links show it)."""
    return os.stat(NETNS_DIR / netns).st_ino


def processes_in(inodes: set[int]) -> list[int]:
    """Pids of the live processes whose network namespace is one of `inodes`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(proc / "ns" / "net").st_ino in inodes:
                found.append(int(proc.name))
    return found


@dataclass
class Network:
    """Hosts as network namespaces on one bridge (see the module doc)."""

    prefix: str
    hosts: list[str]
    """Host names; the first is the hub, which holds the bridge."""
    subnet: ipaddress.IPv4Network = field(default_factory=free_subnet)
    inodes: dict[str, int] = field(default_factory=dict)
    """Each made host's namespace inode (kept to find its processes after deletion)."""

    @property
    def hub(self) -> str:
        return self.hosts[0]

    def netns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        """The host's address on the bridge (the hub is .1, the others .10, .11, ...)."""
        index = self.hosts.index(host)
        return str(self.subnet.network_address + (1 if index == 0 else 9 + index))

    def create(self) -> Network:
        """Make every host's namespace, the bridge and the links; undone by `delete`."""
        cidr = f"/{self.subnet.prefixlen}"
        for host in self.hosts:
            name = self.netns(host)
            _ip("netns", "add", name)
            self.inodes[host] = namespace_inode(name)
            _ip("-n", name, "link", "set", "lo", "up")
        hub = self.netns(self.hub)
        _ip("-n", hub, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", hub, "addr", "add", self.address(self.hub) + cidr, "dev", BRIDGE)
        _ip("-n", hub, "link", "set", BRIDGE, "up")
        for index, host in enumerate(self.hosts[1:], start=1):
            port = f"rsv{index}"
            _ip(
                "-n", hub, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", self.netns(host),
            )  # fmt: skip
            _ip("-n", hub, "link", "set", port, "master", BRIDGE)
            _ip("-n", hub, "link", "set", port, "up")
            _ip("-n", self.netns(host), "addr", "add", self.address(host) + cidr, "dev", "eth0")
            _ip("-n", self.netns(host), "link", "set", "eth0", "up")
        return self

    def existing(self) -> list[str]:
        """The namespaces of this network that exist now."""
        if not NETNS_DIR.is_dir():
            return []
        mine = {self.netns(host) for host in self.hosts}
        return sorted(entry.name for entry in NETNS_DIR.iterdir() if entry.name in mine)

    def delete(self) -> None:
        """Delete every namespace of this network (their links go with them)."""
        for name in self.existing():
            _ip("netns", "delete", name)

    def processes(self, host: str | None = None) -> list[int]:
        """Pids of live processes in `host`'s namespace (any of this network's: None)."""
        return processes_in({self.inodes[host]} if host else set(self.inodes.values()))

    @contextlib.contextmanager
    def entered(self, host: str) -> Iterator[None]:
        """Run the calling thread in `host`'s network namespace (sockets it opens meanwhile
        stay there); it is back in its own when this ends."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(NETNS_DIR / self.netns(host), os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
            os.close(own)

    def spawn(
        self, host: str, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on `host` in a session of its own, tied to this process's life."""
        command = ["nsenter", f"--net={NETNS_DIR / self.netns(host)}", "--", *argv]
        return spawn(command, env=env, cwd=str(cwd), log_path=str(log_path))


@dataclass
class Processes:
    """The processes a test started, by name, each the leader of its own process group."""

    running: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def add(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        self.running[name] = proc

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the named process's whole group and wait for its leader."""
        proc = self.running.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
        stop_group(proc)  # whatever of the group is left

    def stop_all(self, timeout: float = 15.0) -> None:
        """Stop every group still running: SIGTERM to the workers' groups at once, then to the
        hub's services (which the workers may still talk to while they stop); SIGKILL to
        whatever is left of a group after `timeout` seconds."""
        workers = [name for name in self.running if name.startswith("worker")]
        others = [name for name in self.running if name not in workers]
        for names in (workers, others):
            procs = [self.running.pop(name) for name in names]
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                stop_group(proc, timeout=5)  # SIGKILL to what is left of the group
