"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 attention with a mixture-of-experts MLP in the layers the config
names sparse. The router is a softmax over all experts (float32), the top k kept and, with `norm_topk_prob`,
renormalised; Qwen2-MoE adds a shared expert whose output a sigmoid gate scales."""

from __future__ import annotations

from typing import Any

from exo_like.models.families.base import Family, MoeArgs, sparse_layers
from exo_like.models.families.llama import attention_fields, sliding_windows


def parse(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `num_local_experts` where the Hub's configs say `num_experts`.
    n_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    shared = int(config.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    moe = MoeArgs(
        n_experts=n_experts,
        top_k=int(config["num_experts_per_tok"]),
        expert_size=int(config["moe_intermediate_size"]),
        renormalize=bool(config.get("norm_topk_prob", False)),
        sparse_layers=sparse_layers(config, n_experts),
        shared_expert_size=shared,
        shared_expert_gated=shared > 0,
    )
    return {**attention_fields(model_type, config), "mlp_bias": False, "moe": moe, **sliding_windows(config)}


QWEN_MOE = Family(
    name="Qwen2-MoE, Qwen3-MoE",
    model_types=("qwen2_moe", "qwen3_moe"),
    summary="Qwen2/Qwen3 attention; softmax top-k routed experts (Qwen2-MoE: plus a sigmoid-gated shared expert)",
    parse=parse,
)
