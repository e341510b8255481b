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

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from exo_like.engines.torch.attention import Attention, KVPool, RotaryTable, StepIndex
from exo_like.engines.torch.linear import PACK_BATCH, Linear, native_matvec, onednn_usable
from exo_like.engines.torch.mla import LatentAttention
from exo_like.engines.torch.mlp import MLP, SparseMoe
from exo_like.engines.torch.norm import RMSNorm
from exo_like.engines.torch.native.decode import NativeDecode
from exo_like.engines.torch.native.decode import supported as native_decode_refusal
from exo_like.engines.torch.quant import (
    CastEmbedding,
    Matrix,
    NativeEmbedding,
    QuantEmbedding,
    QuantHeads,
    QuantLinear,
    native_kernels,
    stack_rows,
)
from exo_like.models.config import ModelArgs


class TransformerBlock(nn.Module):
    """Decoder layer `layer` (its absolute index: which layers hold a mixture of experts or a sliding window
    depends on it). With sandwich norms (Gemma), the attention's and the MLP's outputs are normalised too, and
    `post_attention_layernorm` is the attention's output norm rather than the MLP's input norm."""

    def __init__(self, args: ModelArgs, layer: int, reduce: Reduce | None = None):
        super().__init__()
        # A tensor-parallel rank's attention and MLP give partial sums, which the group adds up (an all-reduce);
        # they stand for the whole outputs from there on (residual, sandwich norms).
        self.reduce = reduce or _whole
        self.tensor_parallel = reduce is not None
        self.self_attn = LatentAttention(args, layer) if args.mla is not None else Attention(args, layer)
        self.mlp = SparseMoe(args.hidden_size, args.moe) if args.is_sparse_layer(layer) else \
            MLP(args.hidden_size, args.intermediate_size, args.mlp_bias, args.hidden_act)
        norm = lambda: RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.sandwich = args.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.rope_key = rope_key(args, layer)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                values: torch.Tensor, index: StepIndex) -> torch.Tensor:
        attended = self.reduce(self.self_attn.forward(self.input_layernorm.forward(x), rope, keys, values, index))
        if not self.sandwich:
            h = x + attended
            return h + self.reduce(self.mlp.forward(self.post_attention_layernorm.forward(h)))
        h = x + self.post_attention_layernorm.forward(attended)
        mlp_out = self.reduce(self.mlp.forward(self.pre_feedforward_layernorm.forward(h)))
        return h + self.post_feedforward_layernorm.forward(mlp_out)


Reduce = Callable[[torch.Tensor], torch.Tensor]


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


def rope_key(args: ModelArgs, layer: int) -> str:
    """Which rotary table a layer uses: Gemma 3's sliding-window layers have their own base, unscaled."""
    return "local" if args.local_rope_theta is not None and args.window(layer) is not None else "global"


def rope_tables(args: ModelArgs, keys: set[str], device: torch.device, dtype: torch.dtype) -> dict[str, RotaryTable]:
    local = replace(args, rope_theta=args.local_rope_theta, rope_scaling=None, rope_freq_factors=None)
    return {key: RotaryTable(local if key == "local" else args, device, dtype) for key in keys}


class ShardModel(nn.Module):
    """Layers [first_layer, first_layer + n_layers) of the model; embedding if first, final norm + LM head if last."""

    def __init__(self, args: ModelArgs, first_layer: int, n_layers: int, is_first: bool, is_last: bool,
                 reduce: Reduce | None = None, batch_invariant: bool = True):
        """reduce: sums a tensor-parallel group's partial layer outputs (None: the layers are whole);
        batch_invariant: prompt steps run on the native step too, where it runs the shard (see NativeDecode)."""
        super().__init__()
        self.batch_invariant = batch_invariant
        self.args = args
        self.is_first, self.is_last = is_first, is_last
        # Given a weight, nn.Embedding skips its random init, which on the meta device imports torch._dynamo
        # (and sympy): tens of MB of resident memory for nothing.
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size)) if is_first else None
        self.layer_ids = range(first_layer, first_layer + n_layers)  # absolute
        self.layers = nn.ModuleList(TransformerBlock(args, layer, reduce) for layer in self.layer_ids)
        self.reduces = reduce is not None  # a tensor-parallel rank
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset) if is_last else None
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False) if is_last else None
        self.ropes: dict[str, RotaryTable] = {}
        self.native_matvec = False
        self.native_decode: NativeDecode | None = None

    def prepare(self) -> None:
        """After loading weights: tie the head to the embedding, pick weight layouts, build the rotary table."""
        if isinstance(self.lm_head, Linear) and isinstance(self.embed_tokens, nn.Embedding) and \
                self.args.tie_word_embeddings:
            # One tensor when the shard holds both the embedding and the tied LM head (quantized ones share packs).
            self.lm_head.weight = self.embed_tokens.weight
        weight = self.norm_weight
        kernels = native_kernels(weight.device)
        # The native decode step reads plain weights: float32 ones stay unpacked for it (prefill runs them on oneDNN).
        native_step = kernels is not None and native_decode_refusal(self) is None
        pack_batch = PACK_BATCH.get(weight.dtype)
        pack = pack_batch is not None and onednn_usable(weight, pack_batch) and not native_step
        # bfloat16 plain weights (the LM head) go faster through F.linear: natively for one row, see native_matvec.
        onednn = weight.dtype == torch.float32 and onednn_usable(weight, None)
        for module in list(self.modules()):
            if isinstance(module, RMSNorm):
                module.prepare()
            if not isinstance(module, Linear):
                continue
            module.onednn = onednn
            # The LM head stays plain: it may be the embedding matrix too, whose rows are looked up.
            if pack and module is not self.lm_head:
                packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.data, pack_batch)
                module.weight, module.packed = nn.Parameter(packed, requires_grad=False), True
        self.native_matvec = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        self.native_decode = NativeDecode.build(self, kernels, self.batch_invariant) if native_step else None
        self.ropes = rope_tables(self.args, {layer.rope_key for layer in self.layers}, weight.device, weight.dtype)

    @property
    def norm_weight(self) -> torch.Tensor:
        """A float weight every shard holds, in the shard's device and dtype (matrices may be quantized)."""
        return self.layers[0].input_layernorm.weight

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the shard holds, each once (a tied head shares the embedding's)."""
        held = {id(t): t for t in self.parameters()}
        for module in self.modules():
            if isinstance(module, (QuantLinear, QuantHeads, QuantEmbedding, NativeEmbedding, CastEmbedding)):
                held.update((id(t), t) for t in module.tensors())
        return list(held.values())

    def new_pool(self, n_blocks: int, n_window_blocks: int | None = None, spare: int = 0) -> KVPool:
        """The KV pool for the shard's layers; the sliding-window layers' of `n_window_blocks` (default the same);
        `spare` blocks beyond (see KVPool)."""
        weight = self.norm_weight
        window_blocks = n_blocks if n_window_blocks is None else n_window_blocks
        return KVPool(self.args, self.layer_ids, n_blocks, window_blocks, weight.device, weight.dtype, spare)

    def forward(self, inputs: torch.Tensor, pool: KVPool, index: StepIndex) -> torch.Tensor:
        """One step over a batch. inputs: token ids [R] (first shard) or hidden states [R, H]. Returns hidden
        states [R, H], or on the last shard the logits [S, vocab] of the batch's sampled rows."""
        return self.head(self.run_layers(self.embed(inputs), pool, index), index)

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """Token ids [R] -> hidden states [R, H] on the first shard; hidden states pass through elsewhere."""
        if self.embed_tokens is None:
            return inputs
        h = self.embed_tokens.forward(inputs)  # (no hooks: see run_layers)
        if self.args.embed_scale:  # Gemma: by sqrt(hidden), in h's dtype
            h = h * torch.tensor(self.args.hidden_size**0.5, dtype=h.dtype)
        return h

    def run_layers(self, h: torch.Tensor, pool: KVPool, index: StepIndex,
                   ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """ropes: each rotary table's cos and sin for the rows (None: from the index's positions; a decode
        graph gathers them on the device, cuda/graphs.py, and its index has no layout)."""
        if ropes is None:
            ropes = {key: table.get(index.layout.positions) for key, table in self.ropes.items()}
            if self.native_decode is not None and self.native_decode.handles(index.layout, h):
                return self.native_decode.run(h, pool, index, ropes)
        with native_matvec(self.native_matvec and h.shape[0] == 1):
            # Layers call their parts through .forward, not nn.Module's call machinery: that machinery (hook
            # checks, for hooks this model never has) runs ~9 times per layer, a noticeable share of a small
            # model's decode step (see bench/bench_vs_llamacpp.py).
            for i, layer in enumerate(self.layers):
                h = layer.forward(h, ropes[layer.rope_key], *pool.layer(i), index)
        return h

    def head(self, h: torch.Tensor, index: StepIndex) -> torch.Tensor:
        """On the last shard, the logits of the batch's sampled rows; elsewhere the hidden states unchanged."""
        if self.lm_head is None:
            return h
        native = self.native_decode
        if native is not None and native.has_head and native.handles(index.layout, h):
            return self.native_decode.head(h, index.layout)
        sampled = torch.from_numpy(index.layout.sample_rows).to(h.device)
        # Only the sampled rows' logits are needed: with one request, a matrix-vector product.
        with native_matvec(self.native_matvec and sampled.shape[0] == 1):
            return self.logits(h.index_select(0, sampled))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The last shard's logits of rows h (the final norm, the LM head, Gemma 2's soft-capping)."""
        logits = self.lm_head(self.norm(h))
        if self.args.final_softcap is not None:  # Gemma 2
            logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return logits


# Projections the engine runs as one product: (fused name, the checkpoint's parts in row order).
_FUSIONS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def fuse_checkpoint_weights(
    weights: dict[str, Matrix], args: ModelArgs, is_first: bool, is_last: bool
) -> dict[str, Matrix | list[Matrix]]:
    """Turn a shard's checkpoint tensors (local layer names) into this module's state dict.

    Concatenates q/k/v and gate/up (and their biases; quantized matrices stay AffineGroups, see
    torch_quant.stack_rows), drops the `model.`
    prefix, and maps a tied embedding on a non-first last shard to the LM head. Consumes `weights`.
    """
    state: dict[str, torch.Tensor] = {}
    # Every module holding the first part of a fusion (an attention, an MLP, each expert, a shared expert).
    for name in [n for n in weights if n.startswith("model.layers.")]:
        for fused, parts in _FUSIONS:
            module, dot, tail = name.rpartition(f".{parts[0]}.")
            # (MLA's q_proj has no k_proj or v_proj to join)
            if dot and tail in ("weight", "bias") and name in weights and \
                    all(f"{module}.{part}.{tail}" in weights for part in parts):
                pieces = [weights.pop(f"{module}.{part}.{tail}") for part in parts]
                state[f"{module.removeprefix('model.')}.{fused}.{tail}"] = stack_rows(pieces)
        module, dot, tail = name.rpartition(".self_attn.q_norm.")
        if dot and name in weights:
            for norm in ("q_norm", "k_norm"):
                state[f"{module.removeprefix('model.')}.self_attn.qk_norm.{norm}.{tail}"] = \
                    weights.pop(f"{module}.self_attn.{norm}.{tail}")
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
