"""What a node tells its peers about itself when they link: who it is, where it listens, what it computes with."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    name: str
    host: str
    port: int
    engine: str
    device: str
    chip: str
    memory_bytes: int
    version: str
    dtype: str | None = None  # --dtype: weights held in this float dtype; None: as the checkpoint stores them
    tp_port: int = 0  # where its tensor-parallel worker takes a group leader's control channel (0: it takes none)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NodeInfo":
        return cls(
            node_id=str(data["node_id"]), name=str(data["name"]), host=str(data["host"]), port=int(data["port"]),
            engine=str(data["engine"]), device=str(data["device"]), chip=str(data["chip"]),
            memory_bytes=int(data["memory_bytes"]), version=str(data["version"]),
            dtype=_dtype_or_none(data.get("dtype")),  # absent from peers of versions before it was sent
            tp_port=int(data.get("tp_port") or 0),
        )


def _dtype_or_none(value: Any) -> str | None:
    return str(value) if value is not None else None
