"""A GGUF file's header: where it ends, from a prefix of its bytes (how much of a remote file to fetch before any
tensor data), and its metadata and tensor descriptions, from a local file.

The header is the magic and version, the metadata (key, type, value; arrays of them), the tensor descriptions
(name, dimensions, type, offset), then padding to the file's alignment; tensor data starts there. This walks
the layout itself (little-endian files, versions 2 and 3, as llama.cpp writes them). `gguf`'s reader is not used:
it builds numpy views of every array element (two per token of a vocabulary), whose hundreds of MB of short-lived
objects left a node's memory tens of MB larger than the metadata it keeps; here a string becomes one `str` and a
numeric array one list.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exo_like.errors import UnsupportedModelError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# Value type -> its little-endian numpy type, for the fixed-size types (uint8 .. float64; 7 is bool).
_NUMBERS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}
_SIZES = {kind: np.dtype(name).itemsize for kind, name in _NUMBERS.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as GGUF stores them: the fastest-varying first
    type_id: int  # ggml's tensor type
    offset: int  # of its first byte, from the start of the tensor data


@dataclass(frozen=True)
class Header:
    metadata: dict[str, Any]  # every key with its value: strings as str, arrays as lists
    tensors: list[TensorInfo]
    data_start: int  # where tensor data starts in the file


class Truncated(Exception):
    """The prefix ends inside the header."""


def header_end(prefix: bytes, name: str) -> int | None:
    """The offset where tensor data starts, or None if `prefix` ends before the header does."""
    try:
        return _Cursor(prefix, name).header_end()
    except Truncated:
        return None


def read_header(path: Path) -> Header:
    """The metadata and tensor descriptions of a local GGUF file (only the header's pages of it are read)."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _Cursor(data, path.name).header()
        except Truncated:
            raise UnsupportedModelError(f"{path.name} is not a readable GGUF file: it ends inside its header",
                                        code="unsupported_weights") from None


class _Cursor:
    def __init__(self, data: bytes | mmap.mmap, name: str):
        self.data = data
        self.name = name
        self.pos = 0

    def header_end(self) -> int:
        n_tensors, n_kv = self.counts()
        alignment = DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = self.string()
            kind = self.number("<I")
            if key == b"general.alignment" and kind == _UINT32:
                alignment = self.number("<I")
            else:
                self.skip_value(kind)
        for _ in range(n_tensors):
            self.string()
            dims = self.number("<I")
            self.take(8 * dims + 4 + 8)  # dimensions, type, offset
        return -(-self.pos // alignment) * alignment

    def counts(self) -> tuple[int, int]:
        """(tensors, metadata keys), after checking the magic and version."""
        if self.take(4) != MAGIC:
            raise UnsupportedModelError(f"{self.name} is not a GGUF file (no GGUF magic)", code="unsupported_weights")
        version = self.number("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{self.name}: GGUF version {version} is not supported (2 and 3 are)",
                                        code="unsupported_weights")
        return self.number("<Q"), self.number("<Q")

    def header(self) -> Header:
        n_tensors, n_kv = self.counts()
        metadata = {}
        for _ in range(n_kv):
            key = self.text()
            metadata[key] = self.value(self.number("<I"))
        tensors = []
        for _ in range(n_tensors):
            name, n_dims = self.text(), self.number("<I")
            dims = struct.unpack(f"<{n_dims}Q", self.take(8 * n_dims))
            tensors.append(TensorInfo(name, dims, self.number("<I"), self.number("<Q")))
        if len({t.name for t in tensors}) != len(tensors):
            raise UnsupportedModelError(f"{self.name} describes a tensor twice", code="unsupported_weights")
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise UnsupportedModelError(f"{self.name}: alignment {alignment!r} is not a power of two",
                                        code="unsupported_weights")
        return Header(metadata, tensors, -(-self.pos // alignment) * alignment)

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.text()
        if kind == _ARRAY:
            item, count = self.number("<I"), self.number("<Q")
            if item in _NUMBERS:
                return np.frombuffer(self.take(_SIZES[item] * count), dtype=_NUMBERS[item]).tolist()
            return [self.value(item) for _ in range(count)]
        if kind in _NUMBERS:
            return np.frombuffer(self.take(_SIZES[kind]), dtype=_NUMBERS[kind]).item()
        raise UnsupportedModelError(f"{self.name}: unknown GGUF value type {kind}", code="unsupported_weights")

    def text(self) -> str:
        return str(self.string(), encoding="utf-8")

    def take(self, count: int) -> bytes:
        if self.pos + count > len(self.data):
            raise Truncated
        chunk = self.data[self.pos:self.pos + count]
        self.pos += count
        return chunk

    def number(self, fmt: str) -> int:
        return int(struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0])

    def string(self) -> bytes:
        return self.take(self.number("<Q"))

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            self.string()
        elif kind == _ARRAY:
            item, count = self.number("<I"), self.number("<Q")
            if item in _SIZES:
                self.take(_SIZES[item] * count)
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in _SIZES:
            self.take(_SIZES[kind])
        else:
            raise UnsupportedModelError(f"{self.name}: unknown GGUF value type {kind}", code="unsupported_weights")
