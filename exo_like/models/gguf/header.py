"""Where a GGUF file's header ends, from a prefix of its bytes: how much of a remote file to fetch before any
tensor data.

The header is the magic and version, the metadata (key, type, value; arrays of them), the tensor descriptions
(name, dimensions, type, offset), then padding to the file's alignment; tensor data starts there. `gguf`'s
reader only opens whole files, so this walks the layout itself (little-endian files, versions 2 and 3, as
llama.cpp writes them) without decoding values, and says when the prefix is too short.
"""

from __future__ import annotations

import struct

from exo_like.errors import UnsupportedModelError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# Value type -> bytes, for the fixed-size types (uint8 .. float64; 7 is bool).
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class Truncated(Exception):
    """The prefix ends inside the header."""


def header_end(prefix: bytes, name: str) -> int | None:
    """The offset where tensor data starts, or None if `prefix` ends before the header does."""
    try:
        return _Cursor(prefix, name).header_end()
    except Truncated:
        return None


class _Cursor:
    def __init__(self, data: bytes, name: str):
        self.data = data
        self.name = name
        self.pos = 0

    def header_end(self) -> int:
        if self.take(4) != MAGIC:
            raise UnsupportedModelError(f"{self.name} is not a GGUF file (no GGUF magic)", code="unsupported_weights")
        version = self.number("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{self.name}: GGUF version {version} is not supported (2 and 3 are)",
                                        code="unsupported_weights")
        n_tensors, n_kv = self.number("<Q"), self.number("<Q")
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
