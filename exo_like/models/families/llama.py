"""The Llama family as the Hub has it: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 and Qwen3. Rotate-half rope, RMSNorm
before attention and before the SwiGLU MLP; Qwen2 adds q/k/v biases, Qwen3 per-head query/key norms. Mistral 7B v0.1
attends through a sliding window in every layer, Qwen2/3 in the layers their config names when it uses one."""

from __future__ import annotations

from typing import Any

from exo_like.models.families.base import Family


def attention_fields(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    """Biases and query/key norms of the attention projections, by model type."""
    attention_bias = bool(config.get("attention_bias", False))
    if model_type in ("qwen2", "qwen2_moe"):
        # Qwen2 always has q/k/v bias and no o bias (Qwen2-MoE's config may say so in `qkv_bias`).
        return {"qkv_bias": bool(config.get("qkv_bias", True)), "o_bias": False, "qk_norm": False}
    return {"qkv_bias": attention_bias, "o_bias": attention_bias,
            "qk_norm": model_type in ("qwen3", "qwen3_moe")}


def parse(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    return {**attention_fields(model_type, config), "mlp_bias": bool(config.get("mlp_bias", False)),
            **sliding_windows(config)}


def sliding_windows(config: dict[str, Any]) -> dict[str, Any]:
    """Which layers attend through a window, as transformers runs them: the config's `layer_types` (transformers 5
    writes them); else Qwen2/3's rule (layers from `max_window_layers` on, when `use_sliding_window`); else every
    layer (Mistral 7B v0.1). No window: {}."""
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return {}
    n_layers = int(config["num_hidden_layers"])
    if config.get("layer_types"):
        kinds = list(config["layer_types"])
    elif "max_window_layers" in config:
        kinds = ["sliding_attention" if i >= int(config["max_window_layers"]) else "full_attention"
                 for i in range(n_layers)]
    else:
        kinds = ["sliding_attention"] * n_layers
    return {"layer_windows": tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)}


LLAMA = Family(
    name="Llama, Mistral, Qwen2/2.5, Qwen3",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    summary="the base: rotate-half rope (Llama 3.x scaling), RMSNorm, SwiGLU; Qwen2 q/k/v biases; Qwen3 q/k norms",
    parse=parse,
)
