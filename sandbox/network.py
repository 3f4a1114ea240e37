"""The network of a sandbox with network: a namespace of its own, never the host's, whose only
way out is the egress proxy (`sandbox.egress`).

One namespace per sandbox, made when its first box (the tool server's, or an `exec`) starts:
the box of the tool server and every `exec` box join it (bwrap runs under `nsenter
--net=...`), so a sandbox pays for it once. In it:

- loopback, and `tap0` from slirp4netns (`--disable-host-loopback`, its DNS off, in its own
  sandbox with seccomp): user-mode networking whose connections leave from the host;
- a firewall (nftables, table `inet rollserve`) that sends every outbound TCP connection to
  the proxy's listener and every DNS query to its resolver (both on the namespace's
  127.0.0.1) and rejects everything else (other UDP, ICMP, IPv6), so nothing of the box
  reaches slirp4netns itself; only sockets the proxy opens, marked `MARK`, go out through
  `tap0`.

Nothing in the box can change that: its processes have no capabilities in the namespace,
which belongs to the host's user namespace. A box without network pays nothing of this: bwrap
gives it a fresh namespace with loopback alone.

Made and torn down by the service as root; a sandbox with network on a host without root,
slirp4netns, nft or nsenter fails to start, naming what is missing (`missing`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import os
import select
import shutil
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from core.egress import HostRule
from sandbox.base import SandboxError
from sandbox.egress import LOG_NAME, EgressProxy, EventLog, Network

BOX_NETWORK = ipaddress.IPv4Network("10.0.2.0/24")
"""slirp4netns's network inside the box (its default: the box is 10.0.2.100)."""
RESOLVER = "10.0.2.3"
"""The name server a box's resolv.conf names; any DNS query goes to the proxy's resolver."""
PROXY_PORT = 1
"""Port of the proxy's TCP listener on the namespace's 127.0.0.1: below 1024, so no box
process could have bound it (nor wants it)."""
DNS_PORT = 53
MARK = 0x72730001
"""Firewall mark of the sockets the proxy opens for allowed connections."""
SETUP_SECONDS = 10.0

CLONE_NEWNET = 0x40000000
SO_MARK = 36
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1

RULESET = f"""
table inet rollserve {{
    chain divert {{
        type nat hook output priority -100; policy accept;
        meta mark {MARK:#x} return
        ip daddr 127.0.0.0/8 return
        meta nfproto ipv4 meta l4proto tcp redirect to :{PROXY_PORT}
        meta nfproto ipv4 udp dport 53 redirect to :{DNS_PORT}
    }}
    chain outbound {{
        type filter hook output priority 0; policy drop;
        ct state established,related accept
        oifname "lo" accept
        ip daddr 127.0.0.0/8 accept
        ip6 daddr ::1 accept
        meta mark {MARK:#x} oifname "tap0" accept
        meta l4proto tcp reject with tcp reset
        reject with icmpx admin-prohibited
    }}
}}
"""
"""The box namespace's firewall: redirected traffic ends up on 127.0.0.1, whose packets
(and the replies of accepted connections) pass; only the proxy's marked sockets leave."""

_TOOLS = (
    ("slirp4netns", "slirp4netns (apt-get install slirp4netns)"),
    ("nft", "nft (apt-get install nftables)"),
    ("nsenter", "nsenter (apt-get install util-linux)"),
)

_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


def missing(privileged: bool) -> list[str]:
    """What this host lacks for sandboxes with network (empty: nothing)."""
    lacking = [] if privileged else ["the service running as root (it sets the box's firewall)"]
    return lacking + [what for tool, what in _TOOLS if _which(tool) is None]


def _which(tool: str) -> str | None:
    # nft lives in /usr/sbin, which an unprivileged PATH may leave out.
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")


def _ns_call(name: str, *args: int) -> None:
    if getattr(_libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")


def _in_thread(work: Callable[[], T]) -> T:
    """`work()` run on a thread of its own, so namespace changes it makes (setns, unshare
    apply to the calling thread) end with that thread."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name="netns")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


class _Namespace:
    """A new network namespace (held by `fd`), with loopback up, the proxy's sockets bound in
    it and its firewall set."""

    def __init__(self) -> None:
        _ns_call("unshare", CLONE_NEWNET)
        self.fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        made: list[socket.socket] = []
        try:
            _loopback_up()
            self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            made.append(self.listener)
            self.listener.bind(("127.0.0.1", PROXY_PORT))
            self.listener.listen(128)
            self.resolver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            made.append(self.resolver)
            self.resolver.bind(("127.0.0.1", DNS_PORT))
            nft = _which("nft") or "nft"
            # A child inherits the namespace of the thread that forks it: this one.
            done = subprocess.run(
                [nft, "-f", "-"], input=RULESET.encode(), capture_output=True, timeout=10
            )
            if done.returncode != 0:
                why = done.stderr.decode(errors="replace").strip()
                raise SandboxError(f"cannot set the box's firewall with nft: {why}")
        except BaseException:
            for sock in made:
                sock.close()
            os.close(self.fd)
            raise


class BoxNetwork:
    """The network of one sandbox: its namespace, slirp4netns and the egress proxy.

    `start` makes all of it; boxes join it through `netns_path`; `close_egress` refuses
    every later connection; `close` ends it (idempotent).
    """

    def __init__(
        self,
        namespace: _Namespace,
        slirp: subprocess.Popen[bytes],
        exit_fd: int,
        proxy: EgressProxy,
    ) -> None:
        self._fd = namespace.fd
        self._slirp = slirp
        self._exit_fd = exit_fd
        self.proxy = proxy
        self._closed = False
        self._lock = threading.Lock()

    @property
    def netns_path(self) -> str:
        """A path naming the namespace that `nsenter --net=` opens (while this process runs)."""
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    @property
    def slirp_pid(self) -> int:
        return self._slirp.pid

    @classmethod
    def start(
        cls,
        state_dir: Path,
        rules: Sequence[HostRule],
        env: dict[str, str],
        private: Sequence[Network] = (),
    ) -> BoxNetwork:
        """Make the namespace, its firewall and the proxy (logging to `state_dir`; allowed
        hosts may resolve into the `private` networks), and start slirp4netns with `env`;
        SandboxError saying why when any of it fails."""
        try:
            namespace = _in_thread(_Namespace)
        except OSError as exc:
            raise SandboxError(f"cannot make the box's network namespace: {exc}") from exc
        fd = namespace.fd

        def outbound() -> socket.socket:
            return _in_thread(lambda: _marked_socket(fd))

        proxy = EgressProxy(
            rules,
            listener=namespace.listener,
            resolver=namespace.resolver,
            outbound=outbound,
            log=EventLog(state_dir / LOG_NAME),
            box_network=BOX_NETWORK,
            private=private,
        )
        try:
            slirp, exit_fd = _start_slirp(f"/proc/{os.getpid()}/fd/{fd}", state_dir, env)
        except BaseException:
            proxy.close()
            os.close(fd)
            raise
        network = cls(namespace, slirp, exit_fd, proxy)
        try:
            proxy.start()
        except BaseException:
            network.close()
            raise
        return network

    def close_egress(self, reason: str) -> None:
        self.proxy.close_egress(reason)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.proxy.close()
        os.close(self._exit_fd)  # slirp4netns exits when it sees the end of this pipe
        try:
            self._slirp.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._slirp.kill()
            self._slirp.wait()
        os.close(self._fd)


def _marked_socket(netns_fd: int) -> socket.socket:
    """A TCP socket in the namespace `netns_fd`, marked as the proxy's (call it on a thread
    of its own: it moves the calling thread into that namespace)."""
    _ns_call("setns", netns_fd, CLONE_NEWNET)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, SO_MARK, MARK)
    return sock


def _start_slirp(
    netns_path: str, state_dir: Path, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], int]:
    """Start slirp4netns on the namespace at `netns_path` and wait until `tap0` is up; the
    process and the pipe end whose closing stops it."""
    ready_r, ready_w = os.pipe()
    exit_r, exit_w = os.pipe()
    argv = [
        _which("slirp4netns") or "slirp4netns",
        "--configure", "--mtu=65520", "--disable-host-loopback", "--disable-dns",
        "--enable-sandbox", "--enable-seccomp",
        f"--ready-fd={ready_w}", f"--exit-fd={exit_r}",
        "--netns-type=path", netns_path, "tap0",
    ]  # fmt: skip
    log_path = state_dir / "network.log"
    try:
        with open(log_path, "ab") as log:
            slirp = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                pass_fds=(ready_w, exit_r),
                start_new_session=True,
            )
    except OSError as exc:
        for fd in (ready_r, ready_w, exit_r, exit_w):
            os.close(fd)
        raise SandboxError(f"cannot run slirp4netns: {exc}") from exc
    os.close(ready_w)
    os.close(exit_r)
    try:
        ready, _, _ = select.select([ready_r], [], [], SETUP_SECONDS)
        if not ready or not os.read(ready_r, 16):
            raise SandboxError(
                "slirp4netns did not bring the box's network up"
                + (" in time" if not ready else "")
                + f": {_tail(log_path)}"
            )
    except BaseException:
        os.close(exit_w)
        with contextlib.suppress(OSError):
            slirp.kill()
        slirp.wait()
        raise
    finally:
        os.close(ready_r)
    return slirp, exit_w


def _tail(path: Path, limit: int = 600) -> str:
    try:
        text = path.read_bytes()[-limit:].decode("utf-8", "replace").strip()
    except OSError:
        return "(no log)"
    return text or "(no log)"


def nsenter_argv(netns_path: str) -> list[str]:
    """The command prefix that runs a command in the namespace at `netns_path`."""
    return [_which("nsenter") or "nsenter", f"--net={netns_path}", "--"]


def resolv_conf() -> str:
    """The resolv.conf of a box with network: any name server address reaches the proxy's
    resolver, this one says so."""
    return f"nameserver {RESOLVER}\noptions timeout:2 attempts:2\n"
