"""keep_alive as Ollama reads it (exo_like/instances/keep_alive.py): seconds, Go durations, 0 and negatives."""

from __future__ import annotations

import pytest

from exo_like.errors import InvalidRequestError
from exo_like.instances.keep_alive import FOREVER, parse_keep_alive


@pytest.mark.parametrize(("value", "seconds"), [
    (300, 300.0), (0, 0.0), (2.5, 2.5), ("10m", 600.0), ("1h30m", 5400.0), ("500ms", 0.5), ("1.5h", 5400.0),
    ("90s", 90.0), ("0", 0.0), ("3600", 3600.0), ("+5m", 300.0), (" 5m ", 300.0), ("2h45m10s", 9910.0),
    (-1, FOREVER), ("-1", FOREVER), ("-5m", FOREVER), (-0.001, FOREVER), ("0s", 0.0), ("1µs", 1e-6)])
def test_ollamas_forms_become_seconds(value: object, seconds: float) -> None:
    assert parse_keep_alive(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "5 m", "m5", "5x", "1h-5m", "five", "5m5", None, True, [5], {"s": 5},
                                   float("nan")])
def test_anything_else_is_a_400_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parse_keep_alive(value, "options.keep_alive")
    assert refused.value.status == 400 and refused.value.param == "options.keep_alive"
