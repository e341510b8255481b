"""How many parameters a model has, and how many of them one token runs through (a mixture of experts runs only
its top-k routed experts): what GET /v1/models, /v1/cluster and the dashboard show beside the architecture."""

from __future__ import annotations

from dataclasses import dataclass

from exo_like.models.config import ModelArgs


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int  # per token: every shared weight, and top_k of each mixture's routed experts

    def to_json(self) -> dict[str, int]:
        return {"total": self.total, "active": self.active}


def count_parameters(args: ModelArgs) -> ParameterCount:
    """From the config's shapes (embedding, head unless tied, every layer's attention, norms and MLP)."""
    hidden = args.hidden_size
    outer = args.vocab_size * hidden * (1 if args.tie_word_embeddings else 2) + hidden
    total = active = outer
    for layer in range(args.num_hidden_layers):
        norms = (4 if args.sandwich_norms else 2) * hidden  # Gemma: after attention and around the MLP too
        shared, routed, routed_active = _attention(args) + norms, 0, 0
        moe = args.moe if args.is_sparse_layer(layer) else None
        if moe is None:
            shared += _mlp(hidden, args.intermediate_size, args.mlp_bias)
        else:
            shared += moe.n_experts * (hidden + moe.router_bias)  # the router
            if moe.shared_expert_size:
                shared += _mlp(hidden, moe.shared_expert_size, False) + (hidden if moe.shared_expert_gated else 0)
            expert = _mlp(hidden, moe.expert_size, moe.expert_bias)
            routed, routed_active = moe.n_experts * expert, moe.top_k * expert
        total += shared + routed
        active += shared + routed_active
    return ParameterCount(total, active)


def _attention(args: ModelArgs) -> int:
    if args.mla is not None:
        return _latent_attention(args)
    q = args.num_attention_heads * args.head_dim
    kv = args.num_key_value_heads * args.head_dim
    weights = args.hidden_size * (q + 2 * kv) + q * args.hidden_size
    biases = (q + 2 * kv if args.qkv_bias else 0) + (args.hidden_size if args.o_bias else 0)
    sinks = args.num_attention_heads if args.attn_sinks else 0
    return weights + biases + sinks + (2 * args.head_dim if args.qk_norm else 0)


def _mlp(hidden: int, inner: int, bias: bool) -> int:
    return 3 * hidden * inner + ((2 * inner + hidden) if bias else 0)


def _latent_attention(args: ModelArgs) -> int:
    """DeepSeek's: queries (through the low-rank bottleneck and its norm, or direct), the latent projection and
    norm, the latent's expansion to per-head keys and values, the output."""
    mla, hidden, heads = args.mla, args.hidden_size, args.num_attention_heads
    bias = args.qkv_bias
    if mla.q_lora_rank:
        queries = hidden * mla.q_lora_rank + bias * mla.q_lora_rank + mla.q_lora_rank + \
            mla.q_lora_rank * heads * mla.qk_head_dim
    else:
        queries = hidden * heads * mla.qk_head_dim
    latent = hidden * mla.latent_dim + bias * mla.latent_dim + mla.kv_lora_rank
    expand = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return queries + latent + expand + heads * mla.v_head_dim * hidden
