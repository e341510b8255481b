"""RMSNorm as transformers computes it (float32 statistics), and per-head query/key norms (Qwen3, Gemma 3).

Two conventions: Llama's rounds the normalised x back to the activations' dtype, then scales by w; Gemma's
(`offset`) scales by (1 + w) in float32 and rounds once at the end."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_normalize32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in float32 and rounded back, as transformers does."""
    return rms_normalize32(x, eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims), requires_grad=False)
        self.eps, self.offset = eps, offset
        self.scale: torch.Tensor | None = None  # Gemma's 1 + w in float32, made once the weight is loaded

    def prepare(self) -> None:
        """After loading: Gemma's scale, so a step does not add 1 to every norm's weight again."""
        if self.offset:
            self.scale = 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            scale = self.scale if self.scale is not None else 1.0 + self.weight.float()
            if x.dtype == torch.float32:
                return F.rms_norm(x, scale.shape, scale, self.eps)
            return (rms_normalize32(x, self.eps) * scale).to(x.dtype)
        if x.dtype == torch.float32:  # one fused op, bit-identical here to the steps below (fewer op calls)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps)


class QKNorm(nn.Module):
    """Per-head RMSNorms of queries and keys, applied to the fused [T, q heads + kv heads, D] tensor."""

    def __init__(self, head_dim: int, n_heads: int, eps: float, offset: bool = False):
        super().__init__()
        self.q_norm, self.k_norm = RMSNorm(head_dim, eps, offset), RMSNorm(head_dim, eps, offset)
        self.n_heads, self.offset = n_heads, offset

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        if self.offset:  # Gemma: scaled in float32, rounded once
            out = rms_normalize32(qk, self.q_norm.eps)
            out[:, : self.n_heads] *= self.q_norm.scale if self.q_norm.scale is not None else \
                1.0 + self.q_norm.weight.float()
            out[:, self.n_heads :] *= self.k_norm.scale if self.k_norm.scale is not None else \
                1.0 + self.k_norm.weight.float()
            return out.to(qk.dtype)
        out = rms_normalize(qk, self.q_norm.eps)  # a fresh tensor, so scaling it in place is safe
        out[:, : self.n_heads] *= self.q_norm.weight
        out[:, self.n_heads :] *= self.k_norm.weight
        return out
