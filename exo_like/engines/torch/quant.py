"""Quantized matrices on the PyTorch engine as modules, held quantized (no dequantized copy): QuantLinear and the
embeddings, over pieces of three kinds.

On CPU they run on the engine's native kernels (native/: codes at their own width, int16 activation blocks, as
llama.cpp runs them) where those could be built; otherwise on PyTorch's int4 kernel (int4.py). On CUDA they are
held in the same packed form on the GPU and run on Triton kernels (cuda/). Shapes the kernels refuse
(footprint.int4_refusal, native_refusal), other devices and types without an affine form (GGUF's Q2_K, Q3_K) are
dequantized by the engine instead (`Dense`; install.py decides): on CPU to bfloat16 (half float32's bytes, and
oneDNN's bfloat16 matmul is no slower there than float32's), elsewhere to the engine's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from exo_like.engines.torch.cuda.matrix import GpuMatrix
from exo_like.engines.torch.int4 import KERNEL_DTYPE, Int4Pack, NibbleCodes, PackLayout
from exo_like.engines.torch.native.build import kernels
from exo_like.engines.torch.native.matrix import HalfMatrix, NativeMatrix
from exo_like.models.affine import AffineGroups

def native_kernels(device: torch.device) -> ModuleType | None:
    """The native quantized kernels where they run (CPU) and could be built (else None: torch's int4 kernel)."""
    return kernels() if device.type == "cpu" else None


Piece = list[Int4Pack] | NativeMatrix | HalfMatrix | GpuMatrix | torch.Tensor
NATIVE_PIECES = (NativeMatrix, HalfMatrix)  # the native kernels' matrices: float32 activations in and out
MATRIX_PIECES = (*NATIVE_PIECES, GpuMatrix)  # matrices that hold their own tensors and give their rows


class QuantLinear(nn.Module):
    """x @ w.T (+ bias) with w held quantized or 16-bit: a native matrix (float32 activations), or int4 packs
    (activations cast to bfloat16 for the kernel, the result back to the input's dtype). `pieces` stack along the
    outputs, so a fused projection may mix quantized and (dequantized) dense matrices, as GGUF files mixing
    types per tensor need."""

    def __init__(self, pieces: list[Piece], bias: torch.Tensor | None):
        super().__init__()
        self.pieces = pieces
        self.bias = bias
        self.native = len(pieces) == 1 and isinstance(pieces[0], NATIVE_PIECES)
        self.gpu = len(pieces) == 1 and isinstance(pieces[0], GpuMatrix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native or self.gpu:  # the common cases, without the per-piece dispatch below
            out = self.pieces[0].matmul(x.float()).to(x.dtype) if self.native else self.pieces[0].matmul(x)
            return out if self.bias is None else out + self.bias
        x16 = x.to(KERNEL_DTYPE) if any(isinstance(p, list) or p.dtype == KERNEL_DTYPE for p in self.pieces
                                        if not isinstance(p, MATRIX_PIECES)) else None
        outputs = [self._piece(x, x16, piece) for piece in self.pieces]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return out if self.bias is None else out + self.bias

    @staticmethod
    def _piece(x: torch.Tensor, x16: torch.Tensor | None, piece: Piece) -> torch.Tensor:
        if isinstance(piece, GpuMatrix):
            return piece.matmul(x)
        if isinstance(piece, NATIVE_PIECES):
            return piece.matmul(x.float()).to(x.dtype)
        if isinstance(piece, torch.Tensor):
            return F.linear(x16 if piece.dtype == KERNEL_DTYPE else x.to(piece.dtype), piece).to(x.dtype)
        out = piece[0].matmul(x16).to(x.dtype)
        for pack in piece[1:]:
            out += pack.matmul(x16).to(x.dtype)
        return out

    def tensors(self) -> list[torch.Tensor]:
        """Everything this layer holds (for counting its memory)."""
        held = [] if self.bias is None else [self.bias]
        for piece in self.pieces:
            held += [piece] if isinstance(piece, torch.Tensor) else piece.tensors() \
                if isinstance(piece, MATRIX_PIECES) else [t for pack in piece for t in pack.tensors()]
        return held


class QuantHeads(nn.Module):
    """Latent attention's per-head projections (mla.PerHead) held quantized: x [R, heads, in] -> [R, heads, out],
    head h through its own matrix. Natively packed heads run in one parallel region (the kernels' rows_matmuls),
    others one by one."""

    def __init__(self, pieces: list[Piece]):
        super().__init__()
        self.pieces = pieces
        self.native = all(isinstance(p, NativeMatrix) for p in pieces)
        self.heads = [QuantLinear([piece], None) for piece in pieces]  # (a plain list: not submodules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            kernels = self.pieces[0].kernels
            outs = kernels.rows_matmuls([x[:, h].float().contiguous() for h in range(len(self.pieces))],
                                        [p.kernel_args() for p in self.pieces])
        else:
            outs = [head.forward(x[:, h]) for h, head in enumerate(self.heads)]
        return torch.stack(outs, dim=1).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return QuantLinear(self.pieces, None).tensors()


class QuantEmbedding(nn.Module):
    """Rows of an int4-packed embedding, dequantized on lookup (to float32, then the model's dtype). The codes
    are read from the packs in `layout`, or from `copies` (one per pack) when their layout is unknown."""

    def __init__(self, packs: list[Int4Pack], dtype: torch.dtype, layout: PackLayout | None,
                 copies: list[NibbleCodes] | None = None):
        super().__init__()
        if (layout is None) == (copies is None):
            raise ValueError("an embedding reads its codes from its packs (a layout) or from copies, not both")
        self.packs, self.dtype, self.layout, self.copies = packs, dtype, layout, copies

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = None
        for i, pack in enumerate(self.packs):
            codes = pack.codes(ids, self.layout) if self.copies is None else self.copies[i].codes(ids)
            part = pack.dequantized_rows(codes, ids)
            rows = part if rows is None else rows + part
        return rows.to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for pack in self.packs for t in pack.tensors()] + [c.packed for c in self.copies or []]


class NativeEmbedding(nn.Module):
    """Rows of a natively packed (or 16-bit, or GPU-held) embedding, dequantized on lookup (to float32, then the
    model's dtype)."""

    def __init__(self, matrix: NativeMatrix | HalfMatrix | GpuMatrix, dtype: torch.dtype):
        super().__init__()
        self.matrix, self.dtype = matrix, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.matrix.rows(ids).to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return self.matrix.tensors()


class CastEmbedding(nn.Module):
    """An embedding held in another dtype than the model's (a dequantized fallback): rows cast on lookup."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.weight_rows, self.dtype = weight, dtype  # not `weight`: that name would make it a parameter

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight_rows).to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight_rows]


@dataclass
class Dense:
    """A quantized matrix that no kernel here takes, dequantized (in Installer.dense_dtype), or a 16-bit
    checkpoint's matrix kept in its dtype beside float32 activations (engine.half_storage). With the native
    kernels either runs as a HalfMatrix."""

    weight: torch.Tensor


Matrix = AffineGroups | Dense | torch.Tensor


def stack_rows(parts: list[Matrix | list[Matrix]]) -> Matrix | list[Matrix]:
    """Matrices stacked along their outputs (q, k, v fused into one projection): one tensor or one AffineGroups
    when they share a form, else the list of pieces for a QuantLinear."""
    flat = [p for part in parts for p in (part if isinstance(part, list) else [part])]
    if all(isinstance(p, torch.Tensor) for p in flat):
        return torch.cat(flat)
    if all(isinstance(p, Dense) for p in flat):
        return Dense(torch.cat([p.weight for p in flat]))
    if all(isinstance(p, AffineGroups) and p.same_form(flat[0]) for p in flat):
        return AffineGroups.stack(flat)
    return flat
