"""How long an instance stays loaded after its last request, in Ollama's terms (a request's `keep_alive`; Ollama's
default is 5 minutes).

Ollama's forms: a number of seconds, or a Go duration string ("10m", "1h30m", "500ms"); 0 unloads as soon as the
request ends; a negative value keeps the model loaded until it is unloaded by name or must make room. A string of
digits alone counts as seconds (as OLLAMA_KEEP_ALIVE takes it).
"""

from __future__ import annotations

import math
import re

from exo_like.errors import InvalidRequestError

FOREVER = math.inf

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_keep_alive(value: object, param: str = "keep_alive") -> float:
    """Seconds to stay loaded after the last request (FOREVER for a negative value, 0 to unload at once)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidRequestError(f"{param} must be a number of seconds or a duration such as \"5m\"", param=param)
    if isinstance(value, str):
        seconds = _duration_seconds(value.strip(), param)
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise InvalidRequestError(f"{param} must be a number of seconds or a duration such as \"5m\"", param=param)
    return FOREVER if seconds < 0 else seconds


def _duration_seconds(text: str, param: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if re.fullmatch(r"\d+(\.\d*)?", body):
        return sign * float(body)
    parts = _PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise InvalidRequestError(f"{param} {text!r} is not a duration: use seconds (300) or a duration such as "
                                  "\"5m\", \"1h30m\" or \"-1\" (keep loaded)", param=param)
    return sign * sum(float(number) * _UNITS[unit] for number, unit in parts)
