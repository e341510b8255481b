"""Rotary embedding settings as configs state them: `rope_theta` + `rope_scaling` (the Hub's) or transformers >= 5's
`rope_parameters` (which carries `rope_theta` inside it, and for Gemma 3 one entry per layer type)."""

from __future__ import annotations

from typing import Any

from exo_like.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, scaling-or-None) from either config convention, validated."""
    params = config.get("rope_parameters") or {}
    scaling = dict(config.get("rope_scaling") or params or {})
    theta = float(config.get("rope_theta") or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0)
    partial = float(config.get("partial_rotary_factor") or scaling.pop("partial_rotary_factor", None) or 1.0)
    if partial != 1.0:
        raise UnsupportedModelError(f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported",
                                    code="unsupported_rope_scaling")
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
            code="unsupported_rope_scaling",
        )
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}
