"""Separate hosts on one machine: network namespaces joined by a bridge, for real multicast (mDNS) tests.

Every test host gets its own namespace with one veth leg on a private bridge and an address in a private /24.
The root namespace holds no address on the bridge, so test traffic never leaves these namespaces. Everything is
removed on exit, even when the test fails; names carry the creating pid so stale ones from a killed run are
recognised and cleaned up too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import pytest

PREFIX = "exl"


def netns_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (runs in CI as root)"
    if shutil.which("ip") is None:
        return "needs the 'ip' command (Debian package iproute2; .ci/run installs it)"
    probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}probe{os.getpid()}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}probe{os.getpid()}"], capture_output=True)
    return None


requires_netns = pytest.mark.skipif(netns_unavailable_reason() is not None,
                                    reason=str(netns_unavailable_reason()))


@dataclass(frozen=True)
class NetnsHost:
    namespace: str
    address: str

    def command(self, *argv: str) -> list[str]:
        """argv run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _remove_stale() -> None:
    """Remove namespaces and bridges of earlier runs whose process is gone."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(PREFIX) and "p" in name:
            pid = name[len(PREFIX):].split("h")[0].lstrip("p")
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
    links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        pid = name[len(PREFIX) + 1:]
        if name.startswith(PREFIX + "b") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "link", "del", name], capture_output=True)


@contextmanager
def netns_hosts(count: int, subnet: str = "10.231.77") -> Iterator[list[NetnsHost]]:
    _remove_stale()
    pid = os.getpid()
    bridge = f"{PREFIX}b{pid}"[:15]
    hosts: list[NetnsHost] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for i in range(count):
            namespace = f"{PREFIX}p{pid}h{i}"
            host_leg, ns_leg = f"{PREFIX}{pid % 100000}v{i}", f"{PREFIX}{pid % 100000}n{i}"
            _ip("netns", "add", namespace)
            hosts.append(NetnsHost(namespace, f"{subnet}.{10 + i}"))
            _ip("link", "add", host_leg, "type", "veth", "peer", "name", ns_leg)
            _ip("link", "set", host_leg, "master", bridge)
            _ip("link", "set", host_leg, "up")
            _ip("link", "set", ns_leg, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{hosts[-1].address}/24", "dev", ns_leg)
            _ip("-n", namespace, "link", "set", ns_leg, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            # Multicast needs a route; keep it on the test bridge.
            _ip("-n", namespace, "route", "add", "224.0.0.0/4", "dev", ns_leg)
        yield hosts
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True)
            for pid_line in subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True,
                                           text=True).stdout.split():
                subprocess.run(["kill", "-9", pid_line], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
