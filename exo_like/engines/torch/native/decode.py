"""A shard's decode step as one native call (decode.cpp): every layer of a Llama-family or Gemma 3 shard with
float32 activations, with no Python and no per-op dispatch between the kernels (sliding windows, Gemma's sandwich
and offset norms, its GELU-tanh MLP and its local layers' rotary table included). Other shards and steps (mixtures
routed otherwise, capped or sunk attention, latent attention, tensor-parallel ranks, bfloat16 activations) run the
Python layers; both compute the same function, in another summation order. A mixture of experts runs natively
where it is routed as Qwen's and Mixtral's are (plain_mixture)."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from exo_like.engines.batch import BatchLayout
from exo_like.engines.torch.attention import item_slots
from exo_like.engines.torch.linear import Linear
from exo_like.engines.torch.mlp import SparseMoe
from exo_like.engines.torch.native.matrix import HalfMatrix, NativeMatrix
from exo_like.engines.torch.norm import RMSNorm
from exo_like.engines.torch.quant import QuantLinear
from exo_like.models.families import Router

if TYPE_CHECKING:
    from exo_like.engines.torch.attention import KVPool, StepIndex
    from exo_like.engines.torch.model import ShardModel, TransformerBlock

# The MLP gates the native step runs (mlp.py's names).
_GATES = ("silu", "gelu_tanh")


def _projection(module: Any, kernels: ModuleType) -> Any | None:
    """The native form of a projection, or None where it has none (a packed or non-float32 weight)."""
    if isinstance(module, Linear):
        weight = module.weight
        if module.packed or weight.dtype != torch.float32 or weight.layout != torch.strided:
            return None
        return kernels.dense_projection(weight.detach().contiguous(), None if module.bias is None else module.bias)
    if isinstance(module, QuantLinear):
        if len(module.pieces) == 1:  # the common case, bias and all
            return _piece(module.pieces[0], kernels, module.bias)
        parts = [_piece(piece, kernels) for piece in module.pieces]  # several types (a GGUF file's q, k and v)
        if any(part is None for part in parts):
            return None
        return kernels.stacked_projection(parts, module.bias)
    return None


def _piece(piece: Any, kernels: ModuleType, bias: torch.Tensor | None = None) -> Any | None:
    """One piece of a QuantLinear in native form: a NativeMatrix, a HalfMatrix, or a dense float32 matrix."""
    if isinstance(piece, NativeMatrix):
        return kernels.native_projection(*piece.kernel_args(), bias)
    if isinstance(piece, HalfMatrix):
        return kernels.dense_projection(piece.weight, bias)
    if isinstance(piece, torch.Tensor) and piece.dtype == torch.float32 and piece.is_contiguous():
        return kernels.dense_projection(piece, bias)
    return None  # int4 packs, or a matrix dequantized to bfloat16 without the native kernels


def supported(model: ShardModel) -> str | None:
    """Why this shard's layers cannot run as one native step (None if they can)."""
    args = model.args
    checks = (
        (args.mla is not None, "latent attention"), (args.hidden_act not in _GATES, f"{args.hidden_act} MLP"),
        (args.attn_softcap is not None or args.attn_sinks, "capped or sunk attention"),
        (args.rope_dim != args.head_dim, "partial rotary"),
        (any(args.is_sparse_layer(layer) for layer in model.layer_ids) and not plain_mixture(args),
         "a mixture routed otherwise than by a softmax's top k"),
        (model.norm_weight.dtype != torch.float32 or model.norm_weight.device.type != "cpu", "not float32 on CPU"),
        (any(layer.tensor_parallel for layer in model.layers), "tensor-parallel rank"),
    )
    return next((why for failed, why in checks if failed), None)


def plain_mixture(args: Any) -> bool:
    """Whether the model's mixture of experts is one the native step runs: a softmax over every expert's logit,
    the top k, SwiGLU experts without biases (Qwen-MoE, Mixtral); not gpt-oss's or DeepSeek's routing."""
    moe = args.moe
    return moe is not None and moe.router == Router.TOP_K_OF_SOFTMAX and moe.activation == "silu" and not moe.expert_bias


class NativeDecode:
    """The shard's layers registered once with the native step; `run` takes a step's rows."""

    def __init__(self, model: ShardModel, kernels: ModuleType, stack: Any, has_head: bool, prompts: bool,
                 rope_keys: list[str]):
        self.model, self.kernels, self.stack = model, kernels, stack
        self.rope_keys = rope_keys  # the rotary tables' keys, in the order of the layers' `rope` index
        self.prompts = prompts  # prompt steps run here too: every step's numerics batch-invariant
        self.has_head = has_head  # the last shard's final norm and LM head run natively too
        self._pool: KVPool | None = None

    @classmethod
    def build(cls, model: ShardModel, kernels: ModuleType | None, prompts: bool) -> "NativeDecode | None":
        """The native step for this shard, or None where it does not apply (see `supported`); `prompts`: prompt
        steps run on it too (see handles)."""
        if kernels is None or supported(model) is not None:
            return None
        args = model.args
        stack = kernels.DecodeStack(args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                    args.rms_norm_eps, args.attn_scale or args.head_dim**-0.5,
                                    args.hidden_act == "gelu_tanh")
        rope_keys = [key for key in ROPE_KEYS if any(layer.rope_key == key for layer in model.layers)]
        for layer_id, layer in zip(model.layer_ids, model.layers):
            parts = _layer_parts(layer, kernels, rope_keys, args.window(layer_id) is not None)
            mixture = _mixture_parts(layer.mlp, kernels) if isinstance(layer.mlp, SparseMoe) else ()
            if parts is None or mixture is None:
                return None
            stack.add_layer(*parts)
            if mixture:
                stack.set_mixture(*mixture)
        head = None
        if model.lm_head is not None and model.norm is not None and args.final_softcap is None:
            head = _projection(model.lm_head, kernels)
            if head is not None:
                stack.set_head(_norm_weight(model.norm), head)
        return cls(model, kernels, stack, head is not None, prompts, rope_keys)

    def handles(self, layout: BatchLayout, h: torch.Tensor) -> bool:
        """Whether the native step runs this step: float32 rows, and every step where prompts run natively
        (batch-invariant), else those where every request adds one position."""
        return h.dtype == torch.float32 and (self.prompts or all(item.count == 1 for item in layout.items))

    def run(self, h: torch.Tensor, pool: KVPool, index: StepIndex,
            ropes: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The shard's layers on the step's rows; `ropes`: the rotary tables' cos and sin by key (model.rope_key)."""
        if pool is not self._pool:
            for i in range(len(self.model.layers)):
                keys, values = pool.layer(i)
                self.stack.set_pool(i, keys, values)
            self._pool = pool
        rows = h.shape[0]
        tables = [ropes[key] for key in self.rope_keys]
        views = [_slot_view(index.layout)]
        if index.windowed is not None:
            views.append(_slot_view(index.windowed.layout, self.model.args.kv_window))
        return self.stack.step(h, [cos.reshape(rows, -1) for cos, _ in tables],
                               [sin.reshape(rows, -1) for _, sin in tables], views)


    def head(self, h: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """The logits [S, vocab] of the step's sampled rows (has_head: the final norm and LM head are native)."""
        return self.stack.head(h, torch.from_numpy(layout.sample_rows))


# The rotary tables a shard may use (model.rope_key).
ROPE_KEYS = ("global", "local")


def row_slots(layout: BatchLayout, window: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each row's keys are: (first [rows], count [rows], slots), row r attending to
    slots[first[r] : first[r] + count[r]], its positions [0, its own], or through a sliding window of `window`
    positions the last `window` of them (the layout then holds each request's positions from its `origin` on). A
    request's rows share its slot list."""
    seen = [item_slots(item) for item in layout.items]  # positions [origin, end)
    starts = np.zeros(len(seen), dtype=np.int64)
    np.cumsum([len(s) for s in seen[:-1]], out=starts[1:])
    per_item = [item.count for item in layout.items]
    positions = layout.positions.astype(np.int64)
    lowest = np.zeros_like(positions) if window is None else np.maximum(positions - (window - 1), 0)
    origins = np.repeat(np.array([item.origin for item in layout.items], dtype=np.int64), per_item)
    firsts = np.repeat(starts, per_item) + lowest - origins
    return firsts, positions - lowest + 1, np.concatenate(seen).astype(np.int64, copy=False)


def _slot_view(layout: BatchLayout, window: int | None = None) -> list[torch.Tensor]:
    """DecodeStack.step's slot view of a layout: write slots, firsts, counts, slots."""
    firsts, counts, slots = row_slots(layout, window)
    return [torch.from_numpy(part) for part in (layout.write_slots, firsts, counts, slots)]


def _norm_weight(norm: RMSNorm) -> torch.Tensor:
    """What a norm multiplies by: its weight, or Gemma's 1 + w (made in float32 once, as the Python layers use it)."""
    if not norm.offset:
        return norm.weight.detach()
    return norm.scale if norm.scale is not None else 1.0 + norm.weight.detach().float()


def _layer_parts(layer: TransformerBlock, kernels: ModuleType, rope_keys: list[str], windowed: bool) -> tuple | None:
    attention, mlp = layer.self_attn, layer.mlp
    projections = [_projection(m, kernels) for m in (attention.qkv_proj, attention.o_proj)]
    if isinstance(mlp, SparseMoe):
        projections += [None, None]  # set_mixture gives its MLP
    else:
        projections += [_projection(mlp.gate_up_proj, kernels), _projection(mlp.down_proj, kernels)]
        if projections[-1] is None or projections[-2] is None:
            return None
    if projections[0] is None or projections[1] is None:
        return None
    qk = attention.qk_norm
    sandwich = (_norm_weight(layer.pre_feedforward_layernorm), _norm_weight(layer.post_feedforward_layernorm)) \
        if layer.sandwich else (None, None)
    return (_norm_weight(layer.input_layernorm), _norm_weight(layer.post_attention_layernorm),
            None if qk is None else _norm_weight(qk.q_norm), None if qk is None else _norm_weight(qk.k_norm),
            *projections, *sandwich, rope_keys.index(layer.rope_key), int(windowed))


def _mixture_parts(moe: SparseMoe, kernels: ModuleType) -> tuple | None:
    """DecodeStack.set_mixture's arguments for a mixture layer, or None where a projection has no native form."""
    router = _projection(moe.gate, kernels)
    gate_ups = [_projection(expert.gate_up_proj, kernels) for expert in moe.experts]
    downs = [_projection(expert.down_proj, kernels) for expert in moe.experts]
    shared = moe.shared_expert
    shared_parts = (None, None) if shared is None else \
        (_projection(shared.gate_up_proj, kernels), _projection(shared.down_proj, kernels))
    gate = None if moe.shared_expert_gate is None else _projection(moe.shared_expert_gate, kernels)
    if router is None or None in gate_ups or None in downs or (shared is not None and None in shared_parts) or \
            (moe.shared_expert_gate is not None and gate is None):
        return None
    return router, gate_ups, downs, moe.top_k, moe.renormalize, moe.moe.scale, *shared_parts, gate
