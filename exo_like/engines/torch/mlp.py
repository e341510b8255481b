"""The feed-forward blocks: the SwiGLU MLP, and the mixture of experts that runs each token through the few experts
its router picks.

The mixture follows transformers' eager Qwen3-MoE / Mixtral experts operation by operation (float32 softmax, top
k, optional renormalisation, hit experts in ascending order, each over the rows routed to it, weighted and
accumulated with index_add_), so float32 results match it exactly; gpt-oss's router (a bias, softmax over the top k
logits) and clamped experts follow its own eager code the same way. Each expert is an MLP of its own: quantized
experts become int4 packs one by one (quant.Installer) and every product runs on the kernel Linear picks. Nothing
is computed for experts no row picked."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from exo_like.engines.torch.linear import Linear
from exo_like.models.families import MoeArgs, Router


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gated(activation: str, alpha: float = 1.702, limit: float = 7.0) -> Glu:
    """(gate, up) -> the MLP's inner activations: act(gate) * up, or gpt-oss's clamped SwiGLU in its own order."""
    if activation == "swiglu_clamped":
        def clamped(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))
        return clamped
    act = ACTIVATIONS[activation]
    return lambda gate, up: act(gate) * up


class MLP(nn.Module):
    """down(glu(gate(x), up(x))): SwiGLU, Gemma's GELU-tanh gate, or gpt-oss's clamped SwiGLU."""

    def __init__(self, hidden: int, inner: int, bias: bool = False, glu: Glu | str = "silu"):
        super().__init__()
        self.hidden = inner
        # One fused projection: gate rows, then up rows.
        self.gate_up_proj = Linear(hidden, 2 * inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)
        self.glu = gated(glu) if isinstance(glu, str) else glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        return self.down_proj.forward(self.glu(gate_up[:, : self.hidden], gate_up[:, self.hidden :]))


class SparseMoe(nn.Module):
    """Routed experts (and a shared expert, if the family has one) over the batch's rows [R, H]."""

    def __init__(self, hidden: int, moe: MoeArgs):
        super().__init__()
        self.moe = moe
        self.top_k, self.renormalize, self.router = moe.top_k, moe.renormalize, moe.router
        self.gate = Linear(hidden, moe.n_experts, bias=moe.router_bias)  # the router
        # DeepSeek V3: a learned per-expert bias added to the scores when choosing (not when weighting)
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.n_experts), requires_grad=False) \
            if moe.router == Router.GROUPED_SIGMOID else None
        glu = gated(moe.activation, moe.swiglu_alpha, moe.swiglu_limit)
        self.experts = nn.ModuleList(MLP(hidden, moe.expert_size, moe.expert_bias, glu) for _ in range(moe.n_experts))
        self.shared_expert = MLP(hidden, moe.shared_expert_size) if moe.shared_expert_size else None
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if moe.shared_expert_gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = self.run_experts(x, weights, chosen)
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate.forward(x)) * shared
            out = out + shared
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts [R, k] and their weights [R, k] (in x's dtype)."""
        if self.router == Router.SOFTMAX_OF_TOP_K:  # gpt-oss: softmax over the chosen logits, in their dtype
            logits, chosen = torch.topk(self.gate.forward(x), self.top_k, dim=-1)
            return torch.softmax(logits, dim=1, dtype=logits.dtype), chosen
        if self.router in (Router.GROUPED_SOFTMAX, Router.GROUPED_SIGMOID):
            weights, chosen = self._grouped(x)
        else:
            probs = torch.softmax(self.gate.forward(x), dim=-1, dtype=torch.float32)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
            if self.renormalize:
                weights /= weights.sum(dim=-1, keepdim=True)
        if self.moe.scale != 1.0:
            weights = weights * self.moe.scale
        return weights.to(x.dtype), chosen

    def _grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's group-limited routing, in float32 as transformers runs it: experts outside the best
        `topk_group` groups are out of the choice. V2 ranks groups by their best softmax score; V3 by the sum of
        their two best bias-corrected sigmoid scores, chooses on those, and weights by the plain sigmoid."""
        moe = self.moe
        logits = self.gate.forward(x).float()
        per_group = moe.n_experts // moe.n_group
        if self.router == Router.GROUPED_SOFTMAX:
            scores = choice = logits.softmax(dim=-1, dtype=torch.float32)
            groups = choice.view(-1, moe.n_group, per_group).max(dim=-1).values
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            groups = choice.view(-1, moe.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(groups, k=moe.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(groups).scatter_(1, best, 1).bool()
        keep = keep.unsqueeze(-1).expand(-1, moe.n_group, per_group).reshape(-1, moe.n_experts)
        # transformers fills excluded softmax scores with 0 (V2) and excluded biased sigmoid scores with -inf (V3)
        choice = choice.masked_fill(~keep, 0.0 if self.router == Router.GROUPED_SOFTMAX else float("-inf"))
        chosen = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, chosen

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Sum over each row's chosen experts of weight x expert(row), expert by expert in ascending order."""
        out = torch.zeros_like(x)
        flat = chosen.reshape(-1)  # entry row * k + j: the j-th choice of row `row`
        # A stable sort groups the (row, choice) entries by expert, rows ascending within each expert.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        flat_weights = weights.reshape(-1, 1)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            entries = order[start:start + count]
            start += count
            rows = entries // self.top_k
            expert_out = self.experts[expert].forward(x.index_select(0, rows)) * flat_weights[entries]
            out.index_add_(0, rows, expert_out)
        return out
