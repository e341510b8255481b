"""One codec for every peer message: each message (and each value type inside one) is declared once, as a schema of
its fields, and encoded to and decoded from msgpack-ready values by the same code (protocol.py declares them).

A schema is a `Struct`: a dataclass and a `Field` per dataclass field, each with a `Kind` that encodes a value and
decodes one with every check of its type and range, raising ProtocolError naming the field. A Struct is a map on
the wire (fields a newer peer adds are ignored), or a list in field order (`positional`, for values sent many times
a frame); it may merge a nested Struct's fields into its own map (`flatten`), and check its fields together
(`check`) before the value is built.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from exo_like.cluster.protocol_fields import (
    INT64,
    MAX_ID,
    ProtocolError,
    binary,
    boolean,
    check_int,
    mapping,
    number,
    string,
)


class Kind:
    """How one value crosses the wire: `encode` to msgpack-ready values, `decode` back with its checks (`key`: the
    field's name, for the error)."""

    def encode(self, value: Any) -> Any:
        return value

    def decode(self, value: Any, key: str) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Kind):
    low: int = -INT64
    high: int = INT64 - 1

    def decode(self, value: Any, key: str) -> int:
        return check_int(value, key, self.low, self.high)


@dataclass(frozen=True)
class Float(Kind):
    low: float
    high: float

    def decode(self, value: Any, key: str) -> float:
        return number({key: value}, key, self.low, self.high)


@dataclass(frozen=True)
class Bool(Kind):
    def decode(self, value: Any, key: str) -> bool:
        return boolean({key: value}, key)


@dataclass(frozen=True)
class Str(Kind):
    limit: int = MAX_ID
    nonempty: bool = False  # an empty one is refused (a host that would be dialed)
    choices: tuple[str, ...] = ()  # where not empty, the only values taken

    def decode(self, value: Any, key: str) -> str:
        text = string({key: value}, key, self.limit)
        if self.nonempty and not text:
            raise ProtocolError(f"field {key!r} must not be empty")
        if self.choices and text not in self.choices:
            raise ProtocolError(f"field {key!r} must be one of {', '.join(self.choices)}")
        return text


@dataclass(frozen=True)
class Bytes(Kind):
    limit: int = 1024

    def decode(self, value: Any, key: str) -> bytes:
        return binary({key: value}, key, self.limit)


@dataclass(frozen=True)
class Nullable(Kind):
    kind: Kind

    def encode(self, value: Any) -> Any:
        return None if value is None else self.kind.encode(value)

    def decode(self, value: Any, key: str) -> Any:
        return None if value is None else self.kind.decode(value, key)


@dataclass(frozen=True)
class Seq(Kind):
    """A tuple on our side, a list on the wire; elements' errors name the list's field."""

    kind: Kind
    limit: int | None = None
    nonempty: bool = False

    def encode(self, value: Any) -> list[Any]:
        return [self.kind.encode(v) for v in value]

    def decode(self, value: Any, key: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise ProtocolError(f"field {key!r} must be a list")
        if self.limit is not None and len(value) > self.limit:
            raise ProtocolError(f"field {key!r} must hold at most {self.limit} entries")
        if self.nonempty and not value:
            raise ProtocolError(f"field {key!r} must not be empty")
        return tuple(self.kind.decode(v, key) for v in value)


@dataclass(frozen=True)
class Fixed(Kind):
    """A tuple of a fixed length and a kind per place, a list on the wire; `shape` describes it in the error."""

    kinds: tuple[Kind, ...]
    shape: str

    def encode(self, value: Any) -> list[Any]:
        return [kind.encode(v) for kind, v in zip(self.kinds, value)]

    def decode(self, value: Any, key: str) -> tuple[Any, ...]:
        if not isinstance(value, list) or len(value) != len(self.kinds):
            raise ProtocolError(f"field {key!r} must be {self.shape}")
        return tuple(kind.decode(v, key) for kind, v in zip(self.kinds, value))


@dataclass(frozen=True)
class Custom(Kind):
    """A value read by a reader of its own (protocol_fields.py), sent as it is."""

    read: Callable[[Any], Any]

    def decode(self, value: Any, key: str) -> Any:
        return self.read(value)


REQUIRED, MAY_BE_ABSENT, OMIT_DEFAULT = "required", "may be absent", "omitted when default"


@dataclass(frozen=True)
class Field:
    """A field's kind and whether a frame may leave it out: REQUIRED; MAY_BE_ABSENT (always sent; absent reads as the
    default: peers that did not send it); OMIT_DEFAULT (sent only when it is not the default); `with_field`: sent
    and required exactly when that other field is sent."""

    kind: Kind
    absent: str = REQUIRED
    with_field: str | None = None


class Struct(Kind):
    """A dataclass's schema: a Field per field (a bare Kind is a required Field)."""

    def __init__(self, cls: type, fields: dict[str, Field | Kind], positional: bool = False,
                 flatten: Sequence[str] = (), check: Callable[[dict[str, Any]], None] | None = None,
                 shape: str = ""):
        self.cls, self.positional, self.flatten, self.check, self.shape = cls, positional, set(flatten), check, shape
        self.fields = {name: f if isinstance(f, Field) else Field(f) for name, f in fields.items()}
        declared = [f.name for f in dataclasses.fields(cls)]
        if list(self.fields) != declared:
            raise TypeError(f"{cls.__name__}'s schema must name its fields in order: {declared}")
        self._defaults = {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def of(cls, message: type, **options: Any) -> "Struct":
        """The schema a dataclass declares in its annotations: `name: Annotated[T, Field or Kind]`."""
        hints = typing.get_type_hints(message, include_extras=True)
        fields = {f.name: typing.get_args(hints[f.name])[1] for f in dataclasses.fields(message)}
        return cls(message, fields, **options)

    def _default(self, name: str) -> Any:
        declared = self._defaults[name]
        if declared.default is not dataclasses.MISSING:
            return declared.default
        if declared.default_factory is not dataclasses.MISSING:
            return declared.default_factory()
        raise TypeError(f"{self.cls.__name__}.{name} may be left out of a frame but has no default")

    # -- encoding --------------------------------------------------------------------------------------------

    def encode(self, value: Any) -> dict[str, Any] | list[Any]:
        if self.positional:
            return self._encode_list(value)
        wire: dict[str, Any] = {}
        for name, spec in self.fields.items():
            inner = getattr(value, name)
            if name in self.flatten:
                wire.update(spec.kind.encode(inner))
            elif self._sent(value, name, spec):
                wire[name] = spec.kind.encode(inner)
        return wire

    def _sent(self, value: Any, name: str, spec: Field) -> bool:
        if spec.with_field is not None:
            return self._sent(value, spec.with_field, self.fields[spec.with_field])
        return spec.absent != OMIT_DEFAULT or getattr(value, name) != self._default(name)

    def _encode_list(self, value: Any) -> list[Any]:
        entries = [(spec, getattr(value, name), name) for name, spec in self.fields.items()]
        while entries and entries[-1][0].absent == OMIT_DEFAULT and entries[-1][1] == self._default(entries[-1][2]):
            entries.pop()  # trailing defaults are left out
        return [spec.kind.encode(v) for spec, v, _ in entries]

    # -- decoding --------------------------------------------------------------------------------------------

    def decode(self, value: Any, key: str) -> Any:
        if self.positional:
            return self._decode_list(value, key)
        return self.decode_map(mapping(value, key))

    def decode_map(self, data: dict[str, Any]) -> Any:
        """The value of a map's fields (a message's frame, or a nested map)."""
        values: dict[str, Any] = {}
        for name, spec in self.fields.items():
            if name in self.flatten:
                values[name] = spec.kind.decode_map(data)  # type: ignore[attr-defined]
            elif self._present(data, name, spec):
                values[name] = spec.kind.decode(data[name], name)
            else:
                values[name] = self._default(name)
        return self._build(values)

    def _present(self, data: dict[str, Any], name: str, spec: Field) -> bool:
        """Whether a field is read from the map; a required one that is absent refuses the frame."""
        required = spec.absent == REQUIRED
        if spec.with_field is not None:
            required = self._present(data, spec.with_field, self.fields[spec.with_field])
        if name in data:
            return True
        if required:
            raise ProtocolError(f"missing field {name!r}")
        return False

    def _decode_list(self, value: Any, key: str) -> Any:
        specs = list(self.fields.items())
        least = sum(1 for _, spec in specs if spec.absent != OMIT_DEFAULT)
        if not isinstance(value, list) or not least <= len(value) <= len(specs):
            raise ProtocolError(f"field {key!r}: each entry is {self.shape}")
        values = {name: spec.kind.decode(v, name) for (name, spec), v in zip(specs, value)}
        values.update({name: self._default(name) for name, _ in specs[len(value):]})
        return self._build(values)

    def _build(self, values: dict[str, Any]) -> Any:
        if self.check is not None:
            self.check(values)
        return self.cls(**values)
