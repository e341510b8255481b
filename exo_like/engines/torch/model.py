"""One shard of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in plain PyTorch.

The shard holds only its own parts: the token embedding if it is the first stage, its layer range, and the
final norm + LM head if it is the last. Numerics follow Hugging Face transformers operation by operation
(RMSNorm in float32, rotate-half rotary embeddings, SwiGLU), so float32 greedy decoding matches it exactly.

For speed at batch 1, where decoding streams every weight once per token: q/k/v and gate/up are each fused
into one matrix at load time, keys and values live in one preallocated pool, rotary cos/sin come from a
table, layers call their parts' forward directly, and on CPU each product runs on the kernel measured fastest
for it (see Linear, PACK_BATCH, native_matvec). None of this changes float32 results beyond summation order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from exo_like.engines.batch import BatchLayout, ItemLayout
from exo_like.engines.torch.quant import CastEmbedding, Matrix, QuantEmbedding, QuantLinear, stack_rows
from exo_like.engines.work import BLOCK_SIZE
from exo_like.models.config import ModelArgs, rope_inv_freq

ROPE_CHUNK = 4096  # rotary table rows added per growth step


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


class RotaryTable:
    """cos/sin rows per position, built once from `rope_inv_freq` and extended in chunks when needed.

    The sin table carries rotate-half's sign (-sin on the first half), so rotation is `x*cos + swap(x)*sin`
    with swap = exchange of halves: bit-identical to `x*cos + rotate_half(x)*sin`.
    """

    def __init__(self, args: ModelArgs, device: torch.device, dtype: torch.dtype):
        self.inv_freq = torch.from_numpy(rope_inv_freq(args)).to(device)
        self.dtype = dtype
        self.cos = torch.empty(0, args.head_dim, device=device, dtype=dtype)
        self.sin = torch.empty_like(self.cos)

    def _extend(self, length: int) -> None:
        length = math.ceil(length / ROPE_CHUNK) * ROPE_CHUNK
        positions = torch.arange(length, device=self.inv_freq.device).float()
        freqs = positions[:, None] * self.inv_freq  # float32, as transformers computes it
        emb = torch.cat((freqs, freqs), dim=-1)
        half = freqs.shape[-1]
        sin = emb.sin()
        sin[:, :half].neg_()
        self.cos, self.sin = emb.cos().to(self.dtype), sin.to(self.dtype)

    def get(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each row's position, shaped [rows, 1, head_dim] to broadcast over heads."""
        highest = int(positions.max()) + 1
        if highest > self.cos.shape[0]:
            self._extend(highest)
        first = int(positions[0])
        if positions.shape[0] == 1 or bool(np.all(np.diff(positions) == 1)):  # one run (one request): a view
            return self.cos[first:highest, None], self.sin[first:highest, None]
        index = torch.from_numpy(positions).to(self.cos.device)
        return self.cos[index, None], self.sin[index, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # roll by half a head exchanges the halves: the same values as cat((x[half:], x[:half])) in one op.
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


class KVPool:
    """Keys and values of every request on this stage, for every layer of the shard: [layers, kv_heads, slots,
    head_dim], slots = blocks * BLOCK_SIZE (see engines/batch.py for which slot holds what).

    Allocated with `torch.empty`: memory pages are only taken as blocks are first written, and the first stage
    hands out the lowest free block ids first, so resident memory follows use rather than the budget."""

    def __init__(self, args: ModelArgs, n_layers: int, n_blocks: int, device: torch.device, dtype: torch.dtype):
        shape = (n_layers, args.num_key_value_heads, n_blocks * BLOCK_SIZE, args.head_dim)
        self.n_blocks = n_blocks
        self.keys = torch.empty(shape, device=device, dtype=dtype)
        self.values = torch.empty(shape, device=device, dtype=dtype)

    @staticmethod
    def block_bytes(args: ModelArgs, n_layers: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * args.num_key_value_heads * BLOCK_SIZE * args.head_dim * dtype.itemsize


@dataclass(frozen=True)
class DecodeGroup:
    """Several requests' single new positions, attended to in one call: each request's keys are gathered into
    a row padded to the longest, and a mask hides the padding. One gather and one sdpa per layer instead of one
    each per request: at 8 requests of ~100 positions, 0.2 ms per layer instead of 0.3."""

    rows: torch.Tensor  # [B] the requests' rows in the batch
    first_row: int | None  # when those rows are [first_row, first_row + B), as the scheduler puts decode first
    slots: torch.Tensor  # [B * longest] pool slots to gather (padding repeats a slot of the same request)
    mask: torch.Tensor  # [B, 1, 1, longest] True where a position is the request's own

    @classmethod
    def build(cls, items: list[ItemLayout], device: torch.device) -> "DecodeGroup":
        longest = max(item.end for item in items)
        slots = np.empty((len(items), longest), dtype=np.int64)
        mask = np.zeros((len(items), 1, 1, longest), dtype=bool)
        for i, item in enumerate(items):
            slots[i, :item.end] = item.slots if item.base is None else np.arange(item.base, item.base + item.end)
            slots[i, item.end:] = slots[i, 0]
            mask[i, ..., :item.end] = True
        rows = np.array([item.row_start for item in items], dtype=np.int64)
        first = int(rows[0]) if np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))) else None
        return cls(torch.from_numpy(rows).to(device), first, torch.from_numpy(slots.reshape(-1)).to(device),
                   torch.from_numpy(mask).to(device))


# Above this many positions a request attends to its own slots (a view of the pool when they are consecutive)
# rather than to a padded gather: the copy costs more than the calls it saves (measured: 8 requests of 1,000
# positions take 2.8 ms per layer gathered and padded, 1.2 ms one by one from views).
DECODE_GROUP_MAX_POSITIONS = 512


@dataclass(frozen=True)
class StepIndex:
    """A BatchLayout as tensors on the engine's device, built once per step and shared by every layer."""

    layout: BatchLayout
    write_slots: torch.Tensor
    singles: tuple[tuple[ItemLayout, torch.Tensor | None, torch.Tensor | None], ...]  # (item, gather, causal mask)
    decode: DecodeGroup | None  # the single-position items attended to together, if several

    @classmethod
    def build(cls, layout: BatchLayout, device: torch.device) -> "StepIndex":
        decoding = [item for item in layout.items if item.count == 1 and item.end <= DECODE_GROUP_MAX_POSITIONS]
        group = DecodeGroup.build(decoding, device) if len(decoding) > 1 else None
        grouped = {id(item) for item in decoding} if group is not None else set()
        singles = tuple((item, None if item.base is not None else torch.from_numpy(item.slots).to(device),
                         causal_mask(item.start, item.count, device) if item.start else None)
                        for item in layout.items if id(item) not in grouped)
        return cls(layout, torch.from_numpy(layout.write_slots).to(device), singles, group)


def causal_mask(offset: int, length: int, device: torch.device) -> torch.Tensor | None:
    """Boolean [length, offset + length] mask for new positions after `offset` cached ones; None for one token.

    sdpa's `is_causal` aligns the triangle top-left, which is only right without a cache, so with a cache the
    triangle is shifted right by the cached length.
    """
    if length == 1:
        return None
    return torch.ones(length, offset + length, dtype=torch.bool, device=device).tril(diagonal=offset)


class Linear(nn.Linear):
    """nn.Linear that can run on oneDNN where that is the fastest CPU kernel (chosen in ShardModel.prepare).

    packed: the weight is stored in oneDNN's blocked layout, which every product then uses.
    onednn: a plain weight, every product through oneDNN (float32: faster than F.linear's GEMM at any row count).
    Measured on this project's 2-core CPU, whole SmolLM2-135M shape, float32: F.linear 41 ms per step for one row,
    46 ms for 8; oneDNN with weights packed for a batch of 16, 24 ms for one row and for 8 alike.
    """

    onednn = False
    packed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed or self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor (a packed one is opaque: no slicing or reading)."""
        return self.weight.to_dense() if self.packed else self.weight


# Entries kept by each of oneDNN's two caches of compiled products (ideep's, then oneDNN's own). An entry serves
# one weight shape at one row count; a step with a row count not seen before compiles new ones (milliseconds), and
# at the libraries' default of 1,024 entries each, a serving node's many prefill chunk lengths grow its memory by
# hundreds of MB (bench/bench_onednn_cache.py shows it). Decode steps' few row counts stay cached.
ONEDNN_CACHE_ENTRIES = 64


def bound_onednn_caches() -> None:
    """Cap both caches unless the user set them; the libraries read these on their first product, so call it
    before the first (the engine does, when created). LRU_CACHE_CAPACITY is ideep's variable, in PyTorch."""
    for variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(variable, str(ONEDNN_CACHE_ENTRIES))


# oneDNN's batch-size hint for its packed weight layout, by dtype: the one measured fastest over 1 to 64 rows here
# (float32: packed for 16 rows is as fast for one row as for 8; bfloat16: packed for one row).
PACK_BATCH = {torch.float32: 16, torch.bfloat16: 1}


def onednn_usable(weight: torch.Tensor, pack_batch: int | None) -> bool:
    """Whether this build runs oneDNN's linear (a private op, as used by torch.compile) correctly on CPU for this
    weight's dtype, with a plain weight (pack_batch None) or one packed for that batch size."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.ones(2, 32, dtype=weight.dtype), torch.ones(16, 32, dtype=weight.dtype)
        kernel_weight = w if pack_batch is None else torch.ops.mkldnn._reorder_linear_weight(w, pack_batch)
        out = torch.ops.mkldnn._linear_pointwise(x, kernel_weight, None, "none", [], "")
        return torch.equal(out, F.linear(x, w))
    except (AttributeError, RuntimeError, TypeError):  # a private op: any other build may lack or change it
        return False


@contextmanager
def native_matvec(enabled: bool) -> Iterator[None]:
    """For bfloat16 on CPU, PyTorch's own matrix-vector kernel streams a plain weight about twice as fast as
    the oneDNN one F.linear picks by default; turning oneDNN off for a single-row product selects it (the LM
    head, and every layer if packing is unavailable). Same results: float32 accumulation, one rounding."""
    if not enabled:
        yield
        return
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        # One fused projection: rows are q, then k, then v (concatenated at load).
        self.qkv_proj = Linear(args.hidden_size, qkv_out, bias=args.qkv_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.o_bias)
        self.qk_norm = QKNorm(self.head_dim, self.n_heads, args.rms_norm_eps) if args.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                values: torch.Tensor, index: StepIndex) -> torch.Tensor:
        """x: the batch's rows [R, H]; keys/values: this layer's pool [kv_heads, slots, D]."""
        rows = x.shape[0]
        qkv = self.qkv_proj.forward(x).view(rows, -1, self.head_dim)
        qk = qkv[:, : self.n_heads + self.n_kv_heads]
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        qk = rotate(qk, *rope)
        # Every row's new key and value go to its slot in the pool, in place, before any row attends.
        keys.index_copy_(1, index.write_slots, qk[:, self.n_heads :].transpose(0, 1))
        values.index_copy_(1, index.write_slots, qkv[:, self.n_heads + self.n_kv_heads :].transpose(0, 1))
        queries = qk[:, : self.n_heads]  # [R, heads, D]
        if index.decode is None and len(index.singles) == 1:  # one request: no assembling
            out = self._attend_one(queries, keys, values, *index.singles[0])
        else:
            out = queries.new_empty(queries.shape)
            for item, gather, mask in index.singles:
                out[item.row_start : item.row_end] = self._attend_one(
                    queries[item.row_start : item.row_end], keys, values, item, gather, mask)
            if index.decode is not None:
                self._attend_decode(queries, keys, values, index.decode, out)
        return self.o_proj.forward(out.reshape(rows, -1))

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, item: ItemLayout,
                    gather: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """One request's rows q [T, heads, D] against its positions [0, end) -> [T, heads, D]."""
        if gather is None:  # the item's positions are consecutive slots: attend to a view of the pool
            k = keys[:, item.base : item.base + item.end]
            v = values[:, item.base : item.base + item.end]
        else:
            k, v = keys.index_select(1, gather), values.index_select(1, gather)
        return self._attend(q.transpose(0, 1), k, v, mask, item.start).transpose(0, 1)

    def _attend_decode(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: DecodeGroup,
                       out: torch.Tensor) -> None:
        """Several requests' one new row each, in one sdpa call over their padded positions, into `out`."""
        count = group.mask.shape[0]
        q = queries[group.first_row : group.first_row + count] if group.first_row is not None else \
            queries.index_select(0, group.rows)
        q = q.reshape(count, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)
        k = keys.index_select(1, group.slots).view(self.n_kv_heads, count, -1, self.head_dim).transpose(0, 1)
        v = values.index_select(1, group.slots).view(self.n_kv_heads, count, -1, self.head_dim).transpose(0, 1)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=self.scale)
        attended = attended.reshape(count, self.n_heads, self.head_dim)
        if group.first_row is not None:
            out[group.first_row : group.first_row + count] = attended
        else:
            out.index_copy_(0, group.rows, attended)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, offset: int
    ) -> torch.Tensor:
        """q [heads, T, D] against k, v [kv_heads, L, D] -> [heads, T, D].

        Inputs get a leading batch dim: with 4-D tensors sdpa picks its fused CPU kernel, 3-D ones fall back
        to the unfused math path (2-4x slower here).
        """
        if q.shape[1] == 1:
            # One query per head: group the heads sharing a kv head as that head's "queries" (no kv repeat).
            group = self.n_heads // self.n_kv_heads
            q = q.reshape(1, self.n_kv_heads, group, -1)
            out = F.scaled_dot_product_attention(q, k[None], v[None], scale=self.scale)
            return out.reshape(self.n_heads, 1, -1)
        out = F.scaled_dot_product_attention(
            q[None],
            k[None],
            v[None],
            attn_mask=mask,
            is_causal=mask is None and offset == 0,
            scale=self.scale,
            enable_gqa=self.n_heads != self.n_kv_heads,
        )
        return out[0]


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hidden = args.intermediate_size
        # One fused projection: gate rows, then up rows.
        self.gate_up_proj = Linear(args.hidden_size, 2 * self.hidden, bias=args.mlp_bias)
        self.down_proj = Linear(self.hidden, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        return self.down_proj.forward(F.silu(gate_up[:, : self.hidden]) * gate_up[:, self.hidden :])


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                values: torch.Tensor, index: StepIndex) -> torch.Tensor:
        h = x + self.self_attn.forward(self.input_layernorm.forward(x), rope, keys, values, index)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class ShardModel(nn.Module):
    """Layers [start, end) of the model; embedding if first, final norm + LM head if last."""

    def __init__(self, args: ModelArgs, n_layers: int, is_first: bool, is_last: bool):
        super().__init__()
        self.args = args
        self.is_first, self.is_last = is_first, is_last
        # Given a weight, nn.Embedding skips its random init, which on the meta device imports torch._dynamo
        # (and sympy): tens of MB of resident memory for nothing.
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size)) if is_first else None
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(n_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if is_last else None
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False) if is_last else None
        self.rope: RotaryTable | None = None
        self.native_matvec = False

    def prepare(self) -> None:
        """After loading weights: tie the head to the embedding, pick weight layouts, build the rotary table."""
        if isinstance(self.lm_head, Linear) and isinstance(self.embed_tokens, nn.Embedding) and \
                self.args.tie_word_embeddings:
            # One tensor when the shard holds both the embedding and the tied LM head (quantized ones share packs).
            self.lm_head.weight = self.embed_tokens.weight
        weight = self.norm_weight
        pack_batch = PACK_BATCH.get(weight.dtype)
        pack = pack_batch is not None and onednn_usable(weight, pack_batch)
        # bfloat16 plain weights (the LM head) go faster through F.linear: natively for one row, see native_matvec.
        onednn = weight.dtype == torch.float32 and onednn_usable(weight, None)
        for module in self.modules():
            if not isinstance(module, Linear):
                continue
            module.onednn = onednn
            # The LM head stays plain: it may be the embedding matrix too, whose rows are looked up.
            if pack and module is not self.lm_head:
                packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.data, pack_batch)
                module.weight, module.packed = nn.Parameter(packed, requires_grad=False), True
        self.native_matvec = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        self.rope = RotaryTable(self.args, weight.device, weight.dtype)

    @property
    def norm_weight(self) -> torch.Tensor:
        """A float weight every shard holds, in the shard's device and dtype (matrices may be quantized)."""
        return self.layers[0].input_layernorm.weight

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the shard holds, each once (a tied head shares the embedding's)."""
        held = {id(t): t for t in self.parameters()}
        for module in self.modules():
            if isinstance(module, (QuantLinear, QuantEmbedding, CastEmbedding)):
                held.update((id(t), t) for t in module.tensors())
        return list(held.values())

    def new_pool(self, n_blocks: int) -> KVPool:
        weight = self.norm_weight
        return KVPool(self.args, len(self.layers), n_blocks, weight.device, weight.dtype)

    def forward(self, inputs: torch.Tensor, pool: KVPool, index: StepIndex) -> torch.Tensor:
        """One step over a batch. inputs: token ids [R] (first shard) or hidden states [R, H]. Returns hidden
        states [R, H], or on the last shard the logits [S, vocab] of the batch's sampled rows."""
        h = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs
        rope = self.rope.get(index.layout.positions)
        with native_matvec(self.native_matvec and h.shape[0] == 1):
            # Layers call their parts through .forward, not nn.Module's call machinery: that machinery (hook
            # checks, for hooks this model never has) runs ~9 times per layer, a noticeable share of a small
            # model's decode step (see bench/bench_vs_llamacpp.py).
            for i, layer in enumerate(self.layers):
                h = layer.forward(h, rope, pool.keys[i], pool.values[i], index)
        if self.lm_head is None:
            return h
        sampled = torch.from_numpy(index.layout.sample_rows).to(h.device)
        # Only the sampled rows' logits are needed: with one request, a matrix-vector product.
        with native_matvec(self.native_matvec and sampled.shape[0] == 1):
            return self.lm_head(self.norm(h.index_select(0, sampled)))


def fuse_checkpoint_weights(
    weights: dict[str, Matrix], args: ModelArgs, is_first: bool, is_last: bool
) -> dict[str, Matrix | list[Matrix]]:
    """Turn a shard's checkpoint tensors (local layer names) into this module's state dict.

    Concatenates q/k/v and gate/up (and their biases; quantized matrices stay AffineGroups, see
    torch_quant.stack_rows), drops the `model.`
    prefix, and maps a tied embedding on a non-first last shard to the LM head. Consumes `weights`.
    """
    state: dict[str, torch.Tensor] = {}
    fusions = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }
    layer_ids = sorted({int(name.split(".")[2]) for name in weights if name.startswith("model.layers.")})
    for i in layer_ids:
        prefix = f"model.layers.{i}."
        for fused, parts in fusions.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{part}.{kind}" for part in parts]
                if names[0] in weights:
                    state[f"layers.{i}.{fused}.{kind}"] = stack_rows([weights.pop(n) for n in names])
        for norm in ("q_norm", "k_norm"):
            if f"{prefix}self_attn.{norm}.weight" in weights:
                state[f"layers.{i}.self_attn.qk_norm.{norm}.weight"] = weights.pop(f"{prefix}self_attn.{norm}.weight")
    if args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # transformers ignores a stored copy when tied; so do we
        if is_last:
            embedding = weights["model.embed_tokens.weight"] if is_first else weights.pop("model.embed_tokens.weight")
            state["lm_head.weight"] = embedding  # made the very same parameter by ShardModel.prepare
    for name, tensor in weights.items():
        state[name.removeprefix("model.")] = tensor
    return state


def load_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Assign the state's tensors to a model built on the meta device; every tensor it holds must be given
    (quantized modules were put in already, with their own tensors) and no other."""
    result = model.load_state_dict(state, strict=False, assign=True)
    left = [name for name, t in model.named_parameters() if t.is_meta] + list(result.unexpected_keys)
    if left:
        raise ValueError(f"checkpoint and model disagree on {', '.join(left[:5])}")
