"""Hidden states as they cross a shard boundary: raw bytes + dtype + shape, independent of the framework.

This is what lets an MLX shard feed a PyTorch shard and back. bfloat16 has no numpy dtype, so it travels as
its 16-bit pattern and each engine reinterprets it natively.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# dtype name -> numpy dtype with the same bit layout (bfloat16 as raw uint16 bits).
WIRE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}


@dataclass(frozen=True)
class Activations:
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"unsupported activation dtype {self.dtype!r}")
        expected = math.prod(self.shape) * WIRE_DTYPES[self.dtype].itemsize
        if len(self.data) != expected:
            raise ValueError(f"activation payload is {len(self.data)} bytes, shape {self.shape} needs {expected}")

    def bits(self) -> np.ndarray:
        """A read-only numpy view of the payload (bfloat16 appears as uint16 bit patterns)."""
        return np.frombuffer(self.data, dtype=WIRE_DTYPES[self.dtype]).reshape(self.shape)

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> "Activations":
        return cls(dtype=str(obj["dtype"]), shape=tuple(int(d) for d in obj["shape"]), data=bytes(obj["data"]))
