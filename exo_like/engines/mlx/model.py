"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in MLX, built for one shard of the layers.

Parameter names follow the Hugging Face checkpoint (`model.layers.N.self_attn.q_proj.weight`, ...) with layers
numbered from 0 inside the shard, which is how `checkpoint.plan_shard_load` renames them, so the loaded tensors
drop straight into `ShardModel.load_weights`. Linear layers are plain `nn.Linear` / `nn.Embedding` so that
`nn.quantize` can later swap them for quantized ones before the weights are loaded.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from exo_like.engines.mlx.attention import Attention, LayerPool, RMSNorm, StepIndex
from exo_like.engines.mlx.mla import LatentAttention
from exo_like.engines.mlx.mlp import MLP, SparseMoe
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard


class TransformerBlock(nn.Module):
    """Decoder layer `layer` (its absolute index: which layers hold a mixture of experts or a sliding window
    depends on it). With sandwich norms (Gemma), the attention's and the MLP's outputs are normalised too, and
    `post_attention_layernorm` is the attention's output norm rather than the MLP's input norm."""

    def __init__(self, args: ModelArgs, layer: int, reduce: Reduce | None = None):
        super().__init__()
        # A tensor-parallel rank's attention and MLP give partial sums, which the group adds up (an all-reduce);
        # they stand for the whole outputs from there on (residual, sandwich norms).
        self.reduce = reduce or _whole
        self.self_attn = LatentAttention(args, layer) if args.mla is not None else Attention(args, layer)
        self.mlp = SparseMoe(args.hidden_size, args.moe) if args.is_sparse_layer(layer) else \
            MLP(args.hidden_size, args.intermediate_size, args.mlp_bias, args.hidden_act)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)
        self.sandwich = args.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)

    def __call__(self, x: mx.array, pool: LayerPool, index: StepIndex) -> mx.array:
        attended = self.reduce(self.self_attn(self.input_layernorm(x), pool, index))
        if not self.sandwich:
            h = x + attended
            return h + self.reduce(self.mlp(self.post_attention_layernorm(h)))
        h = x + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.reduce(self.mlp(self.pre_feedforward_layernorm(h))))


Reduce = Callable[[mx.array], mx.array]


def _whole(x: mx.array) -> mx.array:
    return x


class ShardBody(nn.Module):
    """The `model.*` part of the checkpoint that this shard holds."""

    def __init__(self, args: ModelArgs, shard: Shard, reduce: Reduce | None = None):
        super().__init__()
        # A tied last stage needs the embedding matrix as its LM head even when it is not the first stage.
        if shard.is_first or (shard.is_last and args.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, shard.start_layer + i, reduce) for i in range(shard.layer_count)]
        if shard.is_last:
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)


class ShardModel(nn.Module):
    """Layers [start, end) of the model; token ids in if first, logits out if last, hidden states otherwise. In a
    tensor-parallel group, `args` are the rank's (models/tensor_split.rank_args) and `reduce` sums the ranks'
    partial layer outputs (None: the layers are whole)."""

    def __init__(self, args: ModelArgs, shard: Shard, reduce: Reduce | None = None):
        super().__init__()
        self.args = args
        self.shard = shard
        self.model = ShardBody(args, shard, reduce)
        if shard.is_last and not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, pools: list[LayerPool], index: StepIndex) -> mx.array:
        """One step over a batch. inputs: token ids [R] on the first shard, else hidden states [R, H]. Returns
        hidden states [R, H], or on the last shard the logits [S, vocab] of the batch's sampled rows."""
        return self.head(self.run_layers(self.embed(inputs), pools, index), index)

    def embed(self, inputs: mx.array) -> mx.array:
        """Token ids [R] -> hidden states [R, H] on the first shard; hidden states pass through elsewhere."""
        if not self.shard.is_first:
            return inputs
        h = self.model.embed_tokens(inputs)
        if self.args.embed_scale:  # Gemma: by sqrt(hidden), in h's dtype
            h = h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)
        return h

    def run_layers(self, h: mx.array, pools: list[LayerPool], index: StepIndex) -> mx.array:
        for layer, pool in zip(self.model.layers, pools):
            h = layer(h, pool, index)
        return h

    def head(self, h: mx.array, index: StepIndex) -> mx.array:
        """On the last shard, the logits of the batch's sampled rows; elsewhere the hidden states unchanged."""
        if not self.shard.is_last:
            return h
        h = self.model.norm(h[mx.array(index.layout.sample_rows.astype(np.int32))])
        logits = self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)
        if self.args.final_softcap is not None:  # Gemma 2
            logits = mx.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return logits

    def make_pools(self, n_blocks: int, n_window_blocks: int, dtype: mx.Dtype) -> list[LayerPool]:
        """A pool per layer: `n_window_blocks` blocks for a sliding-window layer, `n_blocks` for the others."""
        return [LayerPool(self.args, n_blocks if self.args.window(layer) is None else n_window_blocks, dtype)
                for layer in range(self.shard.start_layer, self.shard.end_layer)]


FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def split_module_paths(path: str) -> tuple[str, ...]:
    """The module paths a fused projection's path becomes (itself if it is not fused)."""
    parent, _, projection = path.rpartition(".")
    return tuple(f"{parent}.{part}" for part in FUSED_PARTS[projection]) if projection in FUSED_PARTS else (path,)


def split_fused_projections(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """Checkpoints that store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3), split into the
    separate projections this model holds: rows are q, k, v (gate, up), for weights, biases and a quantized
    matrix's scales and biases alike."""
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        module, dot, kind = name.rpartition(".")
        parent, _, projection = module.rpartition(".")
        if projection == "qkv_proj":
            parts = {"q_proj": array[:q], "k_proj": array[q:q + kv], "v_proj": array[q + kv:]}
        elif projection == "gate_up_proj":
            half = array.shape[0] // 2
            parts = {"gate_proj": array[:half], "up_proj": array[half:]}
        else:
            out[name] = array
            continue
        out.update((f"{parent}.{part}{dot}{kind}", rows) for part, rows in parts.items())
    return out
