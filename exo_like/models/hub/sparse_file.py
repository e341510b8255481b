"""A remote file held in part: the file at its full size with only some byte ranges written (the rest are holes
that take no disk), and a record beside it of which ranges are there.

A node that serves a GGUF model from the hub keeps the model file this way: the header and its own layers'
tensors at their offsets, so the local GGUF reader maps it as if it were whole, and a restart or a new plan
fetches only the ranges the record lacks. The record only ever names bytes that reached the disk: data is
synced before the record that names it is replaced (atomically).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

Range = tuple[int, int]  # [start, end) in bytes
RECORD_SUFFIX = ".ranges.json"


def coalesce(ranges: Iterable[Range], max_gap: int = 0) -> list[Range]:
    """The ranges sorted and merged where they overlap or lie at most `max_gap` bytes apart (the gap joins)."""
    merged: list[Range] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start - merged[-1][1] <= max_gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def subtract(wanted: list[Range], present: list[Range]) -> list[Range]:
    """The parts of `wanted` (coalesced) that `present` (coalesced) does not cover."""
    missing = []
    for start, end in wanted:
        for have_start, have_end in present:
            if have_end <= start or have_start >= end:
                continue
            if have_start > start:
                missing.append((start, have_start))
            start = max(start, have_end)
        if start < end:
            missing.append((start, end))
    return missing


def total(ranges: Iterable[Range]) -> int:
    return sum(end - start for start, end in ranges)


def present_ranges(path: Path, size: int) -> list[Range]:
    """What the record of `path` says is there (nothing without a valid record); reads, never writes."""
    record = _read_record(path, size)
    return record[0] if record else []


def _read_record(path: Path, size: int) -> tuple[list[Range], int | None] | None:
    """(ranges present, header end) from the record of a file of `size` bytes; None if there is no valid one."""
    try:
        record = json.loads(path.with_name(path.name + RECORD_SUFFIX).read_text())
        if int(record["size"]) != size or path.stat().st_size != size:
            return None
        header = record.get("header")
        return coalesce((int(a), int(b)) for a, b in record["ranges"]), None if header is None else int(header)
    except (OSError, ValueError, KeyError, TypeError):
        return None


class SparseFile:
    """One partly held file. Not shared between threads: callers hold a lock on the file while they write."""

    def __init__(self, path: Path, size: int):
        self.path = path
        self.size = size
        self.record_path = path.with_name(path.name + RECORD_SUFFIX)
        self.present: list[Range] = []
        self.header_end: int | None = None  # where a GGUF header ends, once it is here
        self._load()

    def write(self, offset: int, data: bytes) -> None:
        if offset < 0 or offset + len(data) > self.size:
            raise ValueError(f"{self.path.name}: bytes [{offset}, {offset + len(data)}) lie outside its {self.size}")
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def mark(self, start: int, end: int, header: bool = False) -> None:
        """Record [start, end) as present (after syncing the file, so the record never runs ahead of the data)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.present = coalesce([*self.present, (start, end)])
        if header:
            self.header_end = end
        self._save()

    def missing(self, wanted: list[Range]) -> list[Range]:
        return subtract(coalesce(wanted), self.present)

    def _load(self) -> None:
        """Read the record; without a valid one for this size, start empty (the file's bytes are not trusted)."""
        record = _read_record(self.path, self.size)
        if record is not None:
            self.present, self.header_end = record
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as file:  # empty, then the full size as one hole
            file.truncate(self.size)
        self.present, self.header_end = [], None
        self._save()

    def _save(self) -> None:
        record = {"size": self.size, "header": self.header_end, "ranges": [list(r) for r in self.present]}
        temporary = self.record_path.with_name(f"{self.record_path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(record))
        os.replace(temporary, self.record_path)
