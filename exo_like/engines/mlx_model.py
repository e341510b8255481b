"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in MLX, built for one shard of the layers.

Parameter names follow the Hugging Face checkpoint (`model.layers.N.self_attn.q_proj.weight`, ...) with layers
numbered from 0 inside the shard, which is how `checkpoint.plan_shard_load` renames them, so the loaded tensors
drop straight into `ShardModel.load_weights`. Linear layers are plain `nn.Linear` / `nn.Embedding` so that
`nn.quantize` can later swap them for quantized ones before the weights are loaded.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from exo_like.model_config import ModelArgs, rope_inv_freq
from exo_like.shard import Shard


class KVCache:
    """Keys and values of one layer for one request, in buffers that grow by whole steps.

    Growing in steps (not per token) keeps decoding from copying the whole cache on every token.
    """

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append keys/values [B, n_kv_heads, T, head_dim]; return everything cached so far."""
        start, end = self.offset, self.offset + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        capacity = (needed + self.step - 1) // self.step * self.step
        batch, heads, _, k_dim = keys.shape
        new_keys = mx.zeros((batch, heads, capacity, k_dim), keys.dtype)
        new_values = mx.zeros((batch, heads, capacity, values.shape[3]), values.dtype)
        if self.keys is not None:
            new_keys[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_values[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_keys, new_values

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate after a step, so the next step does not drag this step's graph along."""
        return [] if self.keys is None else [self.keys, self.values]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        hidden, q_dim, kv_dim = args.hidden_size, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=args.o_bias)
        if args.qk_norm:
            # Qwen3 normalises each head's query and key before rope.
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        # mx.fast.rope takes periods (1 / inverse frequency). Using the shared float64-derived table for every
        # rope type keeps MLX and torch shards rotating by identical angles.
        self._rope_freqs = mx.array(1.0 / rope_inv_freq(args))

    def __call__(self, x: mx.array, mask: str | None, cache: KVCache) -> mx.array:
        batch, length, _ = x.shape
        queries = self.q_proj(x).reshape(batch, length, self.n_heads, self.head_dim)
        keys = self.k_proj(x).reshape(batch, length, self.n_kv_heads, self.head_dim)
        values = self.v_proj(x).reshape(batch, length, self.n_kv_heads, self.head_dim)
        if "q_norm" in self:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries = self._rope(queries.transpose(0, 2, 1, 3), cache.offset)
        keys = self._rope(keys.transpose(0, 2, 1, 3), cache.offset)
        keys, values = cache.update_and_fetch(keys, values.transpose(0, 2, 1, 3))
        # GQA: sdpa broadcasts the kv heads itself, so keys/values stay untiled.
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def _rope(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(
            x, self.head_dim, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._rope_freqs
        )


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden, inner = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=args.mlp_bias)
        self.up_proj = nn.Linear(hidden, inner, bias=args.mlp_bias)
        self.down_proj = nn.Linear(inner, hidden, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        # nn.RMSNorm is a thin wrapper over mx.fast.rms_norm.
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: str | None, cache: KVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class ShardBody(nn.Module):
    """The `model.*` part of the checkpoint that this shard holds."""

    def __init__(self, args: ModelArgs, shard: Shard):
        super().__init__()
        # A tied last stage needs the embedding matrix as its LM head even when it is not the first stage.
        if shard.is_first or (shard.is_last and args.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(shard.layer_count)]
        if shard.is_last:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class ShardModel(nn.Module):
    """Layers [start, end) of the model; token ids in if first, logits out if last, hidden states otherwise."""

    def __init__(self, args: ModelArgs, shard: Shard):
        super().__init__()
        self.args = args
        self.shard = shard
        self.model = ShardBody(args, shard)
        if shard.is_last and not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list[KVCache]) -> mx.array:
        """inputs: token ids [B, T] on the first shard, else hidden states [B, T, H]."""
        h = self.model.embed_tokens(inputs) if self.shard.is_first else inputs
        # sdpa's "causal" mask is aligned lower-right (last query sees last key), which is exactly the causal
        # mask for T new positions after `offset` cached ones; a single new position needs no mask at all.
        mask = "causal" if h.shape[1] > 1 else None
        for layer, layer_cache in zip(self.model.layers, cache):
            h = layer(h, mask, layer_cache)
        if not self.shard.is_last:
            return h
        h = self.model.norm(h)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.model.layers]
