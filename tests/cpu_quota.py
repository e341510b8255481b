"""A CPU quota for a test's node processes: a cgroup (v1's cpu controller, or v2's cpu.max) that a process joins
before it starts exo-like, removed afterwards whatever happened (its processes are moved back out first).

    reason = CpuQuota.unavailable()      # None, or why no cgroup can be made here (then skip)
    with CpuQuota("exo-like-test", 0.25) as quota:
        start_node(..., preexec=quota.join)
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CpuQuota:
    def __init__(self, name: str, cores: float, period_us: int = PERIOD_US):
        """cores: the share of one CPU the group gets in every period of `period_us` microseconds."""
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        self.cores, self.period_us = cores, period_us
        self.root = _root()
        self.path = self.root / self.name if self.root is not None else None

    @staticmethod
    def unavailable() -> str | None:
        """Why a cgroup with a CPU quota cannot be made here (None: it can), found by making one and removing it."""
        if _root() is None:
            return (f"no writable cgroup cpu controller: neither cgroup v1 {V1_ROOT} nor a cgroup v2 {V2_ROOT} "
                    "with the cpu controller")
        try:
            with CpuQuota("exo-like-probe", 0.5):
                pass
        except OSError as exc:
            return f"cannot make a cgroup with a CPU quota here (needs root on the host's cgroups): {exc}"
        return None

    def __enter__(self) -> "CpuQuota":
        assert self.path is not None and self.root is not None
        if self.root == V2_ROOT:
            (self.root / "cgroup.subtree_control").write_text("+cpu")
        self.path.mkdir()
        try:
            quota = max(1000, int(self.cores * self.period_us))
            if self.root == V2_ROOT:
                (self.path / "cpu.max").write_text(f"{quota} {self.period_us}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        except BaseException:
            self.path.rmdir()
            raise
        return self

    def join(self) -> None:
        """Put the calling process in the cgroup (a subprocess's preexec_fn: before it runs exo-like)."""
        assert self.path is not None
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def __exit__(self, *exc: object) -> None:
        """Move whatever still runs in the cgroup back to the root one, then remove the cgroup."""
        assert self.path is not None and self.root is not None
        deadline = time.monotonic() + 10
        while True:
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    (self.root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # it exited meanwhile
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _root() -> Path | None:
    if (V1_ROOT / "cpu.cfs_quota_us").exists() and os.access(V1_ROOT, os.W_OK):
        return V1_ROOT
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split() and os.access(V2_ROOT, os.W_OK):
        return V2_ROOT
    return None
