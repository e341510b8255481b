"""The feed-forward blocks on MLX: the SwiGLU MLP, and the mixture of experts.

Experts are stacked per projection ([experts, out, in], the layout of mlx-lm and of MLX-format checkpoints, under
`mlp.switch_mlp.*`); each row's chosen experts run through `mx.gather_mm` (`mx.gather_qmm` when quantized), which
reads only the chosen experts' matrices. For many rows, the (row, choice) pairs are sorted by expert first so each
expert's matrix is read once for all its rows. Numerics follow transformers' routing: float32 softmax over the
router's logits, top k, optional renormalisation, weights in the activations' dtype."""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from exo_like.models.families import MoeArgs, Router

SORT_FROM_PAIRS = 64  # (row, choice) pairs from which sorting them by expert pays (mlx-lm's threshold too)
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": nn.gelu_approx}  # gelu_approx: GELU's tanh approximation
Glu = Callable[[mx.array, mx.array], mx.array]


def gated(activation: str, alpha: float = 1.702, limit: float = 7.0) -> Glu:
    """(gate, up) -> the MLP's inner activations: act(gate) * up, or gpt-oss's clamped SwiGLU."""
    if activation == "swiglu_clamped":
        def clamped(gate: mx.array, up: mx.array) -> mx.array:
            gate, up = mx.minimum(gate, limit), mx.clip(up, -limit, limit)
            return (up + 1) * (gate * mx.sigmoid(gate * alpha))
        return clamped
    act = ACTIVATIONS[activation]
    return lambda gate, up: act(gate) * up


class MLP(nn.Module):
    """down(glu(gate(x), up(x))): SwiGLU, Gemma's GELU-tanh gate, or gpt-oss's clamped SwiGLU."""

    def __init__(self, hidden: int, inner: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.glu = gated(activation)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class ExpertLinear(nn.Module):
    """One projection of every expert, weight [experts, out, in] (and a bias [experts, out] if the family has
    one); each input row runs through the experts named by its indices."""

    def __init__(self, inputs: int, outputs: int, n_experts: int, bias: bool = False):
        super().__init__()
        bound = math.sqrt(1 / inputs)
        self.weight = mx.random.uniform(-bound, bound, (n_experts, outputs, inputs))
        if bias:
            self.bias = mx.zeros((n_experts, outputs))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        out = mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        return add_expert_bias(self, out, indices)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine",
                     **_: object) -> "QuantizedExpertLinear":
        return QuantizedExpertLinear(self["weight"], self.get("bias"), group_size or 64, bits or 4, mode)


class QuantizedExpertLinear(nn.Module):
    def __init__(self, weight: mx.array, bias: mx.array | None, group_size: int, bits: int, mode: str):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        packed = mx.quantize(weight, group_size, bits, mode=mode)
        self.weight, self.scales = packed[0], packed[1]
        if len(packed) > 2:  # affine mode has biases; the float-scale modes (mxfp4) do not
            self.biases = packed[2]
        if bias is not None:
            self.bias = bias
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        out = mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices,
                            transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode,
                            sorted_indices=sorted_indices)
        return add_expert_bias(self, out, indices)


def add_expert_bias(projection: nn.Module, out: mx.array, indices: mx.array) -> mx.array:
    """out [..., 1, out] of each (row, expert) pair plus that expert's bias, if the projection has biases."""
    return out if "bias" not in projection else out + mx.expand_dims(projection["bias"][indices], -2)


class Experts(nn.Module):
    """The routed experts' SwiGLU: x [R, H] and each row's k experts [R, k] -> [R, k, H]."""

    def __init__(self, hidden: int, moe: MoeArgs):
        super().__init__()
        inner, n_experts, bias = moe.expert_size, moe.n_experts, moe.expert_bias
        self.gate_proj = ExpertLinear(hidden, inner, n_experts, bias)
        self.up_proj = ExpertLinear(hidden, inner, n_experts, bias)
        self.down_proj = ExpertLinear(inner, hidden, n_experts, bias)
        self.glu = gated(moe.activation, moe.swiglu_alpha, moe.swiglu_limit)

    def __call__(self, x: mx.array, chosen: mx.array) -> mx.array:
        rows, k = chosen.shape
        if chosen.size < SORT_FROM_PAIRS:
            # Each row a batch of one [1, H] against its k experts' matrices: [R, k, 1, H] out.
            h, indices, order = x[:, None, None, :], chosen, None
        else:
            flat = chosen.reshape(-1)
            order = mx.argsort(flat)
            h, indices = x[order // k][:, None, :], flat[order]
        sort = order is not None
        h = self.glu(self.gate_proj(h, indices, sort), self.up_proj(h, indices, sort))
        h = self.down_proj(h, indices, sort)
        if order is not None:
            h = h[mx.argsort(order)]  # back to (row, choice) order
        return h.reshape(rows, k, -1)


class SparseMoe(nn.Module):
    """Router, routed experts (stacked) and, if the family has one, a shared expert, over rows [R, H]."""

    def __init__(self, hidden: int, moe: MoeArgs):
        super().__init__()
        self.moe = moe
        self.top_k, self.renormalize, self.router = moe.top_k, moe.renormalize, moe.router
        self.gate = nn.Linear(hidden, moe.n_experts, bias=moe.router_bias)
        if moe.router == Router.GROUPED_SIGMOID:  # DeepSeek V3's per-expert choice bias
            self.e_score_correction_bias = mx.zeros((moe.n_experts,))
        self.switch_mlp = Experts(hidden, moe)
        if moe.shared_expert_size:
            self.shared_expert = MLP(hidden, moe.shared_expert_size)
        if moe.shared_expert_gated:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        weights, chosen = self.route(x)
        out = (self.switch_mlp(x, chosen) * weights.astype(x.dtype)[..., None]).sum(axis=-2)
        if "shared_expert" in self:
            shared = self.shared_expert(x)
            if "shared_expert_gate" in self:
                shared = mx.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Each row's k experts [R, k] (in no particular order) and their weights."""
        logits = self.gate(x)
        if self.router == Router.SOFTMAX_OF_TOP_K:  # gpt-oss: softmax over the chosen logits only
            chosen = mx.argpartition(-logits, kth=self.top_k - 1, axis=-1)[:, :self.top_k]
            return mx.softmax(mx.take_along_axis(logits, chosen, axis=-1), axis=-1, precise=True), chosen
        if self.router == Router.GROUPED_SIGMOID:
            scores = mx.sigmoid(logits.astype(mx.float32))
            choice = scores + self["e_score_correction_bias"].astype(mx.float32)
        else:
            scores = choice = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
        if self.router in (Router.GROUPED_SOFTMAX, Router.GROUPED_SIGMOID):
            choice = self._within_best_groups(choice)
        chosen = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[:, :self.top_k]
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if self.renormalize:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + (1e-20 if self.router == Router.GROUPED_SIGMOID
                                                                        else 0.0))
        return weights * self.moe.scale if self.moe.scale != 1.0 else weights, chosen

    def _within_best_groups(self, choice: mx.array) -> mx.array:
        """DeepSeek: scores outside the `topk_group` best groups out of the choice. V2 ranks a group by its best
        score, V3 by its two best summed."""
        moe = self.moe
        grouped = choice.reshape(-1, moe.n_group, moe.n_experts // moe.n_group)
        if self.router == Router.GROUPED_SOFTMAX:
            group_scores = grouped.max(axis=-1)
        else:
            group_scores = mx.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
        dropped = mx.argpartition(group_scores, kth=moe.n_group - moe.topk_group - 1, axis=-1)[
            :, : moe.n_group - moe.topk_group]
        outside = mx.put_along_axis(mx.zeros_like(group_scores), dropped, mx.array(1.0), axis=-1)
        outside = mx.broadcast_to(outside[..., None], grouped.shape).reshape(choice.shape) > 0
        return mx.where(outside, 0.0 if self.router == Router.GROUPED_SOFTMAX else -mx.inf, choice)


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hugging Face names each expert's matrices (`mlp.experts.E.gate_proj.weight`); the engine holds them stacked
    by projection (`mlp.switch_mlp.gate_proj.weight`, [experts, out, in]). MLX-format checkpoints are stacked
    already and pass through."""
    stacked: dict[str, dict[int, mx.array]] = {}
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        place = stacked_name(name)
        if place is None:
            out[name] = array
        else:
            stacked.setdefault(place[0], {})[place[1]] = array
    for name, by_expert in stacked.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{name}: the checkpoint lacks some experts ({len(by_expert)} found)")
        out[name] = mx.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def stacked_name(name: str) -> tuple[str, int] | None:
    """(the stack's name, the expert's index) of one expert's tensor or module path (`...mlp.experts.E.up_proj`
    -> `...mlp.switch_mlp.up_proj`), else None."""
    module, dot, rest = name.partition(".experts.")
    expert, _, tail = rest.partition(".")
    if dot and expert.isdigit() and tail.split(".")[0] in EXPERT_PROJECTIONS:
        return f"{module}.switch_mlp.{tail}", int(expert)
    return None
