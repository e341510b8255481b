"""Readers for the fields of peer messages (codec.py's kinds and protocol.py's own): each returns a field's value,
checked, or raises ProtocolError naming the field. Also the check of a node's announced load against NodeLoad's own fields."""

from __future__ import annotations

import math
import typing
from typing import Any, Callable

from exo_like.cluster.node_load import NodeLoad
from exo_like.models.hub.progress import DownloadStatus
from partitioning.speed_figures import PARALLEL_MODES, PLACEMENTS, SpeedFigures

MAX_ID = 256  # characters in a request or node id, a digest, a dtype name
MAX_TEXT = 64 * 1024  # characters in an error message or a reason
MAX_COUNTS = 64  # entries of a map of counts (e.g. a node's matrices by tensor type)
INT64 = 2**63


class ProtocolError(ValueError):
    """A frame that is too large, not msgpack, of no known type, or with a missing or malformed field."""


def required(data: dict[str, Any], key: str) -> Any:
    if key not in data:
        raise ProtocolError(f"missing field {key!r}")
    return data[key]


def string(data: dict[str, Any], key: str, limit: int = MAX_ID, optional: bool = False) -> str | None:
    value = data.get(key) if optional else required(data, key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(f"field {key!r} must be a string of at most {limit} characters")
    return value


def integer(data: dict[str, Any], key: str, low: int = -INT64, high: int = INT64 - 1, optional: bool = False) -> int:
    value = data.get(key) if optional else required(data, key)
    if value is None and optional:
        return None  # type: ignore[return-value]
    return check_int(value, key, low, high)


def check_int(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"field {key!r} must be an integer in [{low}, {high}]")
    return value


def number(data: dict[str, Any], key: str, low: float, high: float, optional: bool = False) -> float:
    value = data.get(key) if optional else required(data, key)
    if value is None and optional:
        return None  # type: ignore[return-value]
    # Compared before any float(): an integer past float range (msgpack carries up to 2**64 - 1) would overflow.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"field {key!r} must be a finite number")
    if not low <= value <= high:
        raise ProtocolError(f"field {key!r} must lie in [{low}, {high}]")
    return float(value)


def boolean(data: dict[str, Any], key: str) -> bool:
    value = required(data, key)
    if not isinstance(value, bool):
        raise ProtocolError(f"field {key!r} must be a boolean")
    return value


def binary(data: dict[str, Any], key: str, limit: int = 1024) -> bytes:
    value = required(data, key)
    if not isinstance(value, bytes) or len(value) > limit:
        raise ProtocolError(f"field {key!r} must be bytes, at most {limit} of them")
    return value


def array(data: dict[str, Any], key: str) -> list[Any]:
    value = required(data, key)
    if not isinstance(value, list):
        raise ProtocolError(f"field {key!r} must be a list")
    return value


def mapping(data: Any, key: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ProtocolError(f"field {key!r} must be a map")
    return data


def counts(data: dict[str, Any], key: str, nullable: bool = False) -> dict[str, int] | None:
    """A small map of names to counts."""
    return _small_map(data, key, nullable, lambda n: check_int(n, key, 0, INT64 - 1))


def texts(data: dict[str, Any], key: str, nullable: bool = False) -> dict[str, str] | None:
    """A small map of names to short texts."""
    return _small_map(data, key, nullable, lambda text: string({key: text}, key))


def _small_map(data: dict[str, Any], key: str, nullable: bool, read: Callable[[Any], Any]) -> dict[str, Any] | None:
    value = data.get(key)
    if value is None and nullable:
        return None
    value = mapping(value, key)
    if len(value) > MAX_COUNTS:
        raise ProtocolError(f"field {key!r} must hold at most {MAX_COUNTS} entries")
    return {string({key: name}, key): read(item) for name, item in value.items()}


# The load a node announces (NodeLoad.to_json(), with its DownloadStatus.to_json()) is checked against those
# dataclasses' own fields, so NodeLoad.from_json cannot fail on it, nothing that is not JSON (bytes, say) reaches
# GET /v1/cluster, and a field added to NodeLoad is checked and carried with no change here. Every field may be
# left out (it reads as its default there); keys that are no field (percent, ETA: worked out again) are dropped.
MAX_RATE = 1e15  # numbers shown on every dashboard and summed into /v1/cluster: finite, non-negative, bounded
FieldReader = Callable[[dict[str, Any], str, bool], Any]  # (map, key, may be None) -> checked value


def plain_map(data: dict[str, Any], key: str, readers: dict[str, tuple[FieldReader, bool]],
               optional: bool) -> Any:
    value = data.get(key)
    if value is None and optional:
        return None
    value = mapping(value, key)
    return {name: read(value, name, nullable) for name, (read, nullable) in readers.items() if name in value}


def plain_readers(cls: type) -> dict[str, tuple[FieldReader, bool]]:
    """A reader for each field of a dataclass of plain values, and whether the field may be None."""
    readers = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        nullable = type(None) in args
        base = next(a for a in args if a is not type(None)) if nullable else hint
        if base not in PLAIN:
            raise TypeError(f"{cls.__name__}.{name}: the protocol has no check for {hint} (add one to PLAIN)")
        readers[name] = (PLAIN[base], nullable)
    return readers


PLAIN: dict[Any, FieldReader] = {
    float: lambda data, key, nullable: number(data, key, 0.0, MAX_RATE, optional=nullable),
    int: lambda data, key, nullable: integer(data, key, 0, optional=nullable),
    bool: lambda data, key, nullable: None if nullable and data[key] is None else boolean(data, key),
    str: lambda data, key, nullable: string(data, key, MAX_TEXT, optional=nullable),
    DownloadStatus: lambda data, key, nullable: plain_map(data, key, DOWNLOAD_FIELDS, nullable),
    dict[str, int]: counts,
    dict[str, str]: texts,
}
DOWNLOAD_FIELDS = plain_readers(DownloadStatus)
LOAD_FIELDS = plain_readers(NodeLoad)


def node_load(value: Any) -> dict[str, Any]:
    return {} if value is None else plain_map({"load": value}, "load", LOAD_FIELDS, False)


FIGURES_FIELDS = plain_readers(SpeedFigures)


def speed_figures(value: Any) -> dict[str, Any] | None:
    """A node's announced SpeedFigures.to_json(), each field checked like a load's; None when it sent none."""
    if value is None:
        return None
    figures = plain_map({"figures": value}, "figures", FIGURES_FIELDS, False)
    if figures.get("placement", PLACEMENTS[0]) not in PLACEMENTS:
        raise ProtocolError(f"field 'placement' must be one of {', '.join(PLACEMENTS)}")
    if figures.get("parallel", PARALLEL_MODES[0]) not in PARALLEL_MODES:
        raise ProtocolError(f"field 'parallel' must be one of {', '.join(PARALLEL_MODES)}")
    return figures
