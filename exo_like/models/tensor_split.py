"""How a tensor-parallel group splits a model's layers (Megatron's split): which attention heads and which MLP units
each rank holds, the ModelArgs of one rank's slice, which rows or columns of each checkpoint tensor it keeps, and
which models cannot be split over a group of a given size (and why).

Per layer, q/k/v and gate/up are split by output (column-parallel: whole heads, whole MLP units), o_proj and
down_proj by input (row-parallel): each rank's o_proj and down_proj give a partial sum of the layer's output, and
the group adds them (an all-reduce) before the residual. Norms, routers and q/k norms are replicated; a
row-parallel bias is held by rank 0 only, so the sum adds it once. A mixture of experts splits every expert's
(and the shared expert's) intermediate dimension, as mlx-lm and exo do: the replicated router picks the same
experts on every rank, each rank runs its slice of them, one all-reduce sums routed and shared outputs.

Latent attention (DeepSeek) splits by head too: each rank's rows of the query projection (q_proj or q_b_proj),
its heads' per-head projections (embed_q, unembed_out) and its columns of o_proj; the latent projections
(q_a_proj, kv_a_proj_with_mqa) and their norms are replicated, and so is the latent cache: one latent a position
serves every head, so each rank computes and holds the same (rank + rope) values, a few per cent of a layer's
work, where splitting it would cost an all-gather a layer.

Heads go in whole key/value groups (the query heads sharing one KV head), as evenly as the group count allows;
with more ranks than KV heads, each KV head is replicated on consecutive ranks, which split its query heads (as
vLLM does), so a 3-node group serves a model with 2 KV heads. Uneven counts split unevenly: the slowest rank's
share sets the step time, which the planner counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypeVar

from exo_like.models.config import ModelArgs
from exo_like.models.families.deepseek import PER_HEAD

T = TypeVar("T")


@dataclass(frozen=True)
class TensorSplit:
    """Rank `rank` of a tensor-parallel group of `size` ranks. Rank 0 (the leader) also holds what is not split:
    the embedding, the final norm and the LM head of its stage, and the row-parallel biases. `align`: every
    row-parallel split falls on a multiple of it (a quantized checkpoint's group of inputs, see split_align)."""

    rank: int
    size: int
    align: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or self.size < 2:
            raise ValueError(f"rank {self.rank} of a group of {self.size}: need 0 <= rank < size and size >= 2")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def __str__(self) -> str:
        return f"tp {self.rank}/{self.size}"


@dataclass(frozen=True)
class RankSlice:
    """What one rank holds of every layer: query heads [q_start, q_end), KV heads [kv_start, kv_end), and of
    each MLP the units [unit_start, unit_end) of `units` (the dense MLP's intermediate_size), likewise of each
    expert and of the shared expert."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    mlp: tuple[int, int]
    expert: tuple[int, int] | None
    shared_expert: tuple[int, int] | None


# Inputs per quantization group that every quantized checkpoint's groups divide (GGUF's K-quants become groups of
# 16 or 32 inputs, Q4_0 and Q8_0 have 32; MLX-format ones say their own, 32 to 128).
GGUF_GROUP = 32


def split_align(group_size: int | None) -> int:
    """The alignment of row-parallel splits for a checkpoint quantized in groups of `group_size` inputs (None: a
    float checkpoint, 1; GGUF's quantized types: GGUF_GROUP). The same on every rank: the checkpoint's, whatever
    form a node holds it in."""
    return 1 if group_size is None else max(GGUF_GROUP, group_size)


def even_parts(total: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[start, end) of `parts` consecutive ranges covering [0, total), sizes differing by at most one (the first
    ones larger)."""
    if align > 1:
        return [(a * align, b * align) for a, b in even_parts(total // align, parts)]
    return _even(total, parts)


def _even(total: int, parts: int) -> list[tuple[int, int]]:
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + total // parts + (1 if part < total % parts else 0))
    return list(zip(bounds, bounds[1:]))


def head_ranges(n_heads: int, n_kv_heads: int, size: int) -> list[tuple[int, int, int, int]]:
    """(q_start, q_end, kv_start, kv_end) per rank; see the module's docstring. Assumes split_refusal passed."""
    per_group = n_heads // n_kv_heads
    if size <= n_kv_heads:
        return [(a * per_group, b * per_group, a, b) for a, b in even_parts(n_kv_heads, size)]
    ranges = []
    for kv_head, (first_rank, end_rank) in enumerate(even_parts(size, n_kv_heads)):
        for a, b in even_parts(per_group, end_rank - first_rank):
            ranges.append((kv_head * per_group + a, kv_head * per_group + b, kv_head, kv_head + 1))
    return ranges


def split_refusal(args: ModelArgs, size: int, align: int = 1) -> str | None:
    """Why the model's layers cannot be split over `size` ranks (row-parallel splits on multiples of `align`), or
    None if they can."""
    if size < 2:
        return "a tensor-parallel group has at least 2 ranks"
    heads = args.num_attention_heads
    if heads < size:
        return f"{heads} attention heads cannot be split over {size} ranks"
    # (With no more ranks than heads, a KV head shared by several ranks always has a query head for each.)
    widths = [args.intermediate_size] if args.moe is None or len(args.moe.sparse_layers) < args.num_hidden_layers \
        else []
    if args.moe is not None:
        widths += [args.moe.expert_size] + ([args.moe.shared_expert_size] if args.moe.shared_expert_size else [])
    if min(widths) < size * align:
        return f"an MLP {min(widths)} units wide cannot be split over {size} ranks"
    if align > 1:
        odd = [w for w in widths if w % align]
        if odd:
            return f"an MLP {odd[0]} units wide does not split on quantization groups of {align}"
        width = _head_widths(args)[1]
        bounds = {q * width for _, q, _, _ in head_ranges(heads, args.num_key_value_heads, size)}
        if any(b % align for b in bounds):
            return f"heads of {width} values do not split on quantization groups of {align} over {size} ranks"
    return None


MAX_GROUP = 8  # the largest tensor-parallel group planned: beyond that, the all-reduces outweigh the split


def group_sizes(args: ModelArgs, align: int = 1) -> tuple[int, ...]:
    """The group sizes the model's layers split over."""
    return tuple(size for size in range(2, MAX_GROUP + 1) if split_refusal(args, size, align) is None)


def rank_slice(args: ModelArgs, split: TensorSplit) -> RankSlice:
    refusal = split_refusal(args, split.size, split.align)
    if refusal is not None:
        raise ValueError(f"{args.model_type} over {split.size} ranks: {refusal}")
    q_start, q_end, kv_start, kv_end = head_ranges(args.num_attention_heads, args.num_key_value_heads,
                                                   split.size)[split.rank]
    moe, size, align = args.moe, split.size, split.align
    return RankSlice(
        q_start, q_end, kv_start, kv_end,
        mlp=even_parts(args.intermediate_size, size, align)[split.rank],
        expert=None if moe is None else even_parts(moe.expert_size, size, align)[split.rank],
        shared_expert=None if moe is None or not moe.shared_expert_size else
        even_parts(moe.shared_expert_size, size, align)[split.rank])


def rank_args(args: ModelArgs, split: TensorSplit) -> ModelArgs:
    """The ModelArgs one rank's layers are built from: its heads, KV heads and MLP widths; all else the same."""
    part = rank_slice(args, split)
    moe = args.moe
    if moe is not None:
        moe = replace(moe, expert_size=_width(part.expert),
                      shared_expert_size=0 if part.shared_expert is None else _width(part.shared_expert))
    return replace(args, num_attention_heads=part.q_end - part.q_start,
                   num_key_value_heads=part.kv_end - part.kv_start, intermediate_size=_width(part.mlp), moe=moe)


def _width(bounds: tuple[int, int] | None) -> int:
    assert bounds is not None
    return bounds[1] - bounds[0]


# How each layer tensor is split, by its name's last two parts (shared names, after a family's renames and
# conversion): "out" keeps the rank's output rows (column-parallel), "in" its input columns (row-parallel), "bias"
# a row-parallel bias, kept by rank 0 only. Anything else is replicated.
_ATTENTION = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "o_proj": "o", "sinks": "q", "q_b_proj": "q",
              **{name: "heads" for name in PER_HEAD}}
_MLP = {"gate_proj": "out", "up_proj": "out", "down_proj": "in"}


def split_tensor(name: str, tensor: T, args: ModelArgs, split: TensorSplit) -> T:
    """The rank's part of layer tensor `name` (`model.layers.N.` + shared name; torch, numpy or MLX arrays, any
    of them stacked by expert in front); a row-parallel bias is zeros on ranks other than 0 (the group's sum adds
    it once). Tensors outside the layers, norms and routers come back whole."""
    part = rank_slice(args, split)
    q_width, o_width = _head_widths(args)
    module, _, leaf = name.rpartition(".")
    owner, _, projection = module.rpartition(".")
    if leaf == "sinks":  # gpt-oss: one logit per query head
        return _take(tensor, -1, part.q_start, part.q_end)
    if projection in _ATTENTION and owner.endswith(".self_attn"):
        kind = _ATTENTION[projection]
        if kind == "heads":  # [heads, out, in], or a quantized row stack [heads x out, in] (and its scales)
            if len(tensor.shape) == 3:
                return _take_heads(tensor, part.q_start, part.q_end)
            each = tensor.shape[0] // args.num_attention_heads
            return _take(tensor, -2, part.q_start * each, part.q_end * each)
        if kind == "o":
            return _leader_only(tensor, split) if leaf == "bias" else \
                _take(tensor, -1, part.q_start * o_width, part.q_end * o_width)
        start, end = (part.q_start, part.q_end) if kind == "q" else (part.kv_start, part.kv_end)
        return _take(tensor, -1 if leaf == "bias" else -2, start * q_width, end * q_width)
    if projection not in _MLP or ".mlp." not in f"{name}.":
        return tensor
    units = _mlp_units(owner, part)
    if _MLP[projection] == "in":
        return _leader_only(tensor, split) if leaf == "bias" else _take(tensor, -1, *units)
    return _take(tensor, -1 if leaf == "bias" else -2, *units)


def unfused(weights: dict[str, T], args: ModelArgs) -> dict[str, T]:
    """Fused projections as checkpoints store them (Phi-3's `qkv_proj`: query, key, value rows; `gate_up_proj`:
    gate rows, then up rows) as their parts, so that each part splits by its own rule. Consumes `weights`."""
    q_rows, kv_rows = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    segments = {"qkv_proj": (("q_proj", 0, q_rows), ("k_proj", q_rows, q_rows + kv_rows),
                             ("v_proj", q_rows + kv_rows, q_rows + 2 * kv_rows))}
    for name in [n for n in weights if n.rpartition(".")[0].endswith((".qkv_proj", ".gate_up_proj"))]:
        module, _, leaf = name.rpartition(".")
        owner, _, fused = module.rpartition(".")
        tensor = weights.pop(name)
        rows = tensor.shape[-1 if leaf == "bias" else -2]
        parts = segments.get(fused) or (("gate_proj", 0, rows // 2), ("up_proj", rows // 2, rows))
        for part, start, end in parts:
            weights[f"{owner}.{part}.{leaf}"] = _take(tensor, -1 if leaf == "bias" else -2, start, end)
    return weights


def _head_widths(args: ModelArgs) -> tuple[int, int]:
    """Values a head takes of the query projection's outputs and of o_proj's inputs."""
    mla = args.mla
    return (args.head_dim, args.head_dim) if mla is None else (mla.qk_head_dim, mla.v_head_dim)


def _take_heads(tensor: Any, start: int, end: int) -> Any:
    """Heads [start, end) of a per-head stack [heads, out, in], a contiguous copy."""
    return _own_copy(tensor[start:end])


def _mlp_units(owner: str, part: RankSlice) -> tuple[int, int]:
    """The units this rank holds of the MLP named `owner` (a dense MLP, an expert, a stack of experts, a shared
    expert)."""
    if owner.endswith(".shared_expert"):
        assert part.shared_expert is not None
        return part.shared_expert
    if ".experts." in f"{owner}." or owner.endswith(".switch_mlp"):
        assert part.expert is not None
        return part.expert
    return part.mlp


def _leader_only(tensor: T, split: TensorSplit) -> T:
    return tensor if split.is_leader else tensor * 0


def _take(tensor: Any, axis: int, start: int, end: int) -> Any:
    """tensor[..., start:end] along `axis` (-1 or -2), a contiguous copy (a view would keep the whole alive);
    a quantized matrix (AffineGroups) by whole groups of inputs."""
    if hasattr(tensor, "take_inputs"):
        return tensor.take_rows(start, end) if axis == -2 else tensor.take_inputs(start, end)
    index = (Ellipsis, slice(start, end)) if axis == -1 else (Ellipsis, slice(start, end), slice(None))
    return _own_copy(tensor[index])


def _own_copy(part: Any) -> Any:
    """A slice as a contiguous copy of its own (a view would keep the whole alive): torch, then numpy; MLX slices
    (and quantized slices) are copies already."""
    for copy in ("contiguous", "copy"):
        if hasattr(part, copy):
            return getattr(part, copy)()
    return part
