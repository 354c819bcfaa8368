"""Machines for tests of jobs across machines, made on this one: each host is a network namespace
whose one link, a veth named :data:`DEVICE` in every host, leads to a bridge in a namespace of its
own. The hosts are ``10.231.0.1``, ``10.231.0.2``, ... on a /24 that exists only inside these
namespaces, so nothing a test sends can leave them. Made and removed by :class:`Network` (root
and iproute2 needed: :func:`unavailable` says why not), with names unique to each network, so
that runs side by side never meet.

:meth:`Network.limit` slows a host's link with ``tc``'s token bucket (``tbf``; this kernel has no
``netem``), :meth:`Network.cut` takes it down (a partition: no connection closes, packets are
lost), :meth:`Network.hydra_launcher` writes what MPICH's hydra needs to start ranks on the hosts
(``mpiexec -launcher ssh -launcher-exec``), and :meth:`Network.pids` lists what still runs there.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

DEVICE = "uc0"
"""The name of each host's link (each host has its own namespace of names)."""

_PREFIX = "10.231.0"
"""The hosts' /24: host ``i`` is ``10.231.0.{i + 1}``."""


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (not root, no ``ip``, or the kernel refuses),
    or None when they can."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2's ip and tc are not installed"
    probe = f"unicoll-probe-{os.getpid()}-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    """Run ``ip ARGS...``; CalledProcessError with its message when it fails."""
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Network:
    """``hosts`` hosts on one bridge, made on ``with`` and removed, with whatever still runs
    there, when the block ends (however it ends)."""

    def __init__(self, hosts: int) -> None:
        tag = f"unicoll-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{tag}-sw"
        self.namespaces = [f"{tag}-h{i}" for i in range(hosts)]
        self.addresses = [f"{_PREFIX}.{i + 1}" for i in range(hosts)]

    def __enter__(self) -> Network:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
            _ip("netns", "add", namespace)
            _ip(
                "link", "add", DEVICE, "netns", namespace, "type", "veth", "peer", "name", f"p{i}", "netns", self.switch
            )
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", DEVICE)
            _ip("-n", namespace, "link", "set", DEVICE, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs on ``host``."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def limit(self, host: int, rate: str) -> None:
        """Let at most ``rate`` (tc's units: ``50mbit``) through ``host``'s link, each way."""
        for namespace, device in ((self.namespaces[host], DEVICE), (self.switch, f"p{host}")):
            tbf = ["tbf", "rate", rate, "burst", "64kb", "latency", "500ms"]
            subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf], check=True)

    def cut(self, host: int) -> None:
        """Take ``host``'s link down at the bridge: its packets are lost from now on, and no
        connection is closed (a cable pulled, a host gone dark)."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def hydra_launcher(self, directory: Path) -> Path:
        """A script for ``mpiexec -launcher ssh -launcher-exec SCRIPT``: hydra calls it as ssh
        (``[-x] HOST COMMAND``) for each host but the one it runs on, and it runs COMMAND there."""
        script = directory / "hydra-launcher.sh"
        cases = "".join(f"  {address}) ns={ns} ;;\n" for address, ns in zip(self.addresses, self.namespaces))
        script.write_text(
            '#!/bin/sh\n[ "$1" = "-x" ] && shift\nhost=$1\nshift\n'
            f'case $host in\n{cases}  *) echo "no such host: $host" >&2; exit 1 ;;\nesac\n'
            'exec ip netns exec "$ns" sh -c "$*"\n'
        )
        script.chmod(0o755)
        return script

    def pids(self) -> list[int]:
        """The processes that run on any host now."""
        found = []
        for namespace in self.namespaces:
            listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
            found += [int(pid) for pid in listed.split()]
        return found

    def close(self) -> None:
        """Kill what still runs on the hosts and remove every namespace (their links go with them)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for namespace in (*self.namespaces, self.switch):
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
