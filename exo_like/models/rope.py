"""Rotary embeddings: the settings as configs state them (`rope_theta` + `rope_scaling`, the Hub's, or transformers
>= 5's `rope_parameters`, which carries `rope_theta` inside it and for Gemma 3 one entry per layer type), and the
inverse frequencies and cos/sin factor each scaling type gives (transformers' formulas, computed in float64)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from exo_like.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rotary_fraction(config: dict[str, Any]) -> float:
    """The share of each head's dimensions that rotate (Phi-4-mini: 0.75; the rest pass through)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params or {}
    fraction = float(config.get("partial_rotary_factor") or scaling.get("partial_rotary_factor") or 1.0)
    if not 0 < fraction <= 1:
        raise UnsupportedModelError(f"partial_rotary_factor {fraction} is not in (0, 1]",
                                    code="unsupported_rope_scaling")
    return fraction


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, scaling-or-None) from either config convention, validated."""
    params = config.get("rope_parameters") or {}
    scaling = dict(config.get("rope_scaling") or params or {})
    theta = float(config.get("rope_theta") or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0)
    scaling.pop("partial_rotary_factor", None)
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
    if rope_type in ("yarn", "longrope") and scaling.get("factor") is None:  # transformers: the context's growth
        scaling["factor"] = float(config.get("max_position_embeddings", 4096)) / float(
            scaling["original_max_position_embeddings"])
    return theta, {"rope_type": rope_type, **scaling}


def scaled_inv_freq(theta: float, dim: int, scaling: dict[str, Any] | None) -> np.ndarray:
    """Inverse rotary frequencies (float64, dim // 2) after the scaling's adjustment. LongRoPE: always its long
    factors (see docs/families.md: a served context beyond the original window, as llama.cpp chooses there;
    transformers switches to them per forward pass, once a sequence passes the original window)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "yarn":
        return _yarn(inv_freq, theta, dim, factor, scaling)
    if scaling["rope_type"] == "longrope":
        factors = np.asarray(scaling["long_factor"], dtype=np.float64)
        if factors.shape != inv_freq.shape:
            raise UnsupportedModelError(f"longrope long_factor has {factors.size} values; the rotary dimensions need "
                                        f"{inv_freq.size}", code="unsupported_rope_scaling")
        return inv_freq / factors
    return _llama3(inv_freq, factor, scaling)


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (so every attention score by its square): the config's
    `attention_factor`; else YaRN's 0.1 ln(factor) + 1 (with DeepSeek's `mscale` / `mscale_all_dim`, their ratio),
    LongRoPE's sqrt(1 + ln(factor) / ln(original context)). 1.0 for the other types."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "longrope":
        original = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: np.ndarray, theta: float, dim: int, factor: float, scaling: dict[str, Any]) -> np.ndarray:
    """High frequencies kept, low ones divided by `factor`, a linear ramp between the dimensions that turn
    `beta_fast` and `beta_slow` times over the original context."""
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def _llama3(inv_freq: np.ndarray, factor: float, scaling: dict[str, Any]) -> np.ndarray:
    """Keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)
