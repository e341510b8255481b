"""The peer protocol: every message survives the wire, every field is checked, and no frame whatever makes
`decode` raise anything but ProtocolError (peers.py refuses such a frame and keeps the link)."""

from __future__ import annotations

import copy
import json
import math
import typing
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo_like.cluster import protocol
from exo_like.engines.activations import Activations
from exo_like.models.hub.progress import DownloadStatus
from exo_like.cluster.node_info import NodeInfo
from exo_like.cluster.node_load import NodeLoad
from partitioning.speed_figures import SpeedFigures
from exo_like.cluster.protocol import (
    KEEP_FOREVER,
    InstanceState,
    Wish,
    MAX_MEMBERS, PROTOCOL, Auth, Error, Forward, Hello, Info, MemberAddress, Message, PeerAddresses, Ping,
    PlanState, Pong, ProtocolError, Refused, Release, Retire, Sampled, SampledToken, Submit, Tokens, Welcome,
    decode, encode, handshake_protocol,
)
from exo_like.engines.work import SampleSpec, SamplingParams, WorkItem

INFO = NodeInfo("node-a", "studio", "10.0.0.5", 52415, "torch", "cpu", "x86_64", 16 << 30, "0.1.0", "float32")
SAMPLE = SampleSpec(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=1234, min_p=0.05, presence_penalty=0.5,
                                   frequency_penalty=-0.25, repetition_penalty=1.1, logit_bias=((3, -5.0), (17, 2.5)),
                                   logprobs=3, grammar="start: \"yes\" | \"no\""),
                    max_tokens=32, eos=(2, 151645), prompt_len=5, history=(1, 2, 3, 4, 5, 9))
HIDDEN = Activations("float32", (5, 4), np.arange(20, dtype=np.float32).tobytes())

HELLO = Hello(b"n" * 16, PROTOCOL, "0.1.0")
WELCOME = Welcome(INFO.to_dict(), b"p" * 32)
REFUSED = Refused("cluster key mismatch")
# Round trips by peer are a map of counts like a load's weight counts (checked in test_announced_speed_figures...).
FIGURES = SpeedFigures("compute", "org/model@abc", 2_310_000, 120_000, 1.25, False, None, {})
WISHES = (Wish("org/model@abc", (3, "node-a"), True), Wish("org/other@def", (4, "node-b"), False, ("node-b",)))
PLAN = PlanState(WISHES, (InstanceState("org/model@abc", "d1g3st", True, None, 512, 96, 2, 30.0, 4.5),),
                 NodeLoad(1.5, 2.0, 1, True).to_json(), (FIGURES.to_json(), SpeedFigures("memory").to_json()),
                 ("node-b", "node-c"))
ADDRESSES = PeerAddresses((MemberAddress("node-b", "10.0.0.6", 52415), MemberAddress("node-c", "192.168.1.9", 7)))
SUBMIT = Submit("req-1", "node-a", "d1g3st", (1, 2, 3, 4, 5), SAMPLE)
# req-3 of a model with sliding-window layers: their table holds its blocks 1 and 2 (positions 16-47).
FORWARD = Forward("d1g3st", (WorkItem("req-1", "node-a", 0, 1, (0,)),
                             WorkItem("req-2", "node-b", 16, 2, (3, 7), SAMPLE),
                             WorkItem("req-3", "node-a", 40, 2, (1, 2, 4), None, (5, 6), 1)), HIDDEN, kv_used=9)
SAMPLED = Sampled("d1g3st", (SampledToken("req-1", 17, False),
                             SampledToken("req-2", 2, True, -0.25, ((2, -0.25), (40, -1.5)))))
RELEASE = Release("req-1")
ERROR = Error("req-1", "node b left the ring \u2603", "stage_failed")
DOWNLOAD = DownloadStatus("org/model layers [0, 12)", "downloading", 10, 100, 1, 4, 6.0, "a file failed once")
# Its load holds a download, whose percent and ETA do not cross the wire (worked out again): not a round trip.
PLAN_DOWNLOADING = PlanState((), (), NodeLoad(download=DOWNLOAD).to_json())
EXAMPLES: list[Message] = [
    HELLO, Auth(b"n" * 16, PROTOCOL, "0.1.0", b"p" * 32), WELCOME, Info(INFO.to_dict()), REFUSED,
    Refused("different exo-like versions", PROTOCOL, "0.1.0"), Retire(),
    PLAN, PlanState((), (InstanceState("m", problem="the model does not fit", keep_alive=KEEP_FOREVER,
                                       pinned=True),), {}),
    SUBMIT, FORWARD, SAMPLED, Tokens("d1g3st", (SampledToken("req-3", 5, False),)), RELEASE, ERROR,
    Ping(12345.678), Ping(12345.678, b"\0" * 64), Pong(12345.678), ADDRESSES, PeerAddresses(()),
]

# Fields a frame may leave out (older peers, or nothing to say; a nullable field left out reads as None), and maps
# whose every field may be (an announced load: a field left out reads as its default); any other missing field
# refuses the frame.
OPTIONAL = {"protocol@refused", "version@refused", "digest@instances", "problem@instances", "kv_blocks@instances",
            "kv_window_blocks@instances", "keep_alive@instances",
            "idle_seconds@instances", "load@plan_state", "sample@items", "dtype@info",
            "tp_port@info", "window_blocks@items", "padding@ping",
            "logprobs@sample", "history@sample", "grammar@sample"}
ALL_OPTIONAL = {"load", "download", "figures"}
IGNORED = {"percent", "eta_seconds"}  # sent in a download, and worked out again by the receiver
ODD = msgpack.ExtType(42, b"?")  # no field takes an extension type: ill-typed wherever it is put


def wire_of(message: Message) -> dict[str, Any]:
    return msgpack.unpackb(encode(message), raw=False)


def frame(wire: dict[str, Any]) -> bytes:
    return msgpack.packb(wire, use_bin_type=True)


def map_paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every map entry inside a frame, through maps and lists of maps."""
    paths = []
    if isinstance(value, dict):
        for key, inner in value.items():
            if key != "type":
                paths.append(path + (key,))
                paths.extend(map_paths(inner, path + (key,)))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            paths.extend(map_paths(inner, path + (i,)))
    return paths


def changed(wire: dict[str, Any], path: tuple, value: Any = None, delete: bool = False) -> dict[str, Any]:
    wire = copy.deepcopy(wire)
    target = wire
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return wire


def refusal(wire: dict[str, Any]) -> str:
    with pytest.raises(ProtocolError) as raised:
        decode(frame(wire))
    return str(raised.value)


def optional(message: Message, path: tuple) -> bool:
    key, parent = path[-1], next((p for p in reversed(path[:-1]) if isinstance(p, str)), message.type)
    return f"{key}@{parent}" in OPTIONAL or parent in ALL_OPTIONAL


# -- round trips --------------------------------------------------------------------------------------------

def test_the_examples_cover_every_message_type() -> None:
    assert {type(m) for m in EXAMPLES} == set(protocol._TYPES.values())


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.type)
def test_every_message_round_trips(message: Message) -> None:
    assert decode(encode(message)) == message


def test_every_field_of_an_announced_load_crosses_the_wire() -> None:
    """Including fields added to NodeLoad later: the protocol checks the load against NodeLoad's own fields."""
    plain = {float: 2.5, int: 3, bool: True, str: "s", DownloadStatus: DOWNLOAD, dict[str, int]: {"Q4_K": 7},
             dict[str, str]: {"int4_pack_layout": "AVX2 (32-row blocks)"}}
    values = {}
    for name, hint in typing.get_type_hints(NodeLoad).items():
        args = typing.get_args(hint)
        base = next(a for a in args if a is not type(None)) if type(None) in args else hint
        values[name] = plain[base]
    load = NodeLoad(**values)
    assert load != NodeLoad()
    received = decode(encode(PlanState((), (), load.to_json())))
    assert NodeLoad.from_json(received.load) == load


def test_an_item_that_samples_before_its_prompt_ends_is_refused() -> None:
    """Found by test_fuzz_peers: the last stage's sampling index (end - prompt_len) went negative and failed its step
    (a Forward's item, or a Submit whose prompt is longer than its tokens, on a node that is the whole ring)."""
    wire = wire_of(FORWARD)
    del wire["items"][1]["sample"]["history"]  # (which a prompt longer than it is refused for too)
    wire["items"][1]["sample"]["prompt_len"] = 19  # the item's positions are [16, 18)
    assert "field 'sample'" in refusal(wire)
    wire["items"][1]["sample"]["prompt_len"] = 18  # its last position is the prompt's last: it samples token 0
    decode(frame(wire))
    submit = wire_of(SUBMIT)
    submit["sample"]["prompt_len"] = 6  # five tokens sent
    assert "field 'sample'" in refusal(submit)


def test_every_field_of_announced_speed_figures_crosses_the_wire() -> None:
    """SpeedFigures are checked against their own fields, as a load is: a field added later is carried too."""
    figures = SpeedFigures("memory", "m", 1, 2, 0.5, True, "cannot measure its speed: no", {"b": 512, "c": 1024})
    received = decode(encode(PlanState((), (), {}, (figures.to_json(),))))
    assert [SpeedFigures.from_json(f) for f in received.figures] == [figures]
    assert set(FIGURES.to_json()) == set(typing.get_type_hints(SpeedFigures))
    assert decode(encode(PlanState((), (), {}))).figures == ()  # said nothing yet


@pytest.mark.parametrize("figures, why", [({"placement": "fastest"}, "must be one of compute, memory"),
                                          ({"decode_ns": -3}, "field 'decode_ns'"),
                                          ({"decode_ns": 2.5}, "field 'decode_ns'"),
                                          ({"rtt_us": {f"n{i}": 1 for i in range(65)}}, "at most 64 entries"),
                                          ({"rtt_us": {"b": -1}}, "field 'rtt_us'"),
                                          ({"cached": "yes"}, "field 'cached'"), ("fast", "must be a map")])
def test_announced_speed_figures_are_checked(figures: Any, why: str) -> None:
    assert why in refusal({**wire_of(PLAN), "figures": [figures]})


@pytest.mark.parametrize("counts, why", [({"Q4_K": -1}, "must be an integer"), ({"Q4_K": 1.5}, "must be an integer"),
                                         ({f"t{i}": 1 for i in range(65)}, "at most 64 entries"),
                                         ({"x" * 300: 1}, "must be a string"), ([1], "must be a map")])
def test_a_load_s_weight_counts_are_checked(counts: Any, why: str) -> None:
    wire = {**wire_of(PLAN_DOWNLOADING), "load": {"dequantized_weights": counts}}
    assert why in refusal(wire)


def test_fields_a_newer_peer_adds_are_ignored() -> None:
    assert decode(frame({**wire_of(Release("r")), "priority": [1, {"x": b"y"}]})) == Release("r")


def test_frames_over_the_limit_are_refused_both_ways() -> None:
    with pytest.raises(ProtocolError, match="exceeds the 100-byte limit"):
        encode(Error("r", "x" * 200, "c"), max_bytes=100)
    with pytest.raises(ProtocolError, match="exceeds the 100-byte limit"):
        decode(encode(Error("r", "x" * 200, "c")), max_bytes=100)


def test_the_handshake_reads_the_protocol_of_frames_it_cannot_decode() -> None:
    assert handshake_protocol(frame({"type": "auth", "nonce": b"n", "proof": b"p"})) == ("auth", None, None)
    assert handshake_protocol(frame({"type": "hello", "protocol": 7, "version": "9.0", "new": 1})) == \
        ("hello", 7, "9.0")
    assert handshake_protocol(frame({"type": "hello", "protocol": True, "version": ["x"]})) == ("hello", None, None)
    with pytest.raises(ProtocolError):
        handshake_protocol(b"\xc1")


# -- every field is checked ---------------------------------------------------------------------------------

FIELD_CASES = [(message, path) for message in [*EXAMPLES, PLAN_DOWNLOADING] for path in map_paths(wire_of(message))]


@pytest.mark.parametrize("message,path", FIELD_CASES, ids=[f"{m.type}.{'.'.join(map(str, p))}" for m, p in FIELD_CASES])
def test_a_missing_or_ill_typed_field_is_refused_naming_it(message: Message, path: tuple) -> None:
    wire, name = wire_of(message), path[-1]
    if isinstance(name, int):  # an element of a list: the list is named
        name = next(p for p in reversed(path) if isinstance(p, str))
    if name in IGNORED:
        decode(frame(changed(wire, path, ODD)))
        return
    assert repr(name) in refusal(changed(wire, path, ODD)), path
    if not optional(message, path):
        assert repr(name) in refusal(changed(wire, path, delete=True)), path
    else:
        decode(frame(changed(wire, path, delete=True)))  # may be left out


def wire_with(message: Message, path: tuple, value: Any) -> dict[str, Any]:
    return changed(wire_of(message), path, value)


OUT_OF_RANGE: list[tuple[Message, tuple, Any, str]] = [
    (HELLO, ("protocol",), 2**64 - 1, "protocol"),
    (HELLO, ("protocol",), True, "protocol"),
    (HELLO, ("nonce",), b"n" * 1025, "nonce"),
    (HELLO, ("nonce",), "text", "nonce"),
    (HELLO, ("version",), "v" * 257, "version"),
    (WELCOME, ("info", "port"), 70000, "port"),
    (WELCOME, ("info", "memory_bytes"), -1, "memory_bytes"),
    (WELCOME, ("info", "node_id"), 12, "node_id"),
    (REFUSED, ("reason",), "r" * (64 * 1024 + 1), "reason"),
    (PLAN, ("wishes", 0, "clock"), [-1, "a"], "clock"),
    (PLAN, ("wishes", 0, "clock"), [1, "a", 2], "clock"),
    (PLAN, ("wishes", 0, "clock"), [1, 2], "clock"),
    (PLAN, ("wishes", 0, "loaded"), 1, "loaded"),
    (PLAN, ("wishes", 1, "nodes"), ["node-b", 5], "nodes"),
    (PLAN, ("wishes",), [{"model": "m"}], "clock"),
    (PLAN, ("wishes",), {"model": "m"}, "wishes"),
    (PLAN, ("instances", 0, "kv_blocks"), -1, "kv_blocks"),
    (PLAN, ("instances", 0, "ready"), 1, "ready"),
    (PLAN, ("instances", 0, "in_flight"), -2, "in_flight"),
    (PLAN, ("instances", 0, "keep_alive"), math.inf, "keep_alive"),
    (PLAN, ("instances", 0, "keep_alive"), -7, "keep_alive"),
    (PLAN, ("instances", 0, "idle_seconds"), -0.5, "idle_seconds"),
    (PLAN, ("instances", 0, "pinned"), "yes", "pinned"),
    (PLAN, ("instances", 0, "model"), "m" * 1025, "model"),
    (PLAN, ("instances",), ["m"], "instances"),
    (PLAN, ("load", "tokens_per_second"), math.nan, "tokens_per_second"),
    (PLAN, ("load", "tokens_per_second"), math.inf, "tokens_per_second"),
    (PLAN, ("load", "step_seconds"), -0.5, "step_seconds"),
    (PLAN, ("load", "decode_step_ms"), 2**64 - 1, "decode_step_ms"),
    (PLAN, ("load", "in_flight"), 1.5, "in_flight"),
    (PLAN, ("load", "download"), {"label": "x", "state": "downloading", "done_bytes": -5, "total_bytes": 1,
                                  "files_done": 0, "files_total": 1, "bytes_per_second": 0.0}, "done_bytes"),
    (PLAN, ("load", "download"), {"label": 5}, "label"),
    (PLAN, ("load", "download"), [1], "download"),
    (PLAN, ("load",), "busy", "load"),
    (PLAN, ("linked",), ["node-b", 5], "linked"),
    (PLAN, ("linked",), ["n" * 257], "linked"),
    (PLAN, ("linked",), [f"node-{i}" for i in range(MAX_MEMBERS + 1)], "linked"),
    (PLAN, ("linked",), "node-b", "linked"),
    (ADDRESSES, ("members", 0, "port"), 0, "port"),
    (ADDRESSES, ("members", 0, "port"), 65536, "port"),
    (ADDRESSES, ("members", 0, "host"), "h" * 257, "host"),
    (ADDRESSES, ("members", 0, "host"), "", "host"),
    (ADDRESSES, ("members", 1), ["node-c", "192.168.1.9", 7], "members"),
    (ADDRESSES, ("members",), [{"node_id": f"n{i}", "host": "h", "port": 1} for i in range(MAX_MEMBERS + 1)],
     "members"),
    (SUBMIT, ("tokens",), [], "tokens"),
    (SUBMIT, ("tokens",), [2**31], "tokens"),
    (SUBMIT, ("tokens",), [1, "2"], "tokens"),
    (SUBMIT, ("sample", "top_p"), 1.5, "top_p"),
    (SUBMIT, ("sample", "temperature"), math.nan, "temperature"),
    (SUBMIT, ("sample", "temperature"), 2**64 - 1, "temperature"),
    (SUBMIT, ("sample", "temperature"), -1, "temperature"),
    (SUBMIT, ("sample", "top_k"), -1, "top_k"),
    (SUBMIT, ("sample", "seed"), -1, "seed"),
    (SUBMIT, ("sample", "max_tokens"), 0, "max_tokens"),
    (SUBMIT, ("sample", "prompt_len"), 0, "prompt_len"),
    (SUBMIT, ("sample", "eos"), [-1], "eos"),
    (SUBMIT, ("sample",), None, "sample"),
    (FORWARD, ("items",), [], "items"),
    (FORWARD, ("items", 0, "count"), 0, "count"),
    (FORWARD, ("items", 0, "start"), -1, "start"),
    (FORWARD, ("items", 0, "blocks"), [-1], "blocks"),
    # Found by tests/cluster/test_fuzz_peers.py: a last stage's loop failed looking up the block of a position past
    # them.
    (FORWARD, ("items", 1, "blocks"), [3], "blocks"),
    (FORWARD, ("items", 0, "start"), 16, "blocks"),
    (FORWARD, ("items", 2, "window_blocks"), [5], "window_blocks"),  # positions up to 41 need blocks 1 and 2
    (FORWARD, ("items", 2, "window_first"), 3, "window_blocks"),  # the window table starts past position 40
    (FORWARD, ("items", 2, "window_first"), -1, "window_first"),
    (FORWARD, ("items", 0), "req-1", "items"),
    (FORWARD, ("kv_used",), -1, "kv_used"),
    (FORWARD, ("hidden", "dtype"), "int8", "dtype"),
    (FORWARD, ("hidden", "shape"), [20], "hidden"),
    (FORWARD, ("hidden", "shape"), [4, 5], "hidden"),
    (FORWARD, ("hidden", "shape"), [3, -4], "shape"),
    (FORWARD, ("hidden", "data"), b"\0" * 47, "data"),
    (SAMPLED, ("tokens", 0), ["req-1", -1, True], "token"),
    (SAMPLED, ("tokens", 0), ["req-1", 1, 1], "done"),
    (SAMPLED, ("tokens", 0), ["req-1", 1], "tokens"),
    (SAMPLED, ("tokens", 0), [5, 1, True], "rid"),
    (RELEASE, ("rid",), "x" * 257, "rid"),
    (ERROR, ("message",), "m" * (64 * 1024 + 1), "message"),
    (ERROR, ("code",), 500, "code"),
]


@pytest.mark.parametrize("message,path,value,name", OUT_OF_RANGE,
                         ids=[f"{m.type}.{'.'.join(map(str, p))}={str(v)[:20]}" for m, p, v, _ in OUT_OF_RANGE])
def test_a_field_out_of_range_or_ill_typed_is_refused_naming_it(message: Message, path: tuple, value: Any,
                                                                name: str) -> None:
    assert f"'{name}'" in refusal(wire_with(message, path, value))


def test_every_truncation_of_a_valid_frame_is_refused() -> None:
    for message in EXAMPLES:
        data = encode(message)
        for end in range(len(data)):
            with pytest.raises(ProtocolError):
                decode(data[:end])


def test_frames_that_are_not_messages_are_refused() -> None:
    for data, says in [(b"", "undecodable"), (b"\xc1", "FormatError"), (frame([1, 2]), "map"),
                       (frame({"kind": "release"}), "string 'type'"), (frame({"type": 5}), "string 'type'"),
                       (frame({"type": "teleport"}), "unknown message type 'teleport'"),
                       (encode(Release("r")) + b"\x00", "extra data"),
                       (msgpack.packb({1: 2}, use_bin_type=True), "undecodable")]:
        with pytest.raises(ProtocolError, match=says):
            decode(data)


# -- no frame makes decode raise anything else --------------------------------------------------------------

FIELD_NAMES = sorted({key for m in EXAMPLES for path in map_paths(wire_of(m)) for key in path if isinstance(key, str)})
LEAVES = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0, 1, -1, 2**31, 2**63])
          | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.binary(max_size=20)
          | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
          | st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1)))
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), inner, max_size=4),
                      max_leaves=8)
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decodes_or_refuses(data: bytes) -> None:
    """decode either returns a message, which encodes again and whose handlers can trust it, or raises
    ProtocolError; nothing else."""
    try:
        message = decode(data)
    except ProtocolError:
        return
    assert isinstance(message, Message)
    encode(message)
    if isinstance(message, PlanState):  # what the cluster makes of it, and shows in GET /v1/cluster
        json.dumps(NodeLoad.from_json(message.load).to_json(), allow_nan=False)
    if isinstance(message, (Welcome, Info)):
        NodeInfo.from_dict(message.info)


@FAST
@given(st.binary(max_size=256))
def test_decode_of_arbitrary_bytes_raises_only_protocol_errors(data: bytes) -> None:
    decodes_or_refuses(data)


@FAST
@given(st.sampled_from(sorted(protocol._TYPES)), st.dictionaries(st.sampled_from(FIELD_NAMES), VALUES, max_size=8))
def test_decode_of_arbitrary_maps_of_a_known_type_raises_only_protocol_errors(kind: str, fields: dict) -> None:
    decodes_or_refuses(frame({**fields, "type": kind}))


@FAST
@given(st.sampled_from(FIELD_CASES), VALUES)
def test_decode_of_a_valid_message_with_one_field_replaced_raises_only_protocol_errors(case: tuple, value: Any) -> None:
    message, path = case
    decodes_or_refuses(frame(wire_with(message, path, value)))


@FAST
@given(VALUES)
def test_decode_of_arbitrary_msgpack_values_raises_only_protocol_errors(value: Any) -> None:
    decodes_or_refuses(frame(value))
