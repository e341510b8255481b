"""A shard's decode step as one native call (decode.cpp): every layer of a Llama-family shard with float32
activations, for steps where each request adds one position, with no Python and no per-op dispatch between the
kernels. Other shards and steps (prefill, mixtures routed otherwise, sliding windows, Gemma's norms, tensor-parallel
ranks, bfloat16 activations) run the Python layers; both compute the same function, in another summation order. A
mixture of experts runs natively where it is routed as Qwen's and Mixtral's are (plain_mixture)."""

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
from exo_like.engines.torch.quant import QuantLinear

if TYPE_CHECKING:
    from exo_like.engines.torch.attention import KVPool
    from exo_like.engines.torch.model import ShardModel, TransformerBlock


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
        (args.mla is not None, "latent attention"), (args.sandwich_norms, "sandwich norms"),
        (args.norm_offset, "offset norms"), (args.hidden_act != "silu", f"{args.hidden_act} MLP"),
        (args.attn_softcap is not None or args.attn_sinks, "capped or sunk attention"),
        (args.rope_dim != args.head_dim, "partial rotary"),
        (any(args.window(layer) is not None for layer in model.layer_ids), "sliding windows"),
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
    return moe is not None and moe.router == "softmax_topk" and moe.activation == "silu" and not moe.expert_bias


class NativeDecode:
    """The shard's layers registered once with the native step; `run` takes a step's rows."""

    def __init__(self, model: ShardModel, kernels: ModuleType, stack: Any, has_head: bool, prompts: bool):
        self.model, self.kernels, self.stack = model, kernels, stack
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
                                    args.rms_norm_eps, args.attn_scale or args.head_dim**-0.5)
        for layer in model.layers:
            parts = _layer_parts(layer, kernels)
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
                stack.set_head(model.norm.weight.detach(), head)
        return cls(model, kernels, stack, head is not None, prompts)

    def handles(self, layout: BatchLayout, h: torch.Tensor) -> bool:
        """Whether the native step runs this step: float32 rows, and every step where prompts run natively
        (batch-invariant), else those where every request adds one position."""
        return h.dtype == torch.float32 and (self.prompts or all(item.count == 1 for item in layout.items))

    def run(self, h: torch.Tensor, pool: KVPool, layout: BatchLayout, cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
        if pool is not self._pool:
            for i in range(len(self.model.layers)):
                keys, values = pool.layer(i)
                self.stack.set_pool(i, keys, values)
            self._pool = pool
        firsts, counts, slots = row_slots(layout)
        rows = h.shape[0]
        return self.stack.step(h, cos.reshape(rows, -1), sin.reshape(rows, -1),
                               torch.from_numpy(layout.write_slots), torch.from_numpy(firsts),
                               torch.from_numpy(counts), torch.from_numpy(slots))


    def head(self, h: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """The logits [S, vocab] of the step's sampled rows (has_head: the final norm and LM head are native)."""
        return self.stack.head(h, torch.from_numpy(layout.sample_rows))


def row_slots(layout: BatchLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each row's keys are: (first [rows], count [rows], slots), row r attending to
    slots[first[r] : first[r] + count[r]], its positions [0, its own]. A request's rows share its slot list."""
    seen = [item_slots(item) for item in layout.items]  # positions [0, end): no windows here
    starts = np.zeros(len(seen), dtype=np.int64)
    np.cumsum([len(s) for s in seen[:-1]], out=starts[1:])
    firsts = np.repeat(starts, [item.count for item in layout.items])
    counts = layout.positions.astype(np.int64) + 1
    return firsts, counts, np.concatenate(seen).astype(np.int64, copy=False)


def _layer_parts(layer: TransformerBlock, kernels: ModuleType) -> tuple | None:
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
    return (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
            None if qk is None else qk.q_norm.weight.detach(), None if qk is None else qk.k_norm.weight.detach(),
            *projections)


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
