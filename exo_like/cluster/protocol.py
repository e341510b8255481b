"""The peer protocol: every message two nodes exchange, one typed class each, msgpack on the wire. Never pickle.

A frame is one websocket binary message holding one msgpack map with a string "type". Each message declares its
fields once, with each field's type and range (`Annotated[type, Field or Kind]`, codec.py), and one codec encodes
and decodes them all. `decode` is the only place a frame becomes a message: it checks the size, the msgpack, the
type, and every field's type and range, and raises ProtocolError for anything else, so the code that handles a
message can trust its fields. Fields a newer peer adds are ignored; a missing or malformed field refuses the frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Annotated, Any, ClassVar, TypeVar

import msgpack

from exo_like.cluster.codec import (
    MAY_BE_ABSENT,
    OMIT_DEFAULT,
    Bool,
    Bytes,
    Custom,
    Field,
    Fixed,
    Float,
    Int,
    Nullable,
    Seq,
    Str,
    Struct,
)
from exo_like.cluster.protocol_fields import (  # noqa: F401  (ProtocolError is part of this module's interface)
    INT64,
    MAX_ID,
    MAX_TEXT,
    ProtocolError,
    integer,
    mapping,
    node_load,
    speed_figures,
    string,
)
from exo_like.engines.activations import WIRE_DTYPES, Activations
from exo_like.engines.work import (  # noqa: F401  (part of the protocol's interface)
    BLOCK_SIZE, KVPoolSize, SampleSpec, SamplingParams, WorkItem, blocks_for)

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024

# Raise it whenever a message changes so that a node of the previous version would misread it. Nodes link only
# with nodes of the same number (checked first thing at link set-up, see peers.py).
# 1: the first numbered protocol (hub models keyed org/name@commit, plan digests, step times).
# 2: typed messages; batches of work items with KV block tables cross the ring (continuous batching).
# 3: plan announcements carry speed figures and link round trips; plans place layers by speed.
# 4: linked nodes exchange where their members listen (PeerAddresses); plan announcements name the announcer's
#    linked peers, and plans are made only over a membership every member sees.
# 5: a node says where its tensor-parallel workers take their leader's control channel (NodeInfo.tp_port); plan
#    stages may be tensor-parallel groups; speed figures carry --parallel.
# 6: a request's sampling carries min-p, penalties, logit bias and how many log-probabilities it wants (and its
#    token history where the penalties need it); sampled tokens carry their log-probabilities.
# 7: a request's sampling may carry a grammar (structured output, forced tool calls), sent with its history.
# 8: several models at once: plan announcements carry the replicated instance registers, each instance's plan
#    digest and readiness, and speed figures per model.
# 9: every message declared once and read by one codec (codec.py); the same fields.
PROTOCOL = 10
# Entries in a list of members (addresses shared, linked peers announced): far above any real cluster, and a bound
# on what one peer can make this node remember or dial.
MAX_MEMBERS = 256
MAX_PADDING = 1 << 20  # a Ping's padding (peers.BULK_PING_BYTES)

# -- messages -----------------------------------------------------------------------------------------------

M = TypeVar("M", bound="Message")
_TYPES: dict[str, type["Message"]] = {}
TOKEN = Int(0, 2**31 - 1)  # a token id
NODE_ID = Str()


W = TypeVar("W", bound="Wired")


class Wired:
    """A dataclass whose fields, each annotated with its wire kind, are its schema (codec.Struct.of), which encodes
    and decodes it; `check` (optional) checks the decoded fields together; `wire_options` are the Struct's."""

    wire_options: ClassVar[dict[str, Any]] = {}

    @classmethod
    def schema(cls) -> Struct:
        return _schema(cls)

    def to_wire(self) -> Any:
        return self.schema().encode(self)

    @classmethod
    def from_wire(cls: type[W], data: Any) -> W:
        return cls.schema().decode(data, cls.__name__)


@cache
def _schema(cls: type) -> Struct:
    return Struct.of(cls, check=getattr(cls, "check", None), **cls.wire_options)  # type: ignore[attr-defined]


class Message(Wired):
    """Base of every peer message: `type` names it on the wire; the rest of the frame is its fields."""

    type: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _TYPES[cls.type] = cls

    @classmethod
    def from_wire(cls: type[M], data: dict[str, Any]) -> M:
        return cls.schema().decode_map(data)


# Link set-up (peers.py): the acceptor says hello, the dialer proves the key, the acceptor proves it back.

@dataclass(frozen=True)
class Hello(Message):
    type: ClassVar[str] = "hello"
    nonce: Annotated[bytes, Bytes()]
    protocol: Annotated[int, Int()]
    version: Annotated[str, Str()]


@dataclass(frozen=True)
class Auth(Message):
    type: ClassVar[str] = "auth"
    nonce: Annotated[bytes, Bytes()]
    protocol: Annotated[int, Int()]
    version: Annotated[str, Str()]
    proof: Annotated[bytes, Bytes()]


def _node_info(value: Any) -> dict[str, Any]:
    """NodeInfo.to_dict() as sent at link set-up, each field checked (NodeInfo.from_dict would take anything)."""
    data = mapping(value, "info")
    info = {key: string(data, key, MAX_TEXT if key == "chip" else MAX_ID)
            for key in ("node_id", "name", "host", "engine", "device", "chip", "version")}
    info.update(port=integer(data, "port", 0, 65535), memory_bytes=integer(data, "memory_bytes", 0),
                dtype=string(data, "dtype", optional=True),  # dtype: absent from peers before it was sent
                tp_port=integer(data, "tp_port", 0, 65535, optional=True) or 0)
    return info


NODE_INFO = Custom(_node_info)  # NodeInfo.to_dict(); NodeInfo.from_dict validates it


@dataclass(frozen=True)
class Welcome(Message):
    type: ClassVar[str] = "welcome"
    info: Annotated[dict[str, Any], NODE_INFO]
    proof: Annotated[bytes, Bytes()]


@dataclass(frozen=True)
class Info(Message):
    type: ClassVar[str] = "info"
    info: Annotated[dict[str, Any], NODE_INFO]


@dataclass(frozen=True)
class Refused(Message):
    """Why a link was refused; with our protocol and version when they are the reason."""

    type: ClassVar[str] = "refused"
    reason: Annotated[str, Str(MAX_TEXT)]
    protocol: Annotated[int | None, Field(Nullable(Int()), OMIT_DEFAULT)] = None
    version: Annotated[str | None, Field(Nullable(Str()), OMIT_DEFAULT)] = None


@dataclass(frozen=True)
class Retire(Message):
    """The last frame a side sends on a duplicate link (see peers.py)."""

    type: ClassVar[str] = "retire"


@dataclass(frozen=True)
class Ping(Message):
    """Asks the peer to echo `sent` (the sender's monotonic clock) at once: the link's round-trip time. `padding`:
    bytes that only make the frame large, so its round trip also tells the link's bandwidth (echoed without it)."""

    type: ClassVar[str] = "ping"
    sent: Annotated[float, Float(0.0, 1e12)]
    padding: Annotated[bytes, Field(Bytes(MAX_PADDING), OMIT_DEFAULT)] = b""


@dataclass(frozen=True)
class Pong(Ping):
    """The echo of a Ping. (A subclass of Ping: same field; check for it first.)"""

    type: ClassVar[str] = "pong"


@dataclass(frozen=True)
class MemberAddress(Wired):
    """Where a member listens, as it advertises itself (its NodeInfo's host and port, never the address its socket
    came from: a peer that dialed in comes from a port nobody can dial)."""

    node_id: Annotated[str, NODE_ID]
    host: Annotated[str, Str(nonempty=True)]  # it would be dialed
    port: Annotated[int, Int(1, 65535)]


@dataclass(frozen=True)
class PeerAddresses(Message):
    """Where the sender's linked peers listen, sent on every link whenever the sender links with a new peer: a node
    given any one member (a bootstrap address) links with all of them (peers.py)."""

    type: ClassVar[str] = "peer_addresses"
    members: Annotated[tuple[MemberAddress, ...], Seq(MemberAddress.schema(), MAX_MEMBERS)]


# Cluster state (membership.py, instances/): sent to every peer on change and every second; doubles as the heartbeat.

KEEP_FOREVER = -1.0  # InstanceState.keep_alive of a request that asked to stay loaded (a negative keep_alive)


@dataclass(frozen=True)
class Wish(Wired):
    """One model's register in the replicated set of instances (instances/wishes.py): whether the cluster serves
    it and on which nodes (empty: placement chooses), written with a Lamport clock (counter, writer's node id)."""

    model: Annotated[str, Str(1024)]
    clock: Annotated[tuple[int, str], Fixed((Int(0, INT64 - 1), NODE_ID), "[counter, node id]")]
    loaded: Annotated[bool, Bool()]
    nodes: Annotated[tuple[str, ...], Seq(NODE_ID, MAX_MEMBERS)] = ()
    instance: Annotated[str, Str(1040)] = ""  # the register's key: the model's first instance has none, another
    # "<model>#<n>"

    @property
    def key(self) -> str:
        return self.instance or self.model


def _keep_alive(value: Any) -> float | None:
    """A request's keep_alive in seconds; any negative one (KEEP_FOREVER) reads as KEEP_FOREVER."""
    keep = Nullable(Float(KEEP_FOREVER, 1e12)).decode(value, "keep_alive")
    return keep if keep is None or keep >= 0 else KEEP_FOREVER


@dataclass(frozen=True)
class InstanceState(Wired):
    """One instance as its announcer holds it: the plan it agreed to, whether its part of it is loaded (and the KV
    pool it holds for that part), why it cannot serve it, and its own clients' use of the model."""

    model: Annotated[str, Str(1024)]
    digest: Annotated[str | None, Field(Nullable(Str()), MAY_BE_ABSENT)] = None
    ready: Annotated[bool, Bool()] = False
    problem: Annotated[str | None, Field(Nullable(Str(MAX_TEXT)), MAY_BE_ABSENT)] = None
    # KV cache blocks of the announcer's pool for its layers, once loaded; the sliding-window layers' pool beside
    # them (None: it has none)
    kv_blocks: Annotated[int | None, Field(Nullable(Int(0)), MAY_BE_ABSENT)] = None
    kv_window_blocks: Annotated[int | None, Field(Nullable(Int(0)), MAY_BE_ABSENT)] = None
    in_flight: Annotated[int, Int(0)] = 0  # the announcer's requests for the model, running or waiting for it
    # Its clients' last request for the model: its keep_alive in seconds (KEEP_FOREVER: keep it loaded; None: no
    # request there since the model was loaded) and how long ago it ran; and whether the announcer keeps the model
    # loaded until it is unloaded by name (--model, the load API).
    keep_alive: Annotated[float | None, Field(Custom(_keep_alive), MAY_BE_ABSENT)] = None
    idle_seconds: Annotated[float | None, Field(Nullable(Float(0.0, 1e12)), MAY_BE_ABSENT)] = None
    pinned: Annotated[bool, Bool()] = False
    instance: Annotated[str, Str(1040)] = ""  # which instance of the model (Wish.instance)

    @property
    def key(self) -> str:
        return self.instance or self.model

    @property
    def kv_size(self) -> KVPoolSize | None:
        return None if self.kv_blocks is None else KVPoolSize(self.kv_blocks, self.kv_window_blocks)


def _announced_figures(value: Any) -> tuple[dict[str, Any], ...]:
    figures = Seq(Custom(speed_figures), MAX_MEMBERS).decode(value, "figures")
    return tuple(f for f in figures if f is not None)


@dataclass(frozen=True)
class PlanState(Message):
    type: ClassVar[str] = "plan_state"
    # the announcer's copy of the instance registers, and the instances it places, as it holds them
    wishes: Annotated[tuple[Wish, ...], Seq(Wish.schema(), MAX_MEMBERS)]
    instances: Annotated[tuple[InstanceState, ...], Seq(InstanceState.schema(), MAX_MEMBERS)]
    # NodeLoad.to_json(); NodeLoad.from_json reads it tolerantly
    load: Annotated[dict[str, Any], Field(Custom(node_load), MAY_BE_ABSENT)] = field(default_factory=dict)
    # SpeedFigures.to_json() for each model it places (its placement, measured speed, links' round trips); one
    # without a model when it places none.
    figures: Annotated[tuple[dict[str, Any], ...], Custom(_announced_figures)] = ()
    # node ids of the announcer's linked peers: plans need a membership all members see
    linked: Annotated[tuple[str, ...], Seq(NODE_ID, MAX_MEMBERS)] = ()


# The ring (ring_generator.py, scheduler.py).

MAX_LOGIT_BIAS = 300  # entries of a request's logit_bias (OpenAI's limit)
MAX_LOGPROBS = 20  # the likeliest tokens a request may ask log-probabilities of (OpenAI's limit)
MAX_BIAS = 100.0  # a bias's magnitude (OpenAI's limit)
PENALTY = 1e6  # bounds of the penalties on the wire (the API checks its dialect's own)
MAX_GRAMMAR = 1 << 20  # characters of a request's grammar (a schema, or a forced call of any of many tools)
MAX_DRAFT = 64  # tokens a verification step may propose for one request (serving/speculative.py)

SAMPLING_PARAMS = Struct(SamplingParams, {
    "temperature": Float(0.0, 1e6), "top_p": Float(0.0, 1.0), "top_k": Int(0, INT64 - 1), "seed": Int(0, INT64 - 1),
    "min_p": Float(0.0, 1.0), "presence_penalty": Float(-PENALTY, PENALTY),
    "frequency_penalty": Float(-PENALTY, PENALTY), "repetition_penalty": Float(1 / PENALTY, PENALTY),
    "logit_bias": Seq(Fixed((TOKEN, Float(-MAX_BIAS, MAX_BIAS)), "[token, bias]"), MAX_LOGIT_BIAS),
    "logprobs": Field(Nullable(Int(0, MAX_LOGPROBS)), MAY_BE_ABSENT),
    "grammar": Field(Nullable(Str(MAX_GRAMMAR)), MAY_BE_ABSENT)})


def _check_sample(values: dict[str, Any]) -> None:
    if values["cached"] >= values["prompt_len"]:
        raise ProtocolError(f"field 'cached': {values['cached']} tokens, not fewer than the prompt's "
                            f"{values['prompt_len']}")
    if values["history"] is not None and len(values["history"]) < values["prompt_len"]:
        raise ProtocolError(f"field 'history': {len(values['history'])} tokens, fewer than the prompt's "
                            f"{values['prompt_len']}")


# A request's sampling: its parameters and the spec's own fields in one map.
SAMPLE = Struct(SampleSpec, {
    "params": SAMPLING_PARAMS, "max_tokens": Int(1, INT64 - 1), "eos": Seq(Int(0)), "prompt_len": Int(1),
    "history": Field(Nullable(Seq(Int(0))), OMIT_DEFAULT), "cached": Field(Int(0, INT64 - 1), OMIT_DEFAULT),
    "draft": Field(Seq(TOKEN, MAX_DRAFT), OMIT_DEFAULT)},
    flatten=["params"], check=_check_sample)


def _check_item(values: dict[str, Any]) -> None:
    start, end, sample = values["start"], values["start"] + values["count"], values["sample"]
    # Stages look up the block of every position the item writes before any engine check runs.
    if len(values["blocks"]) < blocks_for(end):
        raise ProtocolError(f"field 'blocks': {len(values['blocks'])} blocks cannot hold positions up to {end}")
    window, first = values["window_blocks"], values["window_first"]
    if window is not None and (first * BLOCK_SIZE > start or len(window) < blocks_for(end) - first):
        raise ProtocolError(f"field 'window_blocks': blocks {first} on cannot hold positions [{start}, {end})")
    # The last stage counts the tokens generated before its first sampled row's as end - draft - prompt_len.
    if sample is not None and end - len(sample.draft) < sample.prompt_len:
        raise ProtocolError(f"field 'sample': a prompt of {sample.prompt_len} tokens does not end by the "
                            f"item's first sampled position {end - len(sample.draft) - 1}")
    if sample is not None and len(sample.draft) >= values["count"]:
        raise ProtocolError(f"field 'draft': {len(sample.draft)} proposed tokens need more than the item's "
                            f"{values['count']} positions")


ITEM = Struct(WorkItem, {
    "rid": Str(), "origin": NODE_ID, "start": Int(0), "count": Int(1), "blocks": Seq(Int(0)),
    "sample": Field(Nullable(SAMPLE), OMIT_DEFAULT), "window_blocks": Field(Nullable(Seq(Int(0))), OMIT_DEFAULT),
    "window_first": Field(Int(0), with_field="window_blocks")}, check=_check_item)


def item_to_wire(item: WorkItem) -> dict[str, Any]:
    return ITEM.encode(item)  # type: ignore[return-value]


def item_from_wire(data: Any) -> WorkItem:
    return ITEM.decode(data, "items")


@dataclass(frozen=True)
class Submit(Message):
    """Origin -> first stage: run a request. `tokens` is everything the ring has to compute (the prompt)."""

    type: ClassVar[str] = "submit"
    rid: Annotated[str, Str()]
    origin: Annotated[str, NODE_ID]
    digest: Annotated[str, Str()]
    tokens: Annotated[tuple[int, ...], Seq(TOKEN, nonempty=True)]
    sample: Annotated[SampleSpec, SAMPLE]

    @staticmethod
    def check(values: dict[str, Any]) -> None:
        # The tokens are the prompt and any tokens generated before a replay: the prompt ends within them.
        if values["sample"].prompt_len > len(values["tokens"]):
            raise ProtocolError(f"field 'sample': a prompt of {values['sample'].prompt_len} tokens is longer than "
                                f"the {len(values['tokens'])} tokens sent")


def _check_activations(values: dict[str, Any]) -> None:
    expected = WIRE_DTYPES[values["dtype"]].itemsize
    for size in values["shape"]:
        expected *= size
    if len(values["data"]) != expected:
        raise ProtocolError(f"field 'data': {len(values['data'])} bytes, shape {list(values['shape'])} needs {expected}")


ACTIVATIONS = Struct(Activations, {
    "dtype": Str(choices=tuple(WIRE_DTYPES)), "shape": Seq(Int(0, 2**31 - 1)), "data": Bytes(2**62)},
    check=_check_activations)


@dataclass(frozen=True)
class Forward(Message):
    """Stage -> next stage: one batch. `hidden` holds the items' rows in item order ([sum of counts, hidden]).

    `kv_used` is how many KV blocks the ring's requests and prefix cache hold (what every stage reports)."""

    type: ClassVar[str] = "forward"
    digest: Annotated[str, Str()]
    items: Annotated[tuple[WorkItem, ...], Seq(ITEM, nonempty=True)]
    hidden: Annotated[Activations, ACTIVATIONS]
    kv_used: Annotated[int, Int(0)] = 0

    @staticmethod
    def check(values: dict[str, Any]) -> None:
        rows, shape = sum(item.count for item in values["items"]), values["hidden"].shape
        if len(shape) != 2 or shape[0] != rows:
            raise ProtocolError(f"field 'hidden' of shape {list(shape)} does not hold the items' {rows} rows")


LOGPROB = Float(-1e30, 0.0)


@dataclass(frozen=True)
class SampledToken(Wired):
    """A token the last stage sampled; with its log-probability and the likeliest tokens' when the request asked,
    and (on a request's first token) the prompt tokens the first stage took from its prefix cache. Sent as a list,
    [rid, token, done] and the rest only where set."""

    rid: Annotated[str, Str()]
    token: Annotated[int, TOKEN]
    done: Annotated[bool, Bool()]
    logprob: Annotated[float | None, Field(Nullable(LOGPROB), OMIT_DEFAULT)] = None
    top_logprobs: Annotated[tuple[tuple[int, float], ...], Field(
        Seq(Fixed((TOKEN, LOGPROB), "[token, logprob]"), MAX_LOGPROBS), OMIT_DEFAULT)] = ()
    cached: Annotated[int, Field(Int(0, 2**62), OMIT_DEFAULT)] = 0

    wire_options: ClassVar[dict[str, Any]] = {"positional": True,
                                              "shape": "[rid, token, done, logprob, top_logprobs, cached]"}


@dataclass(frozen=True)
class Sampled(Message):
    """Last stage -> first stage: the tokens it sampled, the next step's inputs (and which requests are done)."""

    type: ClassVar[str] = "sampled"
    digest: Annotated[str, Str()]
    tokens: Annotated[tuple[SampledToken, ...], Seq(SampledToken.schema())]


@dataclass(frozen=True)
class Tokens(Sampled):
    """Last stage -> an origin: its requests' tokens to stream. (A subclass of Sampled: same fields, another
    recipient; check for it first.)"""

    type: ClassVar[str] = "tokens"


@dataclass(frozen=True)
class Release(Message):
    """Origin -> first stage: the request is over (client gone, stop string): free its KV blocks."""

    type: ClassVar[str] = "release"
    rid: Annotated[str, Str()]


@dataclass(frozen=True)
class Error(Message):
    """Any stage -> origin: the request failed; `code` is the API error code the client sees."""

    type: ClassVar[str] = "error"
    rid: Annotated[str, Str()]
    message: Annotated[str, Str(MAX_TEXT)]
    code: Annotated[str, Str()]


# -- frames -------------------------------------------------------------------------------------------------


def encode(message: Message, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    data = msgpack.packb({"type": message.type, **message.to_wire()}, use_bin_type=True)
    if len(data) > max_bytes:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the {max_bytes}-byte limit ({message.type})")
    return data


def handshake_protocol(data: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> tuple[str, int | None, str | None]:
    """(type, protocol, version) of a link set-up frame, read before `decode`: a peer of another protocol (or of
    none: versions before protocol numbers) may send frames this version cannot decode, and must be told which
    versions met rather than that its frame is malformed. Protocol and version are None when absent or odd."""
    wire = _unpack(data, max_bytes)
    protocol, version = wire.get("protocol"), wire.get("version")
    protocol = protocol if isinstance(protocol, int) and not isinstance(protocol, bool) else None
    version = version[:MAX_ID] if isinstance(version, str) else None
    return wire["type"][:MAX_ID], protocol, version


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """The message a frame holds; ProtocolError for anything that is not exactly one valid message."""
    wire = _unpack(data, max_bytes)
    kind = _TYPES.get(wire["type"])
    if kind is None:
        raise ProtocolError(f"unknown message type {wire['type'][:MAX_ID]!r}")
    try:
        return kind.from_wire(wire)
    except ProtocolError as exc:
        raise ProtocolError(f"invalid {kind.type}: {exc}") from exc
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:  # a reader this file missed
        raise ProtocolError(f"invalid {kind.type}: {exc!r}") from exc


def _unpack(data: bytes, max_bytes: int) -> dict[str, Any]:
    if len(data) > max_bytes:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        wire = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        # FormatError (a byte no msgpack value starts with) says nothing more than its name
        raise ProtocolError(f"undecodable frame: {str(exc) or type(exc).__name__}") from exc
    if not isinstance(wire, dict) or not isinstance(wire.get("type"), str):
        raise ProtocolError("a frame must be a map with a string 'type'")
    return wire
