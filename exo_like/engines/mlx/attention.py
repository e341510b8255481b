"""Attention over the paged KV pool on MLX: one layer's pool, a step's index of who attends to which slots, and the
attention layer (GQA, one sdpa call per request, each row rotated at its own position)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from exo_like.engines.batch import BatchLayout, ItemLayout
from exo_like.engines.batch import layout as batch_layout
from exo_like.engines.work import BLOCK_SIZE, WorkItem, window_start
from exo_like.models.config import ModelArgs, rope_attention_factor, rope_inv_freq


class LayerPool:
    """One layer's keys and values for every request on this stage: [kv_heads, slots, width] each (ModelArgs.
    kv_layout: MLA caches one latent key a position, whose first `value_width` values serve as its value), slots =
    blocks * BLOCK_SIZE (see engines/batch.py for which slot holds what)."""

    def __init__(self, args: ModelArgs, n_blocks: int, dtype: mx.Dtype):
        heads, key_width, value_width = args.kv_layout()
        self.keys = mx.zeros((heads, n_blocks * BLOCK_SIZE, key_width), dtype)
        self.values = mx.zeros((heads, n_blocks * BLOCK_SIZE, value_width), dtype) if value_width else None
        self.latent_values = None if value_width else args.mla.kv_lora_rank

    def write(self, slots: mx.array, keys: mx.array, values: mx.array | None) -> None:
        """Store rows' keys and values [kv_heads, R, width] at their slots."""
        self.keys[:, slots] = keys
        if self.values is not None:
            self.values[:, slots] = values

    def read(self, item: ItemLayout, slots: mx.array | None, first: int = 0) -> tuple[mx.array, mx.array]:
        """An item's keys and values for positions [first, end): a slice when its slots are consecutive."""
        if slots is None:
            start, end = item.base + first - item.origin, item.base + item.end - item.origin
            keys = self.keys[:, start:end]
            return keys, self.values[:, start:end] if self.values is not None else keys[..., :self.latent_values]
        if first > item.origin:
            slots = slots[first - item.origin:]
        keys = mx.take(self.keys, slots, axis=1)
        return keys, mx.take(self.values, slots, axis=1) if self.values is not None else \
            keys[..., :self.latent_values]

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate after a step, so the next step does not drag this step's graph along."""
        return [self.keys] if self.values is None else [self.keys, self.values]


class StepIndex:
    """A BatchLayout as MLX arrays, built once per step and shared by every layer; for the sliding-window layers,
    `windowed` is the same from their own pool's layout."""

    def __init__(self, layout: BatchLayout, window_layout: BatchLayout | None = None):
        self.layout = layout
        self.windowed = None if window_layout is None else StepIndex(window_layout)
        self.positions = mx.array(layout.positions.astype(np.int32))
        self.write_slots = mx.array(layout.write_slots.astype(np.int32))
        self.gathers = [None if item.base is not None else mx.array(item.slots.astype(np.int32))
                        for item in layout.items]
        self._windows: dict[tuple[int, int], mx.array | None] = {}

    def window_mask(self, index: int, window: int) -> mx.array | None:
        """Which of positions [first, end) item `index`'s rows see through a window (first: its first row's
        window start); None when each sees them all. Made once per step, item and window size."""
        if (index, window) not in self._windows:
            item = self.layout.items[index]
            queries = np.arange(item.start, item.end)[:, None]
            keys = np.arange(window_start(item.start, window), item.end)[None, :]
            visible = (keys <= queries) & (keys > queries - window)
            self._windows[index, window] = None if visible.all() else mx.array(visible)
        return self._windows[index, window]


def step_index(items: Sequence[WorkItem], n_blocks: int, n_window_blocks: int | None, args: ModelArgs) -> StepIndex:
    """A step's index on a shard whose pools hold `n_blocks` and `n_window_blocks` (None: no sliding-window
    layers) blocks."""
    layout = batch_layout(items, n_blocks, args.context_length)
    if n_window_blocks is None:
        return StepIndex(layout)
    return StepIndex(layout, batch_layout(items, n_window_blocks, args.context_length, args.kv_window))


class RMSNorm(nn.Module):
    """RMSNorm; with `offset` Gemma's: scaled by (1 + w), all in float32, rounded once."""

    def __init__(self, dims: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps, self.offset = eps, offset

    def __call__(self, x: mx.array) -> mx.array:
        if not self.offset:
            return mx.fast.rms_norm(x, self.weight, self.eps)
        scale = 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), scale, self.eps).astype(x.dtype)


class Attention(nn.Module):
    """Attention of absolute layer `layer`: its window (sliding-window layers), rope base, and the model's scale,
    soft-capping and sinks (gpt-oss, which sdpa takes natively) come from the config."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.attn_scale or args.head_dim**-0.5
        self.window, self.softcap = args.window(layer), args.attn_softcap
        hidden, q_dim, kv_dim = args.hidden_size, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=args.o_bias)
        if args.attn_sinks:
            self.sinks = mx.zeros((self.n_heads,))
        if args.qk_norm:
            # Qwen3 and Gemma 3 normalise each head's query and key before rope.
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, args.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, args.norm_offset)
        # mx.fast.rope takes periods (1 / inverse frequency). Using the shared float64-derived table for every
        # rope type keeps MLX and torch shards rotating by identical angles.
        if args.local_rope_theta is not None and self.window is not None:  # Gemma 3's local layers
            args = replace(args, rope_theta=args.local_rope_theta, rope_scaling=None, rope_freq_factors=None)
        self._rope_freqs = mx.array(1.0 / rope_inv_freq(args))
        self._rope_factor = rope_attention_factor(args)  # YaRN's; rotation is linear, so scaling after is the same
        self._rotary_dim = args.rope_dim

    def __call__(self, x: mx.array, pool: LayerPool, index: StepIndex) -> mx.array:
        """x: the batch's rows [R, H]."""
        rows = x.shape[0]
        if self.window is not None:  # its own pool's slots
            index = index.windowed
        queries = self.q_proj(x).reshape(rows, self.n_heads, self.head_dim)
        keys = self.k_proj(x).reshape(rows, self.n_kv_heads, self.head_dim)
        values = self.v_proj(x).reshape(rows, self.n_kv_heads, self.head_dim)
        if "q_norm" in self:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = self._rope(queries, index.positions), self._rope(keys, index.positions)
        pool.write(index.write_slots, keys.transpose(1, 0, 2), values.transpose(1, 0, 2))
        return self.o_proj(self.attend(queries, pool, index).reshape(rows, -1))

    def attend(self, queries: mx.array, pool: LayerPool, index: StepIndex) -> mx.array:
        """The rows' queries [R, heads, D] against the pool (their own keys written) -> [R, heads, Dv]; `index`
        the one of this layer's pool (StepIndex.windowed for a sliding-window layer)."""
        outs = []
        for i, (item, slots) in enumerate(zip(index.layout.items, index.gathers)):
            q = queries[item.row_start:item.row_end].transpose(1, 0, 2)[None]
            if self.window is None:
                # sdpa's "causal" mask is aligned lower-right (last query sees last key): exactly the causal mask
                # for new positions after cached ones.
                first, mask = 0, "causal" if item.count > 1 else None
            else:
                first, mask = window_start(item.start, self.window), index.window_mask(i, self.window)
            item_keys, item_values = pool.read(item, slots, first)
            out = self._attend(q, item_keys[None], item_values[None], mask)
            outs.append(out[0].transpose(1, 0, 2))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, mask: mx.array | str | None) -> mx.array:
        """q [1, heads, T, D] against k, v [1, kv_heads, L, D]. GQA: sdpa broadcasts the kv heads itself."""
        if self.softcap is None:
            sinks = self["sinks"].astype(q.dtype) if "sinks" in self else None
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask, sinks=sinks)
        # Soft-capped scores (Gemma 2), which sdpa cannot do: transformers' eager attention.
        group = self.n_heads // self.n_kv_heads
        k, v = mx.repeat(k, group, axis=1), mx.repeat(v, group, axis=1)
        scores = (q @ k.swapaxes(-1, -2)) * self.scale
        scores = mx.tanh(scores / self.softcap) * self.softcap
        if isinstance(mask, str):
            rows, keys = q.shape[2], k.shape[2]
            mask = mx.array(np.tril(np.ones((rows, keys), dtype=bool), keys - rows))
        if mask is not None:
            scores = mx.where(mask, scores, -mx.inf)
        weights = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True).astype(q.dtype)
        return weights @ v

    def _rope(self, x: mx.array, positions: mx.array) -> mx.array:
        """Rotate each row [R, heads, D] by its own position (each row its own batch entry of mx.fast.rope)."""
        dims = self._rotary_dim  # the leading dimensions rotate, the rest pass through (Phi-4-mini)
        rotated = mx.fast.rope(x[:, :, None, :], dims, traditional=False, base=None, scale=1.0,
                               offset=positions, freqs=self._rope_freqs)[:, :, 0, :]
        if self._rope_factor == 1.0:
            return rotated
        if dims == x.shape[-1]:
            return rotated * self._rope_factor
        return mx.concatenate([rotated[..., :dims] * self._rope_factor, rotated[..., dims:]], axis=-1)
