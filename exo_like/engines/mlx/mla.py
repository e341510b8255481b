"""Multi-head latent attention (DeepSeek V2/V3) on MLX, in its absorbed form: the pool caches one latent key a
position ([normalised latent, rotated shared key]); each head's query is folded into latent space through
kv_b_proj's key rows and its output unfolded through the value rows (see engines/torch/mla.py for the algebra):
the per-head projections `embed_q` and `unembed_out` (families/deepseek.py), held as stored, quantized ones too
(QuantizedPerHead)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from exo_like.engines.mlx.attention import Attention, LayerPool, RMSNorm, StepIndex
from exo_like.models.config import ModelArgs, rope_attention_factor, rope_inv_freq

LATENT_NORM_EPS = 1e-6  # transformers' DeepSeek builds its q_a / kv_a norms with the default eps, not the config's


class PerHead(nn.Module):
    """One [out, in] matrix per head: x [heads, R, in] -> [heads, R, out], head h through weight[h]."""

    def __init__(self, heads: int, inputs: int, outputs: int):
        super().__init__()
        self.weight = mx.zeros((heads, outputs, inputs))

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight.swapaxes(-1, -2)

    def to_quantized(self, group_size: int, bits: int, mode: str = "affine", transposed: bool = False
                     ) -> "QuantizedPerHead | PerHead":
        """Quantized in groups along the stored rows (the speed probe quantizes every module it can: a width the
        groups do not divide stays float, as converters leave such matrices)."""
        heads, outputs, inputs = self.weight.shape
        if (outputs if transposed else inputs) % group_size:
            return self
        return QuantizedPerHead(heads, inputs, outputs, group_size, bits, mode, transposed)


class QuantizedPerHead(nn.Module):
    """PerHead held quantized as stored: each head's [out, in] grouped along its inputs, or (`transposed`, a
    quantized kv_b_proj's key rows) its [in, out] transpose grouped along the outputs, which MLX's quantized
    product takes as it is (transpose=False): no requantization, so no values change."""

    def __init__(self, heads: int, inputs: int, outputs: int, group_size: int, bits: int, mode: str,
                 transposed: bool):
        super().__init__()
        self.group_size, self.bits, self.mode, self.transposed = group_size, bits, mode, transposed
        rows, columns = (inputs, outputs) if transposed else (outputs, inputs)
        self.weight = mx.zeros((heads, rows, columns * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((heads, rows, columns // group_size))
        self.biases = mx.zeros((heads, rows, columns // group_size))
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=not self.transposed,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)


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
        self.embed_q = PerHead(self.n_heads, mla.qk_nope_head_dim, mla.kv_lora_rank)
        self.unembed_out = PerHead(self.n_heads, mla.kv_lora_rank, mla.v_head_dim)
        self.o_proj = nn.Linear(self.n_heads * mla.v_head_dim, hidden, bias=args.o_bias)
        self._rope_freqs = mx.array(1.0 / rope_inv_freq(args))  # args.head_dim: the rotary part's width
        self._rope_factor = rope_attention_factor(args)
        self._rotary_dim = mla.qk_rope_head_dim

    def __call__(self, x: mx.array, pool: LayerPool, index: StepIndex) -> mx.array:
        rows, mla = x.shape[0], self._mla
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if mla.q_lora_rank else self.q_proj(x)
        q = q.reshape(rows, self.n_heads, mla.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(x)
        compressed = self.kv_a_layernorm(latent[:, : mla.kv_lora_rank])
        k_rope = self._rope(latent[:, None, mla.kv_lora_rank :], index.positions)  # [R, 1, rope]
        pool.write(index.write_slots, mx.concatenate([compressed[:, None], k_rope], axis=-1).transpose(1, 0, 2), None)
        q_latent = self.embed_q(q[..., : mla.qk_nope_head_dim].transpose(1, 0, 2)).transpose(1, 0, 2)  # [R, heads, rank]
        queries = mx.concatenate([q_latent, self._rope(q[..., mla.qk_nope_head_dim :], index.positions)], axis=-1)
        out = self.attend(queries, pool, index)  # [R, heads, rank]
        out = self.unembed_out(out.transpose(1, 0, 2)).transpose(1, 0, 2)  # [R, heads, v]
        return self.o_proj(out.reshape(rows, -1))
