"""Multi-head latent attention (DeepSeek V2/V3) over the paged pool, in its absorbed form.

Each position caches one latent key: the normalised compressed latent c (kv_lora_rank values) followed by the
rotated key shared by every head (qk_rope_head_dim values): one "kv head" of rank + rope values, a few per cent of
the full keys and values. Attention never expands the latent into per-head keys and values: kv_b_proj's key rows
(W_k, per head [nope, rank]) are folded into the queries and its value rows (W_v, per head [v, rank]) applied after
the weighted sum:
    score_h = q_nope_h . (W_k_h c) + q_rope_h . k_rope = (q_nope_h W_k_h) . c + q_rope_h . k_rope
    out_h = sum p_h (W_v_h c) = W_v_h (sum p_h c)
so each head's query is [q_nope_h W_k_h, q_rope_h] against the cached [c, k_rope] (MQA), and the values are the
latents themselves (the cache's first `rank` values). The same arithmetic as transformers' expanded form,
reassociated: float32 results agree to rounding (about 1e-6), not bit for bit.

The per-head matrices are loaded so (families/deepseek.py): `embed_q` [heads, rank, nope] (W_k_h transposed) and
`unembed_out` [heads, v, rank] (W_v_h), each a PerHead projection, float or quantized as stored (quant.QuantHeads);
a tensor-parallel rank holds its heads' matrices."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from exo_like.engines.torch.attention import Attention, StepIndex, rotate
from exo_like.engines.torch.linear import Linear
from exo_like.engines.torch.norm import RMSNorm
from exo_like.engines.base import WeightForms
from exo_like.models.affine import AffineGroups
from exo_like.models.config import ModelArgs
from exo_like.models.families.deepseek import EMBED_Q, KEY_ROWS, UNEMBED_OUT

LATENT_NORM_EPS = 1e-6  # transformers' DeepSeek builds its q_a / kv_a norms with the default eps, not the config's


class PerHead(nn.Module):
    """One [out, in] matrix per head: x [R, heads, in] -> [R, heads, out], head h through weight[h]."""

    def __init__(self, heads: int, inputs: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, outputs, inputs), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x.transpose(0, 1), self.weight.transpose(1, 2)).transpose(0, 1)


class LatentAttention(Attention):
    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        mla = args.mla
        self.mla = mla
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, 1, mla.latent_dim
        hidden, q_out = args.hidden_size, args.num_attention_heads * mla.qk_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=args.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = Linear(hidden, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, bias=args.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.embed_q = PerHead(self.n_heads, mla.qk_nope_head_dim, mla.kv_lora_rank)
        self.unembed_out = PerHead(self.n_heads, mla.kv_lora_rank, mla.v_head_dim)
        self.o_proj = Linear(self.n_heads * mla.v_head_dim, hidden, bias=args.o_bias)
        self.scale = args.attn_scale
        self.window, self.softcap, self.sinks, self.explicit = None, None, None, False
        self.latent_values = mla.kv_lora_rank

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                values: torch.Tensor | None, index: StepIndex) -> torch.Tensor:
        """x: the batch's rows [R, H]; keys: this layer's latent pool [1, slots, rank + rope] (no value pool)."""
        rows, mla = x.shape[0], self.mla
        if mla.q_lora_rank:
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(x)))
        else:
            q = self.q_proj.forward(x)
        q = q.view(rows, self.n_heads, mla.qk_head_dim)
        latent = self.kv_a_proj_with_mqa.forward(x)
        compressed = self.kv_a_layernorm.forward(latent[:, : mla.kv_lora_rank])
        k_rope = rotate(latent[:, None, mla.kv_lora_rank :], *rope)  # [R, 1, rope]
        keys.index_copy_(1, index.write_slots, torch.cat((compressed[:, None], k_rope), dim=-1).transpose(0, 1))
        # Each head's query in latent space: q_nope_h W_k_h [R, heads, rank], then its rotated part.
        q_latent = self.embed_q.forward(q[..., : mla.qk_nope_head_dim])
        queries = torch.cat((q_latent, rotate(q[..., mla.qk_nope_head_dim :], *rope)), dim=-1)
        out = self.attend(queries, keys, None, index)  # [R, heads, rank]: the values are the latents
        out = self.unembed_out.forward(out)  # [R, heads, v]
        return self.o_proj.forward(out.reshape(rows, -1))


def per_head_matrices(weights: dict[str, Any], args: ModelArgs, forms: WeightForms, device: torch.device,
                      dtype: torch.dtype) -> dict[str, Any]:
    """Latent attention's per-head projections (families/deepseek.py) as the engine holds them: quantized row
    stacks stay so (the installer splits them by head), float ones [heads, out, in]. A quantized kv_b_proj's key
    rows (k_b_proj, [heads x nope, rank], groups along the rank) become embed_q [heads, rank, nope] dequantized:
    the absorbed form multiplies by their transpose, whose groups would run across its rows, a form no kernel
    here takes (GGUF files store embed_q itself, grouped along its inputs, which stays quantized)."""
    heads, nope = args.num_attention_heads, args.mla.qk_nope_head_dim
    for name in [n for n in weights if n.endswith(f".{KEY_ROWS}.weight")]:
        matrix = weights.pop(name)
        if isinstance(matrix, AffineGroups):
            forms.add_dequantized(f"{matrix.source} (DeepSeek's key rows of kv_b_proj, used transposed)")
            matrix = torch.from_numpy(matrix.dequantize())
        values = matrix.view(heads, nope, -1).transpose(1, 2).contiguous()
        weights[name.replace(f".{KEY_ROWS}.", f".{EMBED_Q}.")] = values.to(device=device, dtype=dtype)
    for name in [n for n in weights if n.endswith((f".{EMBED_Q}.weight", f".{UNEMBED_OUT}.weight"))]:
        if isinstance(weights[name], torch.Tensor):  # float, or a dequantized row stack; in the engine's dtype
            tensor = weights[name]
            weights[name] = tensor.view(heads, -1, tensor.shape[-1]) if tensor.dim() == 2 else tensor
            weights[name] = weights[name].to(device=device, dtype=dtype)
    return weights
