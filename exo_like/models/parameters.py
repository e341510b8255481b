"""A model's tensors, described once: each decoder layer's tensors by checkpoint name and shape (`layer_shapes`,
what the speed probe builds a random layer from), and from them how many parameters the model has and how many one
token runs through (a mixture of experts runs only its top-k routed experts): what GET /v1/models, /v1/cluster and
the dashboard show beside the architecture."""

from __future__ import annotations

import math
from dataclasses import dataclass

from exo_like.models.config import ModelArgs
from exo_like.models.families import Router

# Tensors a layer holds that transformers keeps as buffers, not parameters (its counts leave them out).
BUFFERS = ("mlp.e_score_correction_bias",)


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int  # per token: every shared weight, and top_k of each mixture's routed experts

    def to_json(self) -> dict[str, int]:
        return {"total": self.total, "active": self.active}


def count_parameters(args: ModelArgs) -> ParameterCount:
    """From the config's shapes: the embedding, the head unless tied, the final norm and every layer's tensors."""
    hidden = args.hidden_size
    outer = args.vocab_size * hidden * (1 if args.tie_word_embeddings else 2) + hidden
    total = active = outer
    for layer in range(args.num_hidden_layers):
        sizes = {name: math.prod(shape) for name, shape in layer_shapes(args, layer).items()
                 if not name.endswith(BUFFERS)}
        routed = sum(size for name, size in sizes.items() if ".mlp.experts." in name)
        total += sum(sizes.values())
        active += sum(sizes.values()) - routed
        if routed:
            active += routed // args.moe.n_experts * args.moe.top_k
    return ParameterCount(total, active)


def mlp_shapes(prefix: str, hidden: int, inner: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.gate_proj.weight": (inner, hidden), f"{prefix}.up_proj.weight": (inner, hidden),
              f"{prefix}.down_proj.weight": (hidden, inner)}
    if bias:
        shapes.update({f"{prefix}.gate_proj.bias": (inner,), f"{prefix}.up_proj.bias": (inner,),
                       f"{prefix}.down_proj.bias": (hidden,)})
    return shapes


def layer_shapes(args: ModelArgs, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """Checkpoint names (as a shard of one layer names them) and shapes of decoder layer `layer`'s tensors."""
    hidden, heads, kv, dim = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
    inner = args.intermediate_size
    prefix = "model.layers.0."
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        **(latent_attention_shapes(args) if args.mla is not None else {
            "self_attn.q_proj.weight": (heads * dim, hidden), "self_attn.k_proj.weight": (kv * dim, hidden),
            "self_attn.v_proj.weight": (kv * dim, hidden), "self_attn.o_proj.weight": (hidden, heads * dim)}),
    }
    if args.sandwich_norms:
        shapes.update({"pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,)})
    moe = args.moe if args.is_sparse_layer(layer) else None
    if moe is None:
        shapes.update(mlp_shapes("mlp", hidden, inner, args.mlp_bias))
    else:
        shapes["mlp.gate.weight"] = (moe.n_experts, hidden)
        if moe.router_bias:
            shapes["mlp.gate.bias"] = (moe.n_experts,)
        if moe.router == Router.GROUPED_SIGMOID:
            shapes["mlp.e_score_correction_bias"] = (moe.n_experts,)
        for expert in range(moe.n_experts):
            shapes.update(mlp_shapes(f"mlp.experts.{expert}", hidden, moe.expert_size, moe.expert_bias))
        if moe.shared_expert_size:
            shapes.update(mlp_shapes("mlp.shared_expert", hidden, moe.shared_expert_size))
        if moe.shared_expert_gated:
            shapes["mlp.shared_expert_gate.weight"] = (1, hidden)
    if args.qkv_bias and args.mla is None:
        shapes.update({"self_attn.q_proj.bias": (heads * dim,), "self_attn.k_proj.bias": (kv * dim,),
                       "self_attn.v_proj.bias": (kv * dim,)})
    if args.o_bias:
        shapes["self_attn.o_proj.bias"] = (hidden,)
    if args.attn_sinks:
        shapes["self_attn.sinks"] = (heads,)
    if args.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (dim,), "self_attn.k_norm.weight": (dim,)})
    return {prefix + name: shape for name, shape in shapes.items()}


def latent_attention_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """DeepSeek's attention tensors (MLA)."""
    mla, hidden, heads = args.mla, args.hidden_size, args.num_attention_heads
    q_out = heads * mla.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.kv_a_proj_with_mqa.weight": (mla.latent_dim, hidden),
        "self_attn.kv_a_layernorm.weight": (mla.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        "self_attn.o_proj.weight": (hidden, heads * mla.v_head_dim),
    }
    if mla.q_lora_rank:
        shapes.update({"self_attn.q_a_proj.weight": (mla.q_lora_rank, hidden),
                       "self_attn.q_a_layernorm.weight": (mla.q_lora_rank,),
                       "self_attn.q_b_proj.weight": (q_out, mla.q_lora_rank)})
    else:
        shapes["self_attn.q_proj.weight"] = (q_out, hidden)
    if args.qkv_bias:
        shapes["self_attn.kv_a_proj_with_mqa.bias"] = (mla.latent_dim,)
        if mla.q_lora_rank:
            shapes["self_attn.q_a_proj.bias"] = (mla.q_lora_rank,)
    return shapes
