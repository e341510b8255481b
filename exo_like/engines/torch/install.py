"""Putting a shard's quantized matrices into its modules: each matrix on the native kernels where they take it,
else on torch's int4 kernel, else dequantized (counted, with the reason); and what the CPU changes in how the
engine computes (`cpu_numerics`, for the log and GET /v1/cluster)."""

from __future__ import annotations

import logging
from types import ModuleType

import numpy as np
import torch
from torch import nn

from exo_like.engines.base import WeightForms
from exo_like.engines.torch.cuda.matrix import GpuMatrix
from exo_like.engines.torch.cuda.matrix import refusal as gpu_refusal
from exo_like.engines.torch.int4 import (
    KERNEL_DTYPE,
    Int4Pack,
    NibbleCodes,
    check_layout,
    code_planes,
    int4_packs,
    pack_layout,
)
from exo_like.engines.torch.native.build import kernels
from exo_like.engines.torch.native.matrix import HalfMatrix, NativeMatrix
from exo_like.engines.torch.native.matrix import refusal as native_refusal
from exo_like.engines.torch.quant import (
    MATRIX_PIECES,
    CastEmbedding,
    Dense,
    Matrix,
    NativeEmbedding,
    Piece,
    QuantEmbedding,
    QuantHeads,
    QuantLinear,
)
from exo_like.engines.torch.mla import PerHead
from exo_like.models.affine import AffineGroups
from exo_like.models.footprint import int4_refusal

log = logging.getLogger(__name__)


def cpu_numerics() -> dict[str, str]:
    """What the CPU changes in how this engine computes, for the log and GET /v1/cluster: the capability ATen's
    kernels are built for (their vector width sets float32 reductions' order), the int4 pack layout, and whether
    the CPU multiplies bfloat16 natively (oneDNN then runs bfloat16 products on it; without it they are
    widened to float32)."""
    layout = pack_layout() if hasattr(torch, "_convert_weight_to_int4pack_for_cpu") else None
    native = kernels()
    return {"quantized_kernel": "torch int4 (no native kernels)" if native is None else
            f"native ({native.kernel_name()})",
            "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "int4_pack_layout": "unknown (a copy of the codes for lookups)" if layout is None else
            f"{layout.name} ({layout.block}-row blocks)",
            "bfloat16": _bfloat16_support()}


def _bfloat16_support() -> str:
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    native = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if capabilities.get(flag)]
    return f"native ({', '.join(native)})" if native else "widened to float32 (no AVX512-BF16 or AMX)"


class Installer:
    """Puts quantized modules into a ShardModel built on the meta device, from its state dict's quantized
    entries (AffineGroups, or lists of pieces), and counts what ran on the kernel and what was dequantized."""

    def __init__(self, dtype: torch.dtype, device: torch.device, use_kernel: bool, native: ModuleType | None = None,
                 gpu: bool = False):
        """use_kernel: torch's int4 kernel runs on this device; native: the native kernels (CPU), which then
        take every matrix they can; gpu: the Triton kernels (CUDA, cuda/), likewise."""
        self.dtype, self.device, self.use_kernel, self.native, self.gpu = dtype, device, use_kernel, native, gpu
        # On CPU the activations are float32, but a dequantized matrix is held in bfloat16 (half the bytes).
        self.dense_dtype = KERNEL_DTYPE if use_kernel else dtype
        self.forms = WeightForms()
        self._pieces: dict[int, Piece] = {}  # by id(AffineGroups)

    def dense(self, values: np.ndarray, why: str) -> Dense:
        """A dequantized matrix (`why`: its type and the reason it has no kernel, for the counts)."""
        self.forms.add_dequantized(why)
        return Dense(torch.from_numpy(values).to(device=self.device, dtype=self.dense_dtype))

    def install(self, model: nn.Module, state: dict[str, Matrix | list[Matrix]]) -> None:
        for name in [n for n, v in state.items() if not isinstance(v, torch.Tensor)]:
            value, path = state.pop(name), name.removesuffix(".weight")
            module = model.get_submodule(path)
            if isinstance(module, PerHead):
                self._per_head(model, path, module, value, state)
                continue
            pieces = [self._piece(p) for p in (value if isinstance(value, list) else [value])]
            if all(isinstance(p, torch.Tensor) and p.dtype == self.dtype for p in pieces):
                state[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                continue
            if isinstance(module, nn.Embedding):
                replacement: nn.Module = CastEmbedding(pieces[0], self.dtype) if isinstance(pieces[0], torch.Tensor) \
                    else NativeEmbedding(pieces[0], self.dtype) if isinstance(pieces[0], MATRIX_PIECES) \
                    else self._embedding(value, pieces[0])
            else:
                replacement = QuantLinear(pieces, state.pop(f"{path}.bias", None))
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, replacement)

    def _per_head(self, model: nn.Module, path: str, module: PerHead, value: Matrix,
                  state: dict[str, Matrix | list[Matrix]]) -> None:
        """Latent attention's per-head matrices: a quantized row stack [heads x out, in] as one piece a head
        (QuantHeads: each quantized, or dequantized as any matrix no kernel takes); one dequantized already
        (Dense, [heads, out, in]) as a plain weight."""
        if isinstance(value, Dense):
            state[f"{path}.weight"] = value.weight.to(self.dtype)
            return
        heads, outputs = module.weight.shape[0], module.weight.shape[1]
        counted, self.forms = self.forms, WeightForms()  # counted as one matrix, as MLX holds it, not one a head
        try:
            pieces = [self._convert(value.take_rows(h * outputs, (h + 1) * outputs)) for h in range(heads)]
        finally:
            each_head, self.forms = self.forms, counted
        for kind in each_head.quantized:
            self.forms.add_quantized(kind)
        for why in each_head.dequantized:
            self.forms.add_dequantized(why)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, QuantHeads(pieces))

    def _piece(self, matrix: Matrix) -> Piece:
        if isinstance(matrix, torch.Tensor):
            return matrix
        if isinstance(matrix, Dense):
            weight = matrix.weight
            if self.native is not None and weight.dtype in (torch.bfloat16, torch.float16):
                return HalfMatrix(weight.contiguous(), self.native)
            return weight
        if id(matrix) not in self._pieces:  # a tied embedding and head are one AffineGroups: one piece
            self._pieces[id(matrix)] = self._convert(matrix)
        return self._pieces[id(matrix)]

    def _convert(self, matrix: AffineGroups) -> Piece:
        if self.native is not None and native_refusal(matrix) is None:
            self.forms.add_quantized(matrix.source)
            return NativeMatrix.pack(matrix, self.native)
        if self.gpu and gpu_refusal(matrix) is None:
            self.forms.add_quantized(matrix.source)
            return GpuMatrix.pack(matrix, self.device)
        refusal = (gpu_refusal(matrix) if self.gpu else "no int4 kernel on this device") if not self.use_kernel else \
            int4_refusal(matrix.bits, matrix.group_size, matrix.shape[0])
        if refusal is not None:
            return self.dense(matrix.dequantize(), f"{matrix.source} ({refusal})").weight
        self.forms.add_quantized(matrix.source)
        return int4_packs(matrix)

    def _embedding(self, matrix: AffineGroups, packs: list[Int4Pack]) -> QuantEmbedding:
        codes = code_planes(matrix)
        layout = pack_layout()
        if layout is not None and all(check_layout(pack, c, layout) for pack, c in zip(packs, codes)):
            return QuantEmbedding(packs, self.dtype, layout)
        copies = [NibbleCodes(c) for c in codes]
        log.warning("held beyond the weights: a copy of the embedding's codes for lookups, %.1f MB (this torch "
                    "build packs int4 weights in a layout not read here)", sum(c.packed.nbytes for c in copies) / 1e6)
        return QuantEmbedding(packs, self.dtype, None, copies)
