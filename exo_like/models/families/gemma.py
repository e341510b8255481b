"""Gemma 2 and Gemma 3 (text): Llama's layout with
- RMSNorm scaling by (1 + w), computed in float32, and four norms a layer (after attention, before and after the MLP);
- a GELU (tanh approximation) gate instead of SiLU; embeddings times sqrt(hidden_size); tied embeddings;
- attention scaled by query_pre_attn_scalar ** -0.5, with sliding-window layers among full ones: every other
  layer (Gemma 2), five of six (Gemma 3), as `layer_types` says;
- Gemma 2: attention scores and final logits soft-capped (tanh(x / cap) * cap);
- Gemma 3: per-head query/key norms, and two rope bases: local layers 10,000 unscaled, global ones `rope_theta`
  with the config's scaling."""

from __future__ import annotations

from typing import Any

from exo_like.models.families.base import Family
from exo_like.models.rope import rope_settings


def parse(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    n_layers = int(config["num_hidden_layers"])
    window = int(config.get("sliding_window") or 0) or None
    fields: dict[str, Any] = {
        "qkv_bias": bool(config.get("attention_bias", False)), "o_bias": bool(config.get("attention_bias", False)),
        "mlp_bias": False, "qk_norm": model_type == "gemma3_text", "hidden_act": "gelu_tanh", "norm_offset": True,
        "sandwich_norms": True, "embed_scale": True,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
        "attn_scale": float(config.get("query_pre_attn_scalar") or config.get("head_dim") or 256) ** -0.5,
        "attn_softcap": _float_or_none(config.get("attn_logit_softcapping")),
        "final_softcap": _float_or_none(config.get("final_logit_softcapping")),
        "layer_windows": tuple(window if kind == "sliding_attention" else None
                               for kind in _layer_types(model_type, config, n_layers)),
    }
    if model_type == "gemma3_text":
        fields.update(_gemma3_rope(config))
    return fields


def _layer_types(model_type: str, config: dict[str, Any], n_layers: int) -> list[str]:
    if config.get("layer_types"):
        return list(config["layer_types"])
    # Hub configs before transformers 5 give the pattern instead: Gemma 2 alternates, Gemma 3 has 5 local : 1 global.
    pattern = int(config.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]


def _gemma3_rope(config: dict[str, Any]) -> dict[str, Any]:
    """Global layers: `rope_theta` with `rope_scaling`; local ones: `rope_local_base_freq`, unscaled. transformers 5
    writes both under `rope_parameters`, by layer type."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = rope_settings({"rope_parameters": params["full_attention"]})
        local, _ = rope_settings({"rope_parameters": params.get("sliding_attention") or {}})
        return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local}
    return {"local_rope_theta": float(config.get("rope_local_base_freq") or 10000.0)}


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


GEMMA = Family(
    name="Gemma 2, Gemma 3",
    model_types=("gemma2", "gemma3_text"),
    summary="(1 + w) RMSNorm, four norms a layer, GELU-tanh, sqrt(hidden) embedding scale, sliding-window layers; "
            "Gemma 2 soft-caps scores and logits, Gemma 3 has q/k norms and local/global rope bases",
    parse=parse,
)
