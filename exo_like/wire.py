"""Frames between peers: one msgpack map per websocket binary message, with a size limit. Never pickle.

A frame is a dict with a "type" key; tensors inside it are Activations.to_wire() maps (raw bytes + dtype +
shape), which msgpack carries as bin without copying them into text.
"""

from __future__ import annotations

from typing import Any

import msgpack

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024

# The peer protocol: raise it whenever a frame or message changes so that a node of the previous version would
# misread it. Nodes link only with nodes of the same number (checked first thing at link set-up, see peers.py).
# 1: the first numbered protocol (exo-like 0.1.0: hub models keyed org/name@commit, plan digests, step times).
PROTOCOL = 1


class FrameError(ValueError):
    """A frame that is too large, not msgpack, or not a typed map."""


def encode_frame(message: dict[str, Any], max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    data = msgpack.packb(message, use_bin_type=True)
    if len(data) > max_bytes:
        raise FrameError(f"frame of {len(data)} bytes exceeds the {max_bytes}-byte limit ({message.get('type')})")
    return data


def decode_frame(data: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> dict[str, Any]:
    if len(data) > max_bytes:
        raise FrameError(f"frame of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise FrameError(f"undecodable frame: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise FrameError("a frame must be a map with a string 'type'")
    return message
