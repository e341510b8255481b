"""Phi-3 and Phi-4 (`phi3`): Llama's block with its projections stored fused, `self_attn.qkv_proj` (query, key and
value rows) and `mlp.gate_up_proj` (gate rows, then up rows), as the torch engine holds them anyway; the MLX engine
splits them on load. No biases, no query/key norms.

The 128k-context models scale rope with LongRoPE (per-dimension long factors, cos/sin times
sqrt(1 + ln(factor) / ln(original context)); models/rope.py), and Phi-4-mini rotates only the first 3/4 of each
head's dimensions (`partial_rotary_factor`)."""

from __future__ import annotations

from typing import Any

from exo_like.models.families.base import Family
from exo_like.models.families.llama import sliding_windows


def parse(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    # Phi-3-mini-4k attends through a window of 2047 in every layer; Phi-4 has none.
    return {"qkv_bias": False, "o_bias": False, "qk_norm": False, "mlp_bias": False, **sliding_windows(config)}


PHI3 = Family(
    name="Phi-3, Phi-4",
    model_types=("phi3",),
    summary="Llama's block with q/k/v and gate/up stored fused (qkv_proj, gate_up_proj); LongRoPE (128k models), "
            "partial rotary (Phi-4-mini)",
    parse=parse,
)
