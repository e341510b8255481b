"""The peer protocol: every message two nodes exchange, one typed class each, msgpack on the wire. Never pickle.

A frame is one websocket binary message holding one msgpack map with a string "type". `decode` is the only
place a frame becomes a message: it checks the size, the msgpack, the type, and every field's type and range,
and raises ProtocolError for anything else, so the code that handles a message can trust its fields. Fields a
newer peer adds are ignored; a missing or malformed field refuses the frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

from exo_like.cluster.protocol_fields import (  # noqa: F401  (ProtocolError is part of this module's interface)
    INT64,
    MAX_ID,
    MAX_TEXT,
    ProtocolError,
    array,
    binary,
    boolean,
    check_int,
    integer,
    integers,
    mapping,
    node_load,
    number,
    required,
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
PROTOCOL = 8
# Entries in a list of members (addresses shared, linked peers announced): far above any real cluster, and a bound
# on what one peer can make this node remember or dial.
MAX_MEMBERS = 256
MAX_PADDING = 1 << 20  # a Ping's padding (peers.BULK_PING_BYTES)

# -- messages -----------------------------------------------------------------------------------------------

M = TypeVar("M", bound="Message")
_TYPES: dict[str, type["Message"]] = {}


class Message:
    """Base of every peer message: `type` names it on the wire, `to_wire`/`from_wire` (de)serialise its fields."""

    type: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _TYPES[cls.type] = cls

    def to_wire(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_wire(cls: type[M], data: dict[str, Any]) -> M:
        raise NotImplementedError


# Link set-up (peers.py): the acceptor says hello, the dialer proves the key, the acceptor proves it back.

@dataclass(frozen=True)
class Hello(Message):
    type: ClassVar[str] = "hello"
    nonce: bytes
    protocol: int
    version: str

    def to_wire(self) -> dict[str, Any]:
        return {"nonce": self.nonce, "protocol": self.protocol, "version": self.version}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Hello":
        return cls(binary(data, "nonce"), integer(data, "protocol"), string(data, "version"))


@dataclass(frozen=True)
class Auth(Message):
    type: ClassVar[str] = "auth"
    nonce: bytes
    protocol: int
    version: str
    proof: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"nonce": self.nonce, "protocol": self.protocol, "version": self.version, "proof": self.proof}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Auth":
        return cls(binary(data, "nonce"), integer(data, "protocol"), string(data, "version"), binary(data, "proof"))


@dataclass(frozen=True)
class Welcome(Message):
    type: ClassVar[str] = "welcome"
    info: dict[str, Any]  # NodeInfo.to_dict(); NodeInfo.from_dict validates it
    proof: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"info": self.info, "proof": self.proof}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Welcome":
        return cls(_node_info(required(data, "info")), binary(data, "proof"))


@dataclass(frozen=True)
class Info(Message):
    type: ClassVar[str] = "info"
    info: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"info": self.info}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Info":
        return cls(_node_info(required(data, "info")))


def _node_info(value: Any) -> dict[str, Any]:
    """NodeInfo.to_dict() as sent at link set-up, each field checked (NodeInfo.from_dict would take anything)."""
    data = mapping(value, "info")
    info = {key: string(data, key, MAX_TEXT if key == "chip" else MAX_ID)
            for key in ("node_id", "name", "host", "engine", "device", "chip", "version")}
    info.update(port=integer(data, "port", 0, 65535), memory_bytes=integer(data, "memory_bytes", 0),
                dtype=string(data, "dtype", optional=True),  # dtype: absent from peers before it was sent
                tp_port=integer(data, "tp_port", 0, 65535, optional=True) or 0)
    return info


@dataclass(frozen=True)
class Refused(Message):
    """Why a link was refused; with our protocol and version when they are the reason."""

    type: ClassVar[str] = "refused"
    reason: str
    protocol: int | None = None
    version: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"reason": self.reason}
        if self.protocol is not None:
            wire.update(protocol=self.protocol, version=self.version)
        return wire

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Refused":
        return cls(string(data, "reason", MAX_TEXT), integer(data, "protocol", optional=True),
                   string(data, "version", optional=True))


@dataclass(frozen=True)
class Retire(Message):
    """The last frame a side sends on a duplicate link (see peers.py)."""

    type: ClassVar[str] = "retire"

    def to_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Retire":
        return cls()


@dataclass(frozen=True)
class Ping(Message):
    """Asks the peer to echo `sent` (the sender's monotonic clock) at once: the link's round-trip time. `padding`:
    bytes that only make the frame large, so its round trip also tells the link's bandwidth (echoed without it)."""

    type: ClassVar[str] = "ping"
    sent: float
    padding: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        return {"sent": self.sent, **({"padding": self.padding} if self.padding else {})}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Ping":
        padding = binary(data, "padding", MAX_PADDING) if "padding" in data else b""
        return cls(number(data, "sent", 0.0, 1e12), padding)


@dataclass(frozen=True)
class Pong(Ping):
    """The echo of a Ping. (A subclass of Ping: same field; check for it first.)"""

    type: ClassVar[str] = "pong"


@dataclass(frozen=True)
class MemberAddress:
    """Where a member listens, as it advertises itself (its NodeInfo's host and port, never the address its socket
    came from: a peer that dialed in comes from a port nobody can dial)."""

    node_id: str
    host: str
    port: int

    def to_wire(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "host": self.host, "port": self.port}

    @classmethod
    def from_wire(cls, data: Any) -> "MemberAddress":
        data = mapping(data, "members")
        member = cls(string(data, "node_id"), string(data, "host"), integer(data, "port", 1, 65535))
        if not member.host:
            raise ProtocolError("field 'host' must not be empty")  # it would be dialed
        return member


@dataclass(frozen=True)
class PeerAddresses(Message):
    """Where the sender's linked peers listen, sent on every link whenever the sender links with a new peer: a node
    given any one member (a bootstrap address) links with all of them (peers.py)."""

    type: ClassVar[str] = "peer_addresses"
    members: tuple[MemberAddress, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"members": [member.to_wire() for member in self.members]}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "PeerAddresses":
        return cls(tuple(MemberAddress.from_wire(member) for member in bounded(array(data, "members"), "members")))


def bounded(values: list[Any], key: str) -> list[Any]:
    if len(values) > MAX_MEMBERS:
        raise ProtocolError(f"field {key!r} must hold at most {MAX_MEMBERS} entries")
    return values


# Cluster state (membership.py, instances/): sent to every peer on change and every second; doubles as the heartbeat.

KEEP_FOREVER = -1.0  # InstanceState.keep_alive of a request that asked to stay loaded (a negative keep_alive)


@dataclass(frozen=True)
class Wish:
    """One model's register in the replicated set of instances (instances/wishes.py): whether the cluster serves
    it and on which nodes (empty: placement chooses), written with a Lamport clock (counter, writer's node id)."""

    model: str
    clock: tuple[int, str]
    loaded: bool
    nodes: tuple[str, ...] = ()
    instance: str = ""  # the register's key: the model's first instance has none, another "<model>#<n>"

    @property
    def key(self) -> str:
        return self.instance or self.model

    def to_wire(self) -> dict[str, Any]:
        return {"model": self.model, "clock": list(self.clock), "loaded": self.loaded, "nodes": list(self.nodes),
                "instance": self.instance}

    @classmethod
    def from_wire(cls, data: Any) -> "Wish":
        data = mapping(data, "wishes")
        return cls(string(data, "model", 1024), _clock(data), boolean(data, "loaded"),
                   tuple(string({"nodes": n}, "nodes") for n in bounded(array(data, "nodes"), "nodes")),
                   string(data, "instance", 1040))


def _clock(data: dict[str, Any]) -> tuple[int, str]:
    clock = array(data, "clock")
    if len(clock) != 2:
        raise ProtocolError("field 'clock' must be [counter, node id]")
    return check_int(clock[0], "clock", 0, INT64 - 1), string({"clock": clock[1]}, "clock")


@dataclass(frozen=True)
class InstanceState:
    """One instance as its announcer holds it: the plan it agreed to, whether its part of it is loaded (and the KV
    pool it holds for that part), why it cannot serve it, and its own clients' use of the model."""

    model: str
    digest: str | None = None
    ready: bool = False
    problem: str | None = None
    kv_blocks: int | None = None  # KV cache blocks of the announcer's pool for its layers, once loaded
    kv_window_blocks: int | None = None  # the sliding-window layers' pool beside kv_blocks (None: it has none)
    in_flight: int = 0  # the announcer's requests for the model, running or waiting for it
    # Its clients' last request for the model: its keep_alive in seconds (KEEP_FOREVER: keep it loaded; None: no
    # request there since the model was loaded) and how long ago it ran; and whether the announcer keeps the model
    # loaded until it is unloaded by name (--model, the load API).
    keep_alive: float | None = None
    idle_seconds: float | None = None
    pinned: bool = False
    instance: str = ""  # which instance of the model (Wish.instance)

    @property
    def key(self) -> str:
        return self.instance or self.model

    @property
    def kv_size(self) -> KVPoolSize | None:
        return None if self.kv_blocks is None else KVPoolSize(self.kv_blocks, self.kv_window_blocks)

    def to_wire(self) -> dict[str, Any]:
        return {"model": self.model, "digest": self.digest, "ready": self.ready, "problem": self.problem,
                "kv_blocks": self.kv_blocks, "kv_window_blocks": self.kv_window_blocks,
                "in_flight": self.in_flight, "keep_alive": self.keep_alive, "idle_seconds": self.idle_seconds,
                "pinned": self.pinned, "instance": self.instance}

    @classmethod
    def from_wire(cls, data: Any) -> "InstanceState":
        data = mapping(data, "instances")
        keep = number(data, "keep_alive", KEEP_FOREVER, 1e12, optional=True)
        return cls(string(data, "model", 1024), string(data, "digest", optional=True), boolean(data, "ready"),
                   string(data, "problem", MAX_TEXT, optional=True), integer(data, "kv_blocks", 0, optional=True),
                   integer(data, "kv_window_blocks", 0, optional=True), integer(data, "in_flight", 0),
                   keep if keep is None or keep >= 0 else KEEP_FOREVER,
                   number(data, "idle_seconds", 0.0, 1e12, optional=True), boolean(data, "pinned"),
                   string(data, "instance", 1040))


@dataclass(frozen=True)
class PlanState(Message):
    type: ClassVar[str] = "plan_state"
    wishes: tuple[Wish, ...]  # the announcer's copy of the instance registers
    instances: tuple[InstanceState, ...]  # the instances it places, as it holds them
    load: dict[str, Any]  # NodeLoad.to_json(); NodeLoad.from_json reads it tolerantly
    # SpeedFigures.to_json() for each model it places (its placement, measured speed, links' round trips); one
    # without a model when it places none.
    figures: tuple[dict[str, Any], ...] = ()
    linked: tuple[str, ...] = ()  # node ids of the announcer's linked peers: plans need a membership all members see

    def to_wire(self) -> dict[str, Any]:
        return {"wishes": [w.to_wire() for w in self.wishes], "instances": [i.to_wire() for i in self.instances],
                "load": self.load, "figures": list(self.figures), "linked": list(self.linked)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "PlanState":
        figures = tuple(speed_figures(f) for f in bounded(array(data, "figures"), "figures"))
        return cls(tuple(Wish.from_wire(w) for w in bounded(array(data, "wishes"), "wishes")),
                   tuple(InstanceState.from_wire(i) for i in bounded(array(data, "instances"), "instances")),
                   node_load(data.get("load")), tuple(f for f in figures if f is not None),
                   tuple(string({"linked": peer}, "linked") for peer in bounded(array(data, "linked"), "linked")))


# The ring (ring_generator.py, scheduler.py).

MAX_LOGIT_BIAS = 300  # entries of a request's logit_bias (OpenAI's limit)
MAX_LOGPROBS = 20  # the likeliest tokens a request may ask log-probabilities of (OpenAI's limit)
MAX_BIAS = 100.0  # a bias's magnitude (OpenAI's limit)
PENALTY = 1e6  # bounds of the penalties on the wire (the API checks its dialect's own)
MAX_GRAMMAR = 1 << 20  # characters of a request's grammar (a schema, or a forced call of any of many tools)


def sample_to_wire(spec: SampleSpec) -> dict[str, Any]:
    p = spec.params
    wire = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p, "seed": p.seed,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty, "logit_bias": [list(pair) for pair in p.logit_bias],
            "logprobs": p.logprobs, "grammar": p.grammar, "max_tokens": spec.max_tokens, "eos": list(spec.eos),
            "prompt_len": spec.prompt_len}
    if spec.history is not None:
        wire["history"] = list(spec.history)
    if spec.cached:
        wire["cached"] = spec.cached
    return wire


def sample_from_wire(data: Any) -> SampleSpec:
    data = mapping(data, "sample")
    params = SamplingParams(
        number(data, "temperature", 0.0, 1e6), number(data, "top_p", 0.0, 1.0), integer(data, "top_k", 0, INT64 - 1),
        integer(data, "seed", 0, INT64 - 1), number(data, "min_p", 0.0, 1.0),
        number(data, "presence_penalty", -PENALTY, PENALTY), number(data, "frequency_penalty", -PENALTY, PENALTY),
        number(data, "repetition_penalty", 1 / PENALTY, PENALTY), _logit_bias(data),
        integer(data, "logprobs", 0, MAX_LOGPROBS, optional=True), string(data, "grammar", MAX_GRAMMAR, optional=True))
    spec = SampleSpec(params, integer(data, "max_tokens", 1, INT64 - 1), integers(data, "eos"),
                      integer(data, "prompt_len", 1), integers(data, "history") if "history" in data else None,
                      integer(data, "cached", 0, INT64 - 1, optional=True) or 0)
    if spec.cached >= spec.prompt_len:
        raise ProtocolError(f"field 'cached': {spec.cached} tokens, not fewer than the prompt's {spec.prompt_len}")
    if spec.history is not None and len(spec.history) < spec.prompt_len:
        raise ProtocolError(f"field 'history': {len(spec.history)} tokens, fewer than the prompt's {spec.prompt_len}")
    return spec


def _logit_bias(data: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    pairs = array(data, "logit_bias")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ProtocolError(f"field 'logit_bias' must hold at most {MAX_LOGIT_BIAS} entries")
    if not all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
        raise ProtocolError("field 'logit_bias': each entry is [token, bias]")
    return tuple((check_int(token, "logit_bias", 0, 2**31 - 1),
                  number({"logit_bias": bias}, "logit_bias", -MAX_BIAS, MAX_BIAS)) for token, bias in pairs)


def item_to_wire(item: WorkItem) -> dict[str, Any]:
    wire: dict[str, Any] = {"rid": item.rid, "origin": item.origin, "start": item.start, "count": item.count,
                            "blocks": list(item.blocks)}
    if item.sample is not None:
        wire["sample"] = sample_to_wire(item.sample)
    if item.window_blocks is not None:
        wire["window_blocks"], wire["window_first"] = list(item.window_blocks), item.window_first
    return wire


def item_from_wire(data: Any) -> WorkItem:
    data = mapping(data, "items")
    sample = data.get("sample")
    item = WorkItem(string(data, "rid"), string(data, "origin"), integer(data, "start", 0), integer(data, "count", 1),
                    integers(data, "blocks"), None if sample is None else sample_from_wire(sample),
                    integers(data, "window_blocks") if "window_blocks" in data else None,
                    integer(data, "window_first", 0) if "window_blocks" in data else 0)
    # Stages look up the block of every position the item writes before any engine check runs.
    if len(item.blocks) < blocks_for(item.end):
        raise ProtocolError(f"field 'blocks': {len(item.blocks)} blocks cannot hold positions up to {item.end}")
    if item.window_blocks is not None and (item.window_first * BLOCK_SIZE > item.start or
                                           len(item.window_blocks) < blocks_for(item.end) - item.window_first):
        raise ProtocolError(f"field 'window_blocks': blocks {item.window_first} on cannot hold positions "
                            f"[{item.start}, {item.end})")
    # The last stage counts the tokens generated before this one as end - prompt_len (its sampling index).
    if item.sample is not None and item.end < item.sample.prompt_len:
        raise ProtocolError(f"field 'sample': a prompt of {item.sample.prompt_len} tokens does not end by the "
                            f"item's last position {item.end - 1}")
    return item


@dataclass(frozen=True)
class Submit(Message):
    """Origin -> first stage: run a request. `tokens` is everything the ring has to compute (the prompt)."""

    type: ClassVar[str] = "submit"
    rid: str
    origin: str
    digest: str
    tokens: tuple[int, ...]
    sample: SampleSpec

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "origin": self.origin, "digest": self.digest, "tokens": list(self.tokens),
                "sample": sample_to_wire(self.sample)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Submit":
        tokens = integers(data, "tokens", 0, 2**31 - 1)
        if not tokens:
            raise ProtocolError("field 'tokens' must not be empty")
        sample = sample_from_wire(required(data, "sample"))
        # The tokens are the prompt and any tokens generated before a replay: the prompt ends within them.
        if sample.prompt_len > len(tokens):
            raise ProtocolError(f"field 'sample': a prompt of {sample.prompt_len} tokens is longer than the "
                                f"{len(tokens)} tokens sent")
        return cls(string(data, "rid"), string(data, "origin"), string(data, "digest"), tokens, sample)


@dataclass(frozen=True)
class Forward(Message):
    """Stage -> next stage: one batch. `hidden` holds the items' rows in item order ([sum of counts, hidden]).

    `kv_used` is how many KV blocks the ring's requests and prefix cache hold (what every stage reports)."""

    type: ClassVar[str] = "forward"
    digest: str
    items: tuple[WorkItem, ...]
    hidden: Activations
    kv_used: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"digest": self.digest, "items": [item_to_wire(item) for item in self.items],
                "hidden": self.hidden.to_wire(), "kv_used": self.kv_used}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Forward":
        items = tuple(item_from_wire(item) for item in array(data, "items"))
        if not items:
            raise ProtocolError("field 'items' must hold at least one item")
        hidden = _activations(required(data, "hidden"))
        rows = sum(item.count for item in items)
        if len(hidden.shape) != 2 or hidden.shape[0] != rows:
            raise ProtocolError(f"field 'hidden' of shape {list(hidden.shape)} does not hold the items' {rows} rows")
        return cls(string(data, "digest"), items, hidden, integer(data, "kv_used", 0))


def _activations(data: Any) -> Activations:
    data = mapping(data, "hidden")
    dtype = string(data, "dtype")
    if dtype not in WIRE_DTYPES:
        raise ProtocolError(f"field 'dtype': unsupported activation dtype {dtype!r}")
    shape = integers(data, "shape", 0, 2**31 - 1)
    payload = required(data, "data")
    if not isinstance(payload, bytes):
        raise ProtocolError("field 'data' must be bytes")
    try:
        return Activations(dtype, shape, payload)
    except ValueError as exc:
        raise ProtocolError(f"field 'data': {exc}") from exc


@dataclass(frozen=True)
class SampledToken:
    """A token the last stage sampled; with its log-probability and the likeliest tokens' when the request asked,
    and (on a request's first token) the prompt tokens the first stage took from its prefix cache."""

    rid: str
    token: int
    done: bool
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    cached: int = 0

    def to_wire(self) -> list[Any]:
        if self.logprob is None and not self.cached:
            return [self.rid, self.token, self.done]
        wire = [self.rid, self.token, self.done, self.logprob, [list(pair) for pair in self.top_logprobs]]
        return wire + [self.cached] if self.cached else wire

    @classmethod
    def from_wire(cls, data: Any) -> "SampledToken":
        if not isinstance(data, list) or len(data) not in (3, 5, 6):
            raise ProtocolError("field 'tokens': each sampled token is [rid, token, done] or [rid, token, done, "
                                "logprob, top_logprobs] or [rid, token, done, logprob, top_logprobs, cached]")
        rid, token, done = data[:3]
        token_fields = (string({"rid": rid}, "rid"), check_int(token, "token", 0, 2**31 - 1),
                        boolean({"done": done}, "done"))
        if len(data) == 3:
            return cls(*token_fields)
        top = data[4]
        if not isinstance(top, list) or len(top) > MAX_LOGPROBS or \
                not all(isinstance(pair, list) and len(pair) == 2 for pair in top):
            raise ProtocolError(f"field 'top_logprobs': at most {MAX_LOGPROBS} [token, logprob] pairs")
        cached = check_int(data[5], "cached", 0, 2**62) if len(data) == 6 else 0
        return cls(*token_fields, None if data[3] is None and cached else _logprob(data[3]),
                   tuple((check_int(t, "top_logprobs", 0, 2**31 - 1), _logprob(lp)) for t, lp in top), cached)


def _logprob(value: Any) -> float:
    return number({"logprob": value}, "logprob", -1e30, 0.0)


@dataclass(frozen=True)
class Sampled(Message):
    """Last stage -> first stage: the tokens it sampled, the next step's inputs (and which requests are done)."""

    type: ClassVar[str] = "sampled"
    digest: str
    tokens: tuple[SampledToken, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"digest": self.digest, "tokens": [t.to_wire() for t in self.tokens]}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Sampled":
        return cls(string(data, "digest"), tuple(SampledToken.from_wire(t) for t in array(data, "tokens")))


@dataclass(frozen=True)
class Tokens(Sampled):
    """Last stage -> an origin: its requests' tokens to stream. (A subclass of Sampled: same fields, another
    recipient; check for it first.)"""

    type: ClassVar[str] = "tokens"


@dataclass(frozen=True)
class Release(Message):
    """Origin -> first stage: the request is over (client gone, stop string): free its KV blocks."""

    type: ClassVar[str] = "release"
    rid: str

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Release":
        return cls(string(data, "rid"))


@dataclass(frozen=True)
class Error(Message):
    """Any stage -> origin: the request failed; `code` is the API error code the client sees."""

    type: ClassVar[str] = "error"
    rid: str
    message: str
    code: str

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "message": self.message, "code": self.code}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Error":
        return cls(string(data, "rid"), string(data, "message", MAX_TEXT), string(data, "code"))


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
