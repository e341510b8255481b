"""Reading a shard's tensors for the torch engine: exactly the plan's tensors from exactly the plan's files, in the
engine's dtype; a quantized checkpoint's matrices kept as AffineGroups, MLX-format expert stacks split per
expert, and a 16-bit checkpoint's matrices kept 16-bit where the engine holds them so (engine.half_storage)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch
from safetensors import safe_open

from exo_like.engines.base import check_cancel
from exo_like.engines.torch.quant import Dense, Matrix
from exo_like.models.affine import AffineGroups, from_mlx, from_mlx_mxfp4
from exo_like.models.checkpoint import ShardLoadPlan
from exo_like.models.families.deepseek import PER_HEAD
from exo_like.models.quantization import QuantSpec

HALF_DTYPES = (torch.bfloat16, torch.float16)
PER_HEAD_MODULES = tuple(f".{name}" for name in PER_HEAD)


def hold_half(weights: dict[str, Matrix]) -> dict[str, Matrix]:
    """A half-storage shard's matrices (2-D tensors read in a 16-bit dtype) as Dense, for the native kernels."""
    return {name: Dense(t) if isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype in HALF_DTYPES else t
            for name, t in weights.items()}


def read_planned_tensors(
    plan: ShardLoadPlan, skip: set[str], device: torch.device, dtype: torch.dtype, quant: QuantSpec | None = None,
    cancel: threading.Event | None = None, keep_quantized: bool = False,
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None, half: bool = False,
) -> dict[str, torch.Tensor | AffineGroups | Dense]:
    """Read exactly the plan's tensors from exactly the plan's files, converted to the engine's device/dtype.

    A quantized checkpoint's matrices come as AffineGroups with `keep_quantized`, else dequantized here, one at
    a time, so only the packed shard plus one float matrix is ever held beyond the result. `convert`: the
    family's own checkpoint layout to the shared one (Family.convert). `half`: matrices stored in a 16-bit
    dtype stay in it, as Dense (see half_storage)."""
    weights: dict[str, torch.Tensor] = {}
    stored_as: dict[str, str] = {}  # local name -> checkpoint name (per-module quantization is by the latter)
    for path, names in plan.files.items():
        wanted = [(name, local) for name, local in names if name not in skip]
        if not wanted:
            continue
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name, local in wanted:
                check_cancel(cancel)
                # get_tensor may return a view of the file's memory map; a private copy lets the mapping close,
                # so resident memory ends at the shard's bytes instead of also keeping the file pages mapped.
                tensor = f.get_tensor(name)
                # Packed tensors keep their stored form (a copy still) until all parts of a matrix are read.
                kept = tensor.dtype if half and tensor.dim() == 2 and tensor.dtype in HALF_DTYPES else dtype
                weights[local] = tensor.clone() if quant else tensor.to(device=device, dtype=kept, copy=True)
                stored_as[local] = name
    if convert is not None:
        weights = convert(weights)
    if quant is None:
        return unstack_experts(hold_half(weights) if half else weights)
    held: dict[str, torch.Tensor | AffineGroups] = {}
    for name in [n for n in weights if n.endswith(".scales")]:
        prefix = name.removesuffix(".scales")
        # By the stored name (per-module settings name checkpoint modules); a converted tensor keeps its own.
        spec = quant.for_module(stored_as.get(name, name).removesuffix(".scales"))
        packed, scales = weights.pop(f"{prefix}.weight"), weights.pop(name)
        biases = None if spec.mxfp4 else weights.pop(f"{prefix}.biases")
        if prefix.endswith(PER_HEAD_MODULES):  # DeepSeek's per-head projections: one row stack of their heads
            packed, scales, biases = (t.reshape(-1, t.shape[-1]) for t in (packed, scales, biases))
        stacked = packed.dim() == 3  # an MLX-format mixture's experts, [experts, out, in]: one matrix each
        for index in range(packed.shape[0]) if stacked else (None,):
            part = (lambda t: t[index]) if stacked else (lambda t: t)  # noqa: E731
            if spec.mxfp4:
                groups = from_mlx_mxfp4(part(packed).contiguous().view(torch.uint8).numpy(), part(scales).numpy())
            else:
                groups = from_mlx(part(packed).view(torch.int32).numpy().view(np.uint32),
                                  part(scales).float().numpy(), part(biases).float().numpy(), spec.bits,
                                  spec.group_size, scales.dtype in (torch.float16, torch.bfloat16))
            held[f"{prefix}.weight" if index is None else expert_name(prefix, index)] = groups if keep_quantized \
                else torch.from_numpy(groups.dequantize()).to(device=device, dtype=dtype)
    held.update((name, tensor.to(device=device, dtype=dtype)) for name, tensor in weights.items())
    return unstack_experts(held)


def expert_name(stack: str, expert: int, kind: str = "weight") -> str:
    """`...mlp.switch_mlp.up_proj` (MLX-format experts, stacked) -> `...mlp.experts.{expert}.up_proj.weight`."""
    module, _, projection = stack.rpartition(".switch_mlp.")
    return f"{module}.experts.{expert}.{projection}.{kind}"


def unstack_experts(weights: dict[str, Matrix]) -> dict[str, Matrix]:
    """A float mixture's stacked experts ([experts, out, in] under `switch_mlp`, and their biases [experts, out])
    as one matrix each, the names the torch engine's experts take; each expert a contiguous copy of its own."""
    for name in [n for n in weights if ".switch_mlp." in n and n.endswith((".weight", ".bias"))]:
        stack = weights.pop(name)
        prefix, _, kind = name.rpartition(".")
        for index in range(stack.shape[0]):
            weights[expert_name(prefix, index, kind)] = stack[index].clone(memory_format=torch.contiguous_format)
    return weights


def checkpoint_skips(plan: ShardLoadPlan, tied_embeddings: bool) -> set[str]:
    """A tied model's stored LM head (and, when quantized, its scales and biases) duplicates the embedding,
    which is what we use."""
    if not tied_embeddings:
        return set()
    return {name for names in plan.files.values() for name, _ in names if name.startswith("lm_head.")}
