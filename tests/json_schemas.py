"""Random JSON schemas for the structured-output tests: nested objects with required fields, arrays, enums, integers
and numbers with bounds, strings, booleans. Strings and arrays are bounded (maxLength, maxItems) so that a model
sampling at random among the allowed tokens ends its text within a few hundred tokens."""

from __future__ import annotations

import random
from typing import Any

MAX_DEPTH = 3


def random_schema(rng: random.Random) -> dict[str, Any]:
    """A schema of an object (the usual shape of structured output)."""
    return _object(rng, 0)


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = [_integer, _number, _string, _enum, _boolean]
    if depth < MAX_DEPTH:
        kinds += [_object, _array]
    return rng.choice(kinds)(rng, depth)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(["id", "name", "kind", "size", "tags", "items", "score", "ok", "a", "b", "c", "level"],
                       rng.randint(1, 4))
    properties = {name: _value(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _array(rng: random.Random, depth: int) -> dict[str, Any]:
    low = rng.randint(0, 2)
    return {"type": "array", "items": _value(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}


def _integer(rng: random.Random, depth: int) -> dict[str, Any]:
    low = rng.randint(-1000, 1000)
    schema: dict[str, Any] = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if rng.random() < 0.3:
        schema["exclusiveMaximum"] = schema.pop("maximum") + 1
    return schema


def _number(rng: random.Random, depth: int) -> dict[str, Any]:
    low = round(rng.uniform(-100, 100), 2)
    return {"type": "number", "minimum": low, "maximum": round(low + rng.uniform(0.5, 500), 2)}


def _string(rng: random.Random, depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, 8)}
    if rng.random() < 0.3:
        schema["minLength"] = 1
    return schema


def _enum(rng: random.Random, depth: int) -> dict[str, Any]:
    pool: list[Any] = ["red", "green", "blue", "left", "right", "x y", "ünï", 0, 1, 42, -7, True, None]
    return {"enum": rng.sample(pool, rng.randint(1, 4))}


def _boolean(rng: random.Random, depth: int) -> dict[str, Any]:
    return {"type": "boolean"}
