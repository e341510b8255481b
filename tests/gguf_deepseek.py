"""DeepSeek V2/V3 checkpoints as llama.cpp's converter writes `deepseek2` files (its conversion/deepseek.py):
latent-attention metadata, kv_b_proj split per head into `attn_k_b` (transposed) and `attn_v_b`, shared experts as
`ffn_*_shexp`, V3's routing bias as `exp_probs_b.bias`; and the inverse, for the tests' dequantized oracle."""

from __future__ import annotations

import numpy as np

ARCH = "deepseek2"
_PARTS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def add_metadata(writer, config: dict) -> None:  # noqa: ANN001
    import gguf

    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_head_count_kv(1)
    writer.add_leading_dense_block_count(config.get("first_k_dense_replace") or 0)
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(config["qk_nope_head_dim"] + rope)
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("n_group") is not None:
        writer.add_expert_group_count(config["n_group"])
    if config.get("topk_group") is not None:
        writer.add_expert_group_used_count(config["topk_group"])
    if config.get("scoring_func"):
        kind = gguf.ExpertGatingFuncType.SIGMOID if config["scoring_func"] == "sigmoid" else \
            gguf.ExpertGatingFuncType.SOFTMAX
        writer.add_expert_gating_func(kind)
    writer.add_expert_shared_count(config.get("n_shared_experts") or 0)
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rope)
    rope_parameters = config.get("rope_parameters") or {}
    if rope_parameters.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope_parameters["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope_parameters["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope_parameters["beta_slow"])
        if rope_parameters.get("mscale_all_dim") is not None:
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope_parameters["mscale_all_dim"])


def gguf_tensors(tensors: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """Pop the latent-attention and shared-expert tensors from `tensors`; return them under GGUF names."""
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    out: dict[str, np.ndarray] = {}
    for name in [n for n in tensors if n.startswith("model.layers.")]:
        _, _, layer, rest = name.split(".", 3)
        if rest == "self_attn.kv_b_proj.weight":
            kv_b = tensors.pop(name).astype(np.float32).reshape(heads, nope + v, -1)
            out[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2))
            out[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
        elif rest in _PARTS:
            out[f"blk.{layer}.{_PARTS[rest]}"] = tensors.pop(name).astype(np.float32)
    return out


def is_latent_part(part: str) -> bool:
    """Whether a layer tensor's GGUF name (after `blk.N.`) is one hf_tensors names."""
    return part in _PARTS.values() or part in ("attn_k_b.weight", "attn_v_b.weight")


def hf_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse: GGUF-named latent-attention tensors (popped from `tensors`) under the checkpoint's names."""
    to_hf = {v: k for k, v in _PARTS.items()}
    out: dict[str, np.ndarray] = {}
    for name in [n for n in tensors if n.startswith("blk.")]:
        _, layer, part = name.split(".", 2)
        if part == "attn_k_b.weight":
            k_b, v_b = tensors.pop(name), tensors.pop(f"blk.{layer}.attn_v_b.weight")
            out[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = np.concatenate(
                [k_b.swapaxes(1, 2), v_b], axis=1).reshape(-1, k_b.shape[1])
        elif part in to_hf:
            out[f"model.layers.{layer}.{to_hf[part]}"] = tensors.pop(name)
    return out
