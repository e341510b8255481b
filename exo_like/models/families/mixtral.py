"""Mixtral: Mistral's attention with a mixture of experts in every layer: softmax router, top k (2 of 8 in the
released models) always renormalised. Its checkpoints name the experts `block_sparse_moe.experts.E.w1/w2/w3`
(gate, down, up); they are renamed to the shared `mlp.experts.E.{gate,down,up}_proj`."""

from __future__ import annotations

from typing import Any

from exo_like.models.families.base import Family, MoeArgs
from exo_like.models.families.llama import sliding_windows


def parse(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    moe = MoeArgs(
        n_experts=int(config["num_local_experts"]),
        top_k=int(config["num_experts_per_tok"]),
        expert_size=int(config["intermediate_size"]),
        renormalize=True,
        sparse_layers=tuple(range(int(config["num_hidden_layers"]))),
    )
    return {"qkv_bias": False, "o_bias": False, "qk_norm": False, "mlp_bias": False, "moe": moe,
            **sliding_windows(config)}


MIXTRAL = Family(
    name="Mixtral",
    model_types=("mixtral",),
    summary="Mistral attention; every MLP a softmax top-k mixture of SwiGLU experts, weights renormalised",
    parse=parse,
    renames=(
        (r"^block_sparse_moe\.gate\.", "mlp.gate."),
        (r"^block_sparse_moe\.experts\.(\d+)\.w1\.", r"mlp.experts.\1.gate_proj."),
        (r"^block_sparse_moe\.experts\.(\d+)\.w2\.", r"mlp.experts.\1.down_proj."),
        (r"^block_sparse_moe\.experts\.(\d+)\.w3\.", r"mlp.experts.\1.up_proj."),
    ),
)
