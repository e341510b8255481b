"""DeepSeek V2/V3 as llama.cpp's `deepseek2` files hold them.

Metadata -> config: the latent ranks (`attention.q_lora_rank`, `kv_lora_rank`), the head widths (`key_length_mla` =
nope + rope, `value_length_mla`, `rope.dimension_count`), the dense first layers (`leading_dense_block_count`), the
experts (`expert_shared_count`, `expert_weights_scale`, `expert_weights_norm`, groups) and YaRN's mscale
(`rope.scaling.yarn_log_multiplier` = 0.1 x mscale_all_dim). V3 is told from V2 by its sigmoid gating
(`expert_gating_func` 2) or its routing bias tensor (`exp_probs_b`).

Tensors: the converter splits kv_b_proj per head into `attn_k_b` [heads, rank, nope] (transposed) and `attn_v_b`
[heads, v, rank]: the per-head projections the engines hold (families/deepseek.py's embed_q and unembed_out), read
as they are stored; a quantized one as the row stack [heads x out, in] of its heads' matrices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ARCHITECTURE = "deepseek2"
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
ROUTING_BIAS = "mlp.e_score_correction_bias"
LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # files from before the converter split it
    "attn_k_b.weight": "self_attn.embed_q.weight",
    "attn_v_b.weight": "self_attn.unembed_out.weight",
    "exp_probs_b.bias": ROUTING_BIAS,
}


def model_type(key: Callable[[str, Any], Any], gguf_names: list[str]) -> str:
    sigmoid = key("expert_gating_func", None) == SIGMOID_GATING
    return "deepseek_v3" if sigmoid or any(name.endswith(".exp_probs_b.bias") for name in gguf_names) else \
        "deepseek_v2"


def config(key: Callable[[str, Any], Any], heads: int) -> dict[str, Any]:
    rope = int(key("rope.dimension_count", 64))
    groups = int(key("expert_group_count", 1) or 1)
    settings: dict[str, Any] = {
        "q_lora_rank": key("attention.q_lora_rank", None),
        "kv_lora_rank": int(key("attention.kv_lora_rank", 512)),
        "qk_rope_head_dim": rope,
        "head_dim": rope,  # (key_length is the latent's width; MLA's head_dim is its rotary part)
        "qk_nope_head_dim": int(key("attention.key_length_mla")) - rope,
        "v_head_dim": int(key("attention.value_length_mla")),
        "num_key_value_heads": heads,
        "first_k_dense_replace": int(key("leading_dense_block_count", 0)),
        "n_routed_experts": int(key("expert_count", 0)),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "n_shared_experts": int(key("expert_shared_count", 0)),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "n_group": groups,
        "topk_group": int(key("expert_group_used_count", 1) or 1),
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
    }
    log_multiplier = key("rope.scaling.yarn_log_multiplier", None)
    if log_multiplier is not None:  # both mscales of the released models are equal: only the scale's square stays
        settings["mscale"] = settings["mscale_all_dim"] = round(float(log_multiplier) / 0.1, 6)
    return settings
