"""Attention over the paged KV pool: rotary tables, the pool, a step's index of who attends to which slots, and the
attention layer (fused q/k/v projection, GQA, one sdpa call per request or one for all single-row decodes)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from exo_like.engines.batch import BatchLayout, ItemLayout
from exo_like.engines.batch import layout as batch_layout
from exo_like.engines.torch.linear import Linear
from exo_like.engines.torch.norm import QKNorm
from exo_like.engines.work import BLOCK_SIZE, WorkItem, window_start
from exo_like.models.config import ModelArgs, rope_attention_factor, rope_inv_freq

ROPE_CHUNK = 4096  # rotary table rows added per growth step


class RotaryTable:
    """cos/sin rows per position, built once from `rope_inv_freq` and extended in chunks when needed.

    The sin table carries rotate-half's sign (-sin on the first half), so rotation is `x*cos + swap(x)*sin`
    with swap = exchange of halves: bit-identical to `x*cos + rotate_half(x)*sin`. YaRN's attention factor
    multiplies both tables, as transformers does.
    """

    def __init__(self, args: ModelArgs, device: torch.device, dtype: torch.dtype):
        self.inv_freq = torch.from_numpy(rope_inv_freq(args)).to(device)
        self.factor = rope_attention_factor(args)
        self.dtype = dtype
        self.cos = torch.empty(0, args.head_dim, device=device, dtype=dtype)
        self.sin = torch.empty_like(self.cos)

    def _extend(self, length: int) -> None:
        length = math.ceil(length / ROPE_CHUNK) * ROPE_CHUNK
        positions = torch.arange(length, device=self.inv_freq.device).float()
        freqs = positions[:, None] * self.inv_freq  # float32, as transformers computes it
        emb = torch.cat((freqs, freqs), dim=-1)
        half = freqs.shape[-1]
        cos, sin = emb.cos(), emb.sin()
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        sin[:, :half].neg_()
        self.cos, self.sin = cos.to(self.dtype), sin.to(self.dtype)

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

    def extend(self, length: int) -> None:
        """Rows for positions [0, length) at least (a CUDA graph keeps the tables it read: made long enough once)."""
        if length > self.cos.shape[0]:
            self._extend(length)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions given on the device (within the extended length), [rows, 1, head_dim]."""
        return self.cos[positions, None], self.sin[positions, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # roll by half a head exchanges the halves: the same values as cat((x[half:], x[:half])) in one op.
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


class KVPool:
    """Keys and values of every request on this stage, for every layer of the shard, [kv_heads, slots, width] a
    layer (ModelArgs.kv_layout: MLA caches one latent key a position and no values), slots = blocks * BLOCK_SIZE
    (see engines/batch.py for which slot holds what). Layers attending to every position share one tensor of
    `n_blocks` blocks, sliding-window layers another of `n_window_blocks`: a request keeps only its window's
    blocks there.

    Allocated with `torch.empty`: memory pages are only taken as blocks are first written, and the first stage
    hands out the lowest free block ids first, so resident memory follows use rather than the budget."""

    def __init__(self, args: ModelArgs, layers: Sequence[int], n_blocks: int, n_window_blocks: int,
                 device: torch.device, dtype: torch.dtype, spare: int = 0):
        """spare: blocks past the n_blocks the scheduler hands out, in the full-attention layers' tensors, that no
        request holds (decode graphs' padding rows write there: cuda/graphs.py)."""
        windowed = [args.window(layer) is not None for layer in layers]
        self.n_blocks, self.n_window_blocks = n_blocks, n_window_blocks if any(windowed) else None
        self.spare = spare
        # Layer i's tensors: (group, row) with group 0 full attention, 1 sliding window.
        self._rows = [(int(w), sum(windowed[:i]) if w else i - sum(windowed[:i])) for i, w in enumerate(windowed)]
        counts = (len(layers) - sum(windowed), sum(windowed))
        heads, key_width, value_width = args.kv_layout()
        self.keys, self.values = [], []
        for count, blocks in zip(counts, (n_blocks + spare, n_window_blocks)):
            shape = (count, heads, blocks * BLOCK_SIZE if count else 0)
            self.keys.append(torch.empty((*shape, key_width), device=device, dtype=dtype))
            self.values.append(torch.empty((*shape, value_width), device=device, dtype=dtype) if value_width else None)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Local layer i's keys and values (None: MLA, whose values are the latent keys)."""
        group, row = self._rows[i]
        values = self.values[group]
        return self.keys[group][row], None if values is None else values[row]

    def zero_(self) -> None:
        for tensor in (*self.keys, *self.values):
            if tensor is not None:
                tensor.zero_()

    @staticmethod
    def block_bytes(args: ModelArgs, layers: Sequence[int], dtype: torch.dtype) -> tuple[int, int]:
        """Bytes a block takes in the full-attention layers' pool and in the sliding-window layers' pool."""
        heads, key_width, value_width = args.kv_layout()
        per_layer = heads * BLOCK_SIZE * (key_width + value_width) * dtype.itemsize
        windowed = sum(args.window(layer) is not None for layer in layers)
        return (len(layers) - windowed) * per_layer, windowed * per_layer


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
    def build(cls, items: list[ItemLayout], device: torch.device, window: int | None) -> "DecodeGroup":
        """The group's positions: each request's whole range, or through a window its last `window`."""
        firsts = [0 if window is None else window_start(item.start, window) for item in items]
        longest = max(item.end - first for item, first in zip(items, firsts))
        slots = np.empty((len(items), longest), dtype=np.int64)
        mask = np.zeros((len(items), 1, 1, longest), dtype=bool)
        for i, (item, first) in enumerate(zip(items, firsts)):
            seen = item.end - first
            slots[i, :seen] = item_slots(item)[first - item.origin:]
            slots[i, seen:] = slots[i, 0]
            mask[i, ..., :seen] = True
        rows = np.array([item.row_start for item in items], dtype=np.int64)
        first = int(rows[0]) if np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))) else None
        return cls(torch.from_numpy(rows).to(device), first, torch.from_numpy(slots.reshape(-1)).to(device),
                   torch.from_numpy(mask).to(device))


def item_slots(item: ItemLayout) -> np.ndarray:
    """Slots of an item's positions [origin, end)."""
    return item.slots if item.base is None else np.arange(item.base, item.base + item.end - item.origin)


# Above this many positions a request attends to its own slots (a view of the pool when they are consecutive)
# rather than to a padded gather: the copy costs more than the calls it saves (measured: 8 requests of 1,000
# positions take 2.8 ms per layer gathered and padded, 1.2 ms one by one from views).
DECODE_GROUP_MAX_POSITIONS = 512


# One request's attention in a step: (item, first key position, slots to gather or None, mask or None).
Single = tuple[ItemLayout, int, "torch.Tensor | None", "torch.Tensor | None"]


@dataclass(frozen=True)
class StepIndex:
    """A BatchLayout as tensors on the engine's device, built once per step, on first use, and shared by every
    layer (a step the native decode step runs needs none of them); for the sliding-window layers, `windowed` is
    the same from their own pool's layout."""

    layout: BatchLayout
    device: torch.device
    window: int | None = None  # positions each row sees (the sliding-window layers' index), None: all
    windowed: "StepIndex | None" = None

    @classmethod
    def build(cls, layout: BatchLayout, device: torch.device, window_layout: BatchLayout | None = None,
              window: int | None = None) -> "StepIndex":
        """The index of the layers attending to every position, and with a `window_layout` the sliding-window
        layers' (`window` positions each) as `windowed`."""
        windowed = None if window_layout is None else cls(window_layout, device, window)
        return cls(layout, device, None, windowed)

    @cached_property
    def write_slots(self) -> torch.Tensor:
        return torch.from_numpy(self.layout.write_slots).to(self.device)

    @property
    def singles(self) -> tuple[Single, ...]:
        return self._attention[0]

    @property
    def decode(self) -> DecodeGroup | None:
        """The single-position items attended to together, if several."""
        return self._attention[1]

    @cached_property
    def _attention(self) -> tuple[tuple[Single, ...], DecodeGroup | None]:
        window, device = self.window, self.device

        def seen(item: ItemLayout) -> int:
            return item.end - (0 if window is None else window_start(item.start, window))
        decoding = [item for item in self.layout.items
                    if item.count == 1 and seen(item) <= DECODE_GROUP_MAX_POSITIONS]
        group = DecodeGroup.build(decoding, device, window) if len(decoding) > 1 else None
        grouped = {id(item) for item in decoding} if group is not None else set()
        return tuple(_single(item, window, device) for item in self.layout.items if id(item) not in grouped), group


def step_index(items: Sequence[WorkItem], pool: KVPool, args: ModelArgs, device: torch.device) -> StepIndex:
    """A step's index on a shard holding `pool`: the sliding-window layers' too when it has some."""
    layout = batch_layout(items, pool.n_blocks, args.context_length)
    if pool.n_window_blocks is None:
        return StepIndex.build(layout, device)
    window_layout = batch_layout(items, pool.n_window_blocks, args.context_length, args.kv_window)
    return StepIndex.build(layout, device, window_layout, args.kv_window)


def _single(item: ItemLayout, window: int | None, device: torch.device) -> Single:
    """One request's attention: its keys from the first its first row sees (a view or a gather), and the mask."""
    first = 0 if window is None else window_start(item.start, window)
    gather = None if item.base is not None else torch.from_numpy(item.slots[first - item.origin:]).to(device)
    if window is None:
        return item, first, gather, causal_mask(item.start, item.count, device) if item.start else None
    queries = torch.arange(item.start, item.end, device=device)[:, None]
    keys = torch.arange(first, item.end, device=device)[None, :]
    mask = (keys <= queries) & (keys > queries - window)
    return item, first, gather, None if bool(mask.all()) else mask  # (all: one row, seeing its whole window)


def causal_mask(offset: int, length: int, device: torch.device) -> torch.Tensor | None:
    """Boolean [length, offset + length] mask for new positions after `offset` cached ones; None for one token.

    sdpa's `is_causal` aligns the triangle top-left, which is only right without a cache, so with a cache the
    triangle is shifted right by the cached length.
    """
    if length == 1:
        return None
    return torch.ones(length, offset + length, dtype=torch.bool, device=device).tril(diagonal=offset)


class Attention(nn.Module):
    """Attention of absolute layer `layer`: its window (sliding-window layers) and the model's scale,
    soft-capping and sinks come from the config. Soft-capped or sunk scores take the explicit path (scores,
    softmax, values) that sdpa cannot express."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        # One fused projection: rows are q, then k, then v (concatenated at load).
        self.qkv_proj = Linear(args.hidden_size, qkv_out, bias=args.qkv_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.o_bias)
        self.qk_norm = QKNorm(self.head_dim, self.n_heads, args.rms_norm_eps, args.norm_offset) \
            if args.qk_norm else None
        self.scale = args.attn_scale or self.head_dim**-0.5
        self.rotary_dim = args.rope_dim
        self.window = args.window(layer)
        self.softcap = args.attn_softcap
        # gpt-oss: a logit per head that joins the softmax beside the scores and is dropped after it.
        self.sinks = nn.Parameter(torch.empty(self.n_heads), requires_grad=False) if args.attn_sinks else None
        self.explicit = self.softcap is not None or self.sinks is not None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                values: torch.Tensor, index: StepIndex) -> torch.Tensor:
        """x: the batch's rows [R, H]; keys/values: this layer's pool [kv_heads, slots, D]."""
        rows = x.shape[0]
        if self.window is not None:  # its own pool's slots
            index = index.windowed
        qkv = self.qkv_proj.forward(x).view(rows, -1, self.head_dim)
        qk = qkv[:, : self.n_heads + self.n_kv_heads]
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        if self.rotary_dim == self.head_dim:
            qk = rotate(qk, *rope)
        else:  # Phi-4-mini: only the leading dimensions rotate
            qk = torch.cat((rotate(qk[..., : self.rotary_dim], *rope), qk[..., self.rotary_dim :]), dim=-1)
        # Every row's new key and value go to its slot in the pool, in place, before any row attends.
        keys.index_copy_(1, index.write_slots, qk[:, self.n_heads :].transpose(0, 1))
        values.index_copy_(1, index.write_slots, qkv[:, self.n_heads + self.n_kv_heads :].transpose(0, 1))
        out = self.attend(qk[:, : self.n_heads], keys, values, index)
        return self.o_proj.forward(out.reshape(rows, -1))

    latent_values: int | None = None  # MLA: values are the keys' first this many values (no value pool)

    def attend(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None,
               index: StepIndex) -> torch.Tensor:
        """The rows' queries [R, heads, D] against this layer's pool (the rows' own keys and values written) ->
        [R, heads, Dv], Dv the values' width; `index` the one of this layer's pool (StepIndex.windowed for a
        sliding-window layer)."""
        if index.decode is None and len(index.singles) == 1:  # one request: no assembling
            return self._attend_one(queries, keys, values, *index.singles[0])
        width = self.latent_values or values.shape[-1]
        out = queries.new_empty((*queries.shape[:2], width))
        for item, first, gather, mask in index.singles:
            out[item.row_start : item.row_end] = self._attend_one(
                queries[item.row_start : item.row_end], keys, values, item, first, gather, mask)
        if index.decode is not None:
            self._attend_decode(queries, keys, values, index.decode, out)
        return out

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, item: ItemLayout, first: int,
                    gather: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """One request's rows q [T, heads, D] against its positions [first, end) -> [T, heads, D]."""
        if gather is None:  # the item's positions are consecutive slots: attend to a view of the pool
            start, end = item.base + first - item.origin, item.base + item.end - item.origin
            k = keys[:, start:end]
            v = None if values is None else values[:, start:end]
        else:
            k = keys.index_select(1, gather)
            v = None if values is None else values.index_select(1, gather)
        if v is None:  # MLA: a view of the gathered keys (gathering from a view of the pool would copy the pool)
            v = k[..., : self.latent_values]
        if self.explicit:
            return self._attend_explicit(q.transpose(0, 1), k, v, mask, item.start - first).transpose(0, 1)
        return self._attend(q.transpose(0, 1), k, v, mask, item.start - first).transpose(0, 1)

    def _attend_decode(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: DecodeGroup,
                       out: torch.Tensor) -> None:
        """Several requests' one new row each, in one sdpa call over their padded positions, into `out`."""
        count = group.mask.shape[0]
        q = queries[group.first_row : group.first_row + count] if group.first_row is not None else \
            queries.index_select(0, group.rows)
        q = q.reshape(count, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)
        k = keys.index_select(1, group.slots).view(self.n_kv_heads, count, -1, self.head_dim).transpose(0, 1)
        v = k[..., : self.latent_values] if values is None else \
            values.index_select(1, group.slots).view(self.n_kv_heads, count, -1, values.shape[-1]).transpose(0, 1)
        if self.explicit:
            sinks = None if self.sinks is None else self.sinks.view(1, self.n_kv_heads, -1, 1)
            attended = self._softmax_attention(q, k, v, group.mask, sinks)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=self.scale)
        attended = attended.reshape(count, self.n_heads, -1)
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

    def _attend_explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         offset: int) -> torch.Tensor:
        """As _attend, with soft-capped scores (Gemma 2) or sinks (gpt-oss): transformers' eager attention."""
        group, rows = self.n_heads // self.n_kv_heads, q.shape[1]
        q = q.reshape(self.n_kv_heads, group * rows, -1)  # each kv head's query heads, rows one after another
        if mask is None and rows > 1:  # several rows from position 0: causal
            mask = causal_mask(offset, rows, q.device)
        if mask is not None:
            mask = mask.repeat(group, 1)  # the same rows' mask for each query head of the group
        sinks = None if self.sinks is None else \
            self.sinks.view(self.n_kv_heads, group, 1, 1).expand(-1, -1, rows, -1).reshape(self.n_kv_heads, -1, 1)
        return self._softmax_attention(q, k, v, mask, sinks).reshape(self.n_heads, rows, -1)

    def _softmax_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(scores + mask) v in transformers' eager order, scores = q k^T * scale, capped as tanh(s / cap) *
        cap (Gemma 2); with sinks (gpt-oss, one logit per query row [..., Q, 1]) the softmax runs over the scores
        and the sink, whose share is then dropped. q [..., Q, D], k and v [..., L, D], matching leading dims."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
        else:
            weights = torch.softmax(torch.cat((scores, sinks.expand(*scores.shape[:-1], 1)), dim=-1), dim=-1,
                                    dtype=torch.float32)[..., :-1]
        return torch.matmul(weights.to(q.dtype), v)
