"""Download progress: one tracker per node, shared with peers (in /v1/cluster) and drawn in the terminal.

Download threads report bytes as they arrive; the tracker turns them into bytes done / total, speed and ETA.
The terminal shows a tqdm bar when stderr is a terminal, and one log line every few seconds when it is not
(a log file, journald), so logs stay readable.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from exo_like.meter import RateMeter

log = logging.getLogger(__name__)

SPEED_WINDOW_SECONDS = 5.0  # long enough to smooth bursty chunks, short enough to follow a stall
DRAW_INTERVAL = 0.5
LOG_INTERVAL = 5.0


@dataclass(frozen=True)
class DownloadStatus:
    """What one node reports about its download (the same shape on every node's /v1/cluster)."""

    label: str  # model and layer range, e.g. "org/model layers [0, 12)"
    state: str  # "downloading" | "complete" | "failed"
    done_bytes: int
    total_bytes: int
    files_done: int
    files_total: int
    bytes_per_second: float = 0.0
    error: str | None = None

    @property
    def percent(self) -> float:
        return 100.0 if self.total_bytes == 0 else 100.0 * self.done_bytes / self.total_bytes

    @property
    def eta_seconds(self) -> float | None:
        if self.state != "downloading" or self.bytes_per_second <= 0:
            return None
        return (self.total_bytes - self.done_bytes) / self.bytes_per_second

    def describe(self) -> str:
        """One line for logs and 503 messages."""
        text = (f"{self.label}: {self.state} {self.percent:.0f}% ({_size(self.done_bytes)} of "
                f"{_size(self.total_bytes)}, {self.files_done} of {self.files_total} files")
        if self.state == "downloading":
            eta = self.eta_seconds
            text += f", {_size(self.bytes_per_second)}/s" + (f", ETA {eta:.0f}s" if eta is not None else "")
        return text + ")" + (f": {self.error}" if self.error else "")

    def to_json(self) -> dict[str, Any]:
        eta = self.eta_seconds
        return {"label": self.label, "state": self.state, "done_bytes": self.done_bytes,
                "total_bytes": self.total_bytes, "percent": round(self.percent, 1), "files_done": self.files_done,
                "files_total": self.files_total, "bytes_per_second": round(self.bytes_per_second),
                "eta_seconds": None if eta is None else round(eta, 1), "error": self.error}

    @classmethod
    def from_json(cls, data: Any) -> "DownloadStatus | None":
        """Tolerant: a peer without downloads (or of an older version) announces none."""
        if not isinstance(data, dict):
            return None
        return cls(str(data.get("label", "")), str(data.get("state", "")), int(data.get("done_bytes", 0)),
                   int(data.get("total_bytes", 0)), int(data.get("files_done", 0)), int(data.get("files_total", 0)),
                   float(data.get("bytes_per_second", 0.0)), data.get("error"))


class DownloadProgress:
    """This node's current download. Thread-safe: download threads call add() and file_done()."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: DownloadStatus | None = None
        self._files: dict[str, tuple[int, int]] = {}  # name -> (bytes on disk, size) of the tracked files
        self._speed = RateMeter(SPEED_WINDOW_SECONDS)

    def start(self, label: str, sizes: dict[str, int], on_disk: dict[str, int]) -> None:
        """Track a new set of files; bytes already on disk (whole or partial files) count as done."""
        with self._lock:
            self._files = {name: (min(on_disk.get(name, 0), size), size) for name, size in sizes.items()}
            self._speed = RateMeter(SPEED_WINDOW_SECONDS)
            self._status = self._summary(label, "downloading")

    def add(self, name: str, count: int) -> None:
        with self._lock:
            if name not in self._files or self._status is None:
                return  # a file of an earlier plan that is still finishing
            done, size = self._files[name]
            self._files[name] = (max(0, min(done + count, size)), size)
            self._speed.add(count)
            self._status = self._summary(self._status.label, self._status.state)

    def file_done(self, name: str) -> None:
        with self._lock:
            if name in self._files and self._status is not None:
                self._files[name] = (self._files[name][1], self._files[name][1])
                self._status = self._summary(self._status.label, self._status.state)

    def finish(self) -> None:
        self._end("complete", None)

    def fail(self, error: str) -> None:
        self._end("failed", error)

    def status(self) -> DownloadStatus | None:
        with self._lock:
            if self._status is not None and self._status.state == "downloading":
                self._status = self._summary(self._status.label, "downloading")  # refresh the speed
            return self._status

    def _end(self, state: str, error: str | None) -> None:
        with self._lock:
            if self._status is not None:
                self._status = self._summary(self._status.label, state, error)

    def _summary(self, label: str, state: str, error: str | None = None) -> DownloadStatus:
        done = sum(d for d, _ in self._files.values())
        total = sum(s for _, s in self._files.values())
        files_done = sum(1 for d, s in self._files.values() if d == s)
        speed = self._speed.rate() if state == "downloading" else 0.0
        return DownloadStatus(label, state, done, total, files_done, len(self._files), speed, error)


async def show_progress(progress: DownloadProgress, node_id: str) -> None:
    """Draw the download in the terminal until cancelled: a bar on a TTY, else a log line every few seconds."""
    bar: tqdm | None = None
    shown: DownloadStatus | None = None
    logged_at = 0.0
    loop = asyncio.get_running_loop()
    try:
        while True:
            await asyncio.sleep(DRAW_INTERVAL)
            status = progress.status()
            if status is None or status == shown:
                continue
            if sys.stderr.isatty():
                bar = _draw_bar(bar, status, shown, node_id)
            elif status.state != "downloading" or shown is None or shown.label != status.label \
                    or loop.time() - logged_at >= LOG_INTERVAL:
                log.info("node %s: %s", node_id, status.describe())
                logged_at = loop.time()
            shown = status
    finally:
        if bar is not None:
            bar.close()


def _draw_bar(bar: tqdm | None, status: DownloadStatus, shown: DownloadStatus | None, node_id: str) -> tqdm | None:
    if bar is None or shown is None or shown.label != status.label:
        if bar is not None:
            bar.close()
        bar = tqdm(total=status.total_bytes, initial=status.done_bytes, unit="B", unit_scale=True,
                   unit_divisor=1024, desc=f"[{node_id}] {status.label}", dynamic_ncols=True, file=sys.stderr)
    else:
        bar.update(status.done_bytes - bar.n)  # update(), not n=: tqdm derives speed and ETA from updates
    if status.state != "downloading":
        bar.set_postfix_str(status.state if status.error is None else f"failed: {status.error}")
        bar.close()
        return None
    return bar


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"
