"""How long this thread waited for a CPU because other processes held them, as distinct from a CPU quota.

A measured layer speed must show the node's own limits (its hardware, its engine, a CPU quota it runs under) and
not a moment of contention from whatever else runs on the machine while it measures (another benchmark, a
package install): that would make identical machines look different. Linux counts, per thread, the time it was
runnable but not running (/proc/thread-self/schedstat, second field); a quota's throttling counts there too, and
the cgroup's cpu.stat says how long it throttled. Their difference is the contention to leave out. Where either
file is missing (another OS, a kernel without schedstats), nothing is left out. Only the process's own cgroup
is read: a quota set on a parent cgroup alone would be taken for contention and left out too.
"""

from __future__ import annotations

from pathlib import Path

SCHEDSTAT = Path("/proc/thread-self/schedstat")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def waited_ns() -> int:
    """This thread's time runnable but not running, so far (0 where not known)."""
    try:
        return int(SCHEDSTAT.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def throttled_ns() -> int:
    """Time this process's cgroup was throttled by its CPU quota, so far (cgroup v1 or v2; 0 where not known)."""
    for path, key, scale in _cpu_stat_files():
        try:
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value) * scale
        except (OSError, ValueError):
            continue
    return 0


def _cpu_stat_files() -> list[tuple[Path, str, int]]:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy (cpu or cpu,cpuacct)
            for mount in ("cpu", "cpu,cpuacct"):
                files.append((CGROUP_ROOT / mount / relative / "cpu.stat", "throttled_time", 1))
        elif controllers == "":  # v2: the unified hierarchy
            files.append((CGROUP_ROOT / relative / "cpu.stat", "throttled_usec", 1000))
    return files


class ContentionClock:
    """Contention (waiting for a CPU, less quota throttling) accumulated since it was made."""

    def __init__(self) -> None:
        self._start = (waited_ns(), throttled_ns())

    def elapsed_ns(self) -> int:
        waited, throttled = waited_ns() - self._start[0], throttled_ns() - self._start[1]
        return max(0, waited - throttled)
