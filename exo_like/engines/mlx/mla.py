"""Multi-head latent attention (DeepSeek V2/V3) on MLX, in its absorbed form: the pool caches one latent key a
position ([normalised latent, rotated shared key]); each head's query is folded into latent space through
kv_b_proj's key rows and its output unfolded through the value rows (see engines/torch/mla.py for the algebra)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from exo_like.engines.mlx.attention import Attention, LayerPool, RMSNorm, StepIndex
from exo_like.models.config import ModelArgs, rope_attention_factor, rope_inv_freq

LATENT_NORM_EPS = 1e-6  # transformers' DeepSeek builds its q_a / kv_a norms with the default eps, not the config's


class LatentAttention(Attention):
    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        mla = self._mla = args.mla
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, 1, mla.latent_dim
        self.scale, self.window, self.softcap = args.attn_scale, None, None
        hidden, q_out = args.hidden_size, args.num_attention_heads * mla.qk_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=args.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=args.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, self.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.n_heads * mla.v_head_dim, hidden, bias=args.o_bias)
        self._rope_freqs = mx.array(1.0 / rope_inv_freq(args))  # args.head_dim: the rotary part's width
        self._rope_factor = rope_attention_factor(args)
        self._rotary_dim = mla.qk_rope_head_dim
        self._latent: tuple[mx.array, mx.array] | None = None  # see _latent_weights

    def _latent_weights(self) -> tuple[mx.array, mx.array]:
        """kv_b_proj's key rows [heads, nope, rank] and value rows [heads, v, rank] (dequantized if need be), made
        on the first step after loading and kept (not per step)."""
        if self._latent is None:
            self._latent = self._split_latent_projection()
        return self._latent

    def _split_latent_projection(self) -> tuple[mx.array, mx.array]:
        mla, projection = self._mla, self.kv_b_proj
        weight = projection.weight if isinstance(projection, nn.Linear) else mx.dequantize(
            projection.weight, projection.scales, projection.get("biases"), projection.group_size, projection.bits,
            mode=projection.mode)
        weight = weight.reshape(self.n_heads, mla.qk_nope_head_dim + mla.v_head_dim, -1)
        w_k, w_v = mx.contiguous(weight[:, : mla.qk_nope_head_dim]), mx.contiguous(weight[:, mla.qk_nope_head_dim :])
        mx.eval(w_k, w_v)
        return w_k, w_v

    def __call__(self, x: mx.array, pool: LayerPool, index: StepIndex) -> mx.array:
        rows, mla = x.shape[0], self._mla
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if mla.q_lora_rank else self.q_proj(x)
        q = q.reshape(rows, self.n_heads, mla.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(x)
        compressed = self.kv_a_layernorm(latent[:, : mla.kv_lora_rank])
        k_rope = self._rope(latent[:, None, mla.kv_lora_rank :], index.positions)  # [R, 1, rope]
        pool.write(index.write_slots, mx.concatenate([compressed[:, None], k_rope], axis=-1).transpose(1, 0, 2), None)
        w_k, w_v = self._latent_weights()
        q_latent = (q[..., : mla.qk_nope_head_dim].transpose(1, 0, 2) @ w_k).transpose(1, 0, 2)  # [R, heads, rank]
        queries = mx.concatenate([q_latent, self._rope(q[..., mla.qk_nope_head_dim :], index.positions)], axis=-1)
        out = self.attend(queries, pool, index)  # [R, heads, rank]
        out = (out.transpose(1, 0, 2) @ w_v.swapaxes(1, 2)).transpose(1, 0, 2)  # [R, heads, v]
        return self.o_proj(out.reshape(rows, -1))
