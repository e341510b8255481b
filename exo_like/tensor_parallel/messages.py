"""What a tensor-parallel group's processes say to each other, one typed class per message, msgpack frames
(a 4-byte length, then one map with a string "type") on plain sockets. Never pickle.

Two channels: a node and the worker process it supervises (a socketpair: requests, each answered by Done or
Failed; Ready once the group has formed), and a group's leader and each follower (TCP, authenticated by
control.py: at formation an MLX follower's Offer, then the leader's Formation; then Follow, one per step, never
answered — the all-reduces inside the step keep the ranks in lockstep). Frames that cross the network (the
leader's to a follower, a follower's Offer) are checked field by field as the peer protocol's are.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, TypeVar

import msgpack
import numpy as np

from exo_like.cluster.protocol import ProtocolError, item_from_wire, item_to_wire
from exo_like.cluster.protocol_fields import array, integer, mapping, string
from exo_like.engines.activations import Activations
from exo_like.engines.work import WorkItem
from exo_like.models.config import ModelArgs
from exo_like.models.families import MlaArgs, MoeArgs
from exo_like.models.shard import Shard
from exo_like.models.tensor_split import TensorSplit

# A frame holds at most a step's hidden states or logits: a prefill chunk of 2,048 rows of a 16k-wide model in
# float32 is 128 MiB; logits of 64 sampled rows of a 256k vocabulary 64 MiB.
MAX_FRAME_BYTES = 512 * 1024 * 1024
ARRAY_DTYPES = ("int64", "int32", "float32")
MAX_HOST = 256  # characters of a host name
MAX_RANKS = 256  # ranks of an MLX ring

M = TypeVar("M", bound="Message")
_TYPES: dict[str, type["Message"]] = {}


class Message:
    type: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _TYPES[cls.type] = cls

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_wire(cls: type[M], data: dict[str, Any]) -> M:
        return cls(**{f.name: data[f.name] for f in fields(cls)})  # type: ignore[arg-type]


# -- node -> worker ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Load(Message):
    type: ClassVar[str] = "load"
    model_dir: str
    args: ModelArgs
    shard: Shard

    def to_wire(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir, "args": asdict(self.args), "shard": shard_to_wire(self.shard)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Load":
        return cls(data["model_dir"], args_from_wire(data["args"]), shard_from_wire(data["shard"]))


@dataclass(frozen=True)
class AllocateKV(Message):
    type: ClassVar[str] = "allocate_kv"
    n_blocks: int
    n_window_blocks: int | None


@dataclass(frozen=True)
class Step(Message):
    """The leader's step: token ids (first stage) or the previous stage's hidden states."""

    type: ClassVar[str] = "step"
    items: tuple[WorkItem, ...]
    inputs: np.ndarray | Activations

    def to_wire(self) -> dict[str, Any]:
        return {"items": [item_to_wire(i) for i in self.items], "inputs": payload_to_wire(self.inputs)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Step":
        return cls(tuple(item_from_wire(i) for i in data["items"]), payload_from_wire(data["inputs"]))


@dataclass(frozen=True)
class Describe(Message):
    """Asks for the loaded shard's figures (Done: kv_block_bytes, parameter_bytes, weight forms)."""

    type: ClassVar[str] = "describe"


# -- worker -> node ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ready(Message):
    """The group has formed; what the worker's engine is."""

    type: ClassVar[str] = "ready"
    pid: int
    engine: str
    device_name: str
    on_cpu: bool
    allreduce_ns: int = 0  # the median of the group's all-reduces timed right after forming


@dataclass(frozen=True)
class Done(Message):
    """A request's answer: a step's output in `output`, figures in `values`."""

    type: ClassVar[str] = "done"
    values: dict[str, Any]
    output: np.ndarray | Activations | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"values": self.values, "output": None if self.output is None else payload_to_wire(self.output)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Done":
        output = data.get("output")
        return cls(data["values"], None if output is None else payload_from_wire(output))


@dataclass(frozen=True)
class Failed(Message):
    """A request that raised. `fatal`: the worker exits after sending this (its group is broken)."""

    type: ClassVar[str] = "failed"
    error: str  # the exception's class name
    message: str
    status: int  # an ExoLikeError's HTTP status, else 500
    fatal: bool


# -- leader -> follower -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Formation(Message):
    """Where the framework's collective group forms next. torch: where the leader's rendezvous store listens (the
    first frame on a control channel). MLX: `ring`, every rank's "host:port" in rank order (each rank listens on
    its own; a follower's is the one it offered); the store fields are then empty."""

    type: ClassVar[str] = "formation"
    store_host: str = ""
    store_port: int = 0
    ring: tuple[str, ...] = ()

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Formation":
        ring = data.get("ring") or []
        if not ring:
            return cls(string(data, "store_host", MAX_HOST), integer(data, "store_port", 1, 65535))
        if not isinstance(ring, list) or not 2 <= len(ring) <= MAX_RANKS:
            raise ProtocolError(f"field 'ring' must list 2 to {MAX_RANKS} addresses")
        return cls(ring=tuple(ring_address(entry) for entry in ring))


@dataclass(frozen=True)
class Follow(Message):
    """Run your slice of the layers on these hidden states, in lockstep with the group."""

    type: ClassVar[str] = "follow"
    items: tuple[WorkItem, ...]
    hidden: Activations

    def to_wire(self) -> dict[str, Any]:
        return {"items": [item_to_wire(i) for i in self.items], "hidden": self.hidden.to_wire()}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Follow":
        items = tuple(item_from_wire(i) for i in array(data, "items"))
        hidden = mapping(data.get("hidden"), "hidden")
        try:
            activations = Activations.from_wire(hidden)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"field 'hidden': {exc}") from exc
        if len(activations.shape) != 2 or activations.shape[0] != sum(i.count for i in items):
            raise ProtocolError("field 'hidden' must hold one row per position of the items")
        return cls(items, activations)


# -- follower -> leader -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Offer(Message):
    """An MLX follower's answer to its leader's dial: the address its rank of the ring will listen on (a port it
    holds until the ring has formed)."""

    type: ClassVar[str] = "offer"
    host: str
    port: int

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Offer":
        host, port = string(data, "host", MAX_HOST), integer(data, "port", 1, 65535)
        ring_address(f"{host}:{port}")
        return cls(host, port)


# -- wire forms -------------------------------------------------------------------------------------------------

def ring_address(value: Any) -> str:
    """A ring member's "host:port" (MLX's ring splits it at the first colon: IPv4 addresses or host names)."""
    if not isinstance(value, str) or len(value) > MAX_HOST + 6:
        raise ProtocolError("a ring address must be a short string")
    host, _, port = value.partition(":")
    if not host or ":" in port or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535 or \
            any(c.isspace() for c in host):
        raise ProtocolError(f"{value[:64]!r} is no ring address (host:port)")
    return value


def shard_to_wire(shard: Shard) -> dict[str, Any]:
    tp = None if shard.tp is None else [shard.tp.rank, shard.tp.size]
    return {"model_id": shard.model_id, "start": shard.start_layer, "end": shard.end_layer, "n": shard.n_layers,
            "tp": tp}


def shard_from_wire(data: dict[str, Any]) -> Shard:
    tp = data.get("tp")
    return Shard(string(data, "model_id", 1024), integer(data, "start", 0), integer(data, "end", 1),
                 integer(data, "n", 1), None if tp is None else TensorSplit(int(tp[0]), int(tp[1])))


def args_from_wire(data: dict[str, Any]) -> ModelArgs:
    """ModelArgs from its asdict() form: nested settings rebuilt, msgpack's lists made tuples again."""
    def rebuilt(kind: type, values: dict[str, Any]) -> Any:
        return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    values = dict(data)
    values["moe"] = None if values.get("moe") is None else rebuilt(MoeArgs, values["moe"])
    values["mla"] = None if values.get("mla") is None else rebuilt(MlaArgs, values["mla"])
    return rebuilt(ModelArgs, values)


def payload_to_wire(value: np.ndarray | Activations) -> dict[str, Any]:
    if isinstance(value, Activations):
        return {"activations": value.to_wire()}
    value = np.ascontiguousarray(value)
    if value.dtype.name not in ARRAY_DTYPES:
        raise ValueError(f"arrays of {value.dtype} do not cross to a worker")
    return {"array": {"dtype": value.dtype.name, "shape": list(value.shape), "data": value.tobytes()}}


def payload_from_wire(data: dict[str, Any]) -> np.ndarray | Activations:
    if "activations" in data:
        return Activations.from_wire(data["activations"])
    wire = data["array"]
    if wire["dtype"] not in ARRAY_DTYPES:
        raise ProtocolError(f"arrays of {wire['dtype']} do not cross to a worker")
    return np.frombuffer(wire["data"], dtype=wire["dtype"]).reshape(wire["shape"]).copy()


# -- frames -----------------------------------------------------------------------------------------------------

_LENGTH = struct.Struct(">I")


def send(sock: socket.socket, message: Message) -> None:
    data = msgpack.packb({"type": message.type, **message.to_wire()}, use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit ({message.type})")
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive(sock: socket.socket) -> Message:
    """The next message; EOFError when the other side has closed, ProtocolError for a malformed frame."""
    (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        wire = msgpack.unpackb(_exactly(sock, length), raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed frame: {exc}") from exc
    wire = mapping(wire, "frame")
    kind = _TYPES.get(string(wire, "type"))
    if kind is None:
        raise ProtocolError(f"unknown message type {str(wire['type'])[:64]!r}")
    try:
        return kind.from_wire(wire)
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ProtocolError(f"invalid {kind.type}: {exc!r}") from exc


def _exactly(sock: socket.socket, n: int) -> bytes:
    view, got = bytearray(n), 0
    while got < n:
        chunk = sock.recv_into(memoryview(view)[got:], n - got)
        if not chunk:
            raise EOFError("the other side closed the channel")
        got += chunk
    return bytes(view)
