"""RMSNorm as transformers computes it (float32 statistics, rounded back), and Qwen3's per-head query/key norms."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in float32 and rounded back, as transformers does."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op, bit-identical here to the steps below (fewer op calls)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps)


class QKNorm(nn.Module):
    """Qwen3's per-head RMSNorms of queries and keys, applied to the fused [T, q heads + kv heads, D] tensor."""

    def __init__(self, head_dim: int, n_heads: int, eps: float):
        super().__init__()
        self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.n_heads = n_heads

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        out = rms_normalize(qk, self.q_norm.eps)  # a fresh tensor, so scaling it in place is safe
        out[:, : self.n_heads] *= self.q_norm.weight
        out[:, self.n_heads :] *= self.k_norm.weight
        return out
