"""A quantized matrix held on the GPU in its stored bits: the native kernels' packing (engines/torch/native/matrix.py:
codes at their own width, 16-bit or K-quant factors, nothing re-rounded), rows not interleaved, so its bytes are
the native form's (footprint.native_bytes) and planning counts them. Multiplied by the Triton kernel (kernels.py);
rows for an embedding's lookups are dequantized with torch's own ops."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from exo_like.engines.torch.native.matrix import BYTES, HIGH2, NIBBLES, NativeMatrix, form_of
from exo_like.engines.torch.native.matrix import refusal as native_refusal
from exo_like.models.affine import AffineGroups

HALF, SYMMETRIC, K, K_SYMMETRIC = 0, 1, 2, 3  # as kernels.py
_ROW_MAJOR = SimpleNamespace(row_block=lambda: 1)  # NativeMatrix.pack's kernels, asked only how rows interleave


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels run on this device: CUDA with Triton installed (CUDA torch ships it). (Under
    Triton's interpreter, TRITON_INTERPRET=1, they run on CPU tensors too: the tests' path, not a node's.)"""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def refusal(groups: AffineGroups) -> str | None:
    """Why the GPU kernels cannot hold this matrix (None if they can): the native form's conditions."""
    return native_refusal(groups)


# Tiles by rows of activations: a decode step's few rows fill one tile of 16 (tl.dot's smallest), prompts larger.
TILES = ((16, (16, 64, 64)), (64, (64, 64, 64)), (None, (128, 128, 64)))


@dataclass
class GpuMatrix:
    """One quantized matrix [out, in] on the GPU, as the kernels read it."""

    low: torch.Tensor
    high: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    super_scales: torch.Tensor
    super_biases: torch.Tensor
    zero: float
    bits: int
    group_size: int
    factors: int  # HALF, SYMMETRIC, K, K_SYMMETRIC

    @classmethod
    def pack(cls, groups: AffineGroups, device: torch.device) -> "GpuMatrix":
        packed = NativeMatrix.pack(groups, _ROW_MAJOR)
        form = form_of(groups)
        factors = {"half": HALF, "half-symmetric": SYMMETRIC, "k": K, "k-symmetric": K_SYMMETRIC}.get(form, HALF)
        if form == "float32":  # a K-quant slice across its super-blocks: plain float32 scales and biases
            factors = HALF
        tensors = [t.to(device) for t in (packed.low, packed.high, packed.scales, packed.biases, packed.super_scales,
                                          packed.super_biases)]
        return cls(*tensors, packed.zero, packed.bits, packed.group_size, factors)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * self.group_size

    @property
    def layout(self) -> int:
        return NIBBLES if self.bits <= 4 else HIGH2 if self.bits <= 6 else BYTES

    @property
    def per_super(self) -> int:
        return self.scales.shape[1] // self.super_scales.shape[1] if self.super_scales.numel() else 1

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] (bfloat16 on a quantized CUDA node) -> x @ w.T [rows, out], in x's dtype."""
        from exo_like.engines.torch.cuda.kernels import launch

        x = x.contiguous()
        out = torch.empty(x.shape[0], self.shape[0], dtype=x.dtype, device=x.device)
        tile = next(t for rows, t in TILES if rows is None or x.shape[0] <= rows)
        launch(x, self, out, *tile)
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized: float32 [n, in], as AffineGroups.dequantize gives them."""
        codes = self.codes(ids).float()
        n, inputs = codes.shape
        scales, biases = self.row_factors(ids)
        groups = codes.view(n, -1, self.group_size)
        return (scales[..., None] * groups + biases[..., None]).view(n, inputs)

    def codes(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the codes, uint8 [n, in]."""
        low = self.low.index_select(0, ids)
        if self.layout == BYTES:
            return low
        n = low.shape[0]
        blocks = low.view(n, -1, 16)
        codes = torch.cat((blocks & 15, blocks >> 4), dim=-1).view(n, -1)
        if self.layout == HIGH2:
            high = self.high.index_select(0, ids).view(n, -1, 8)
            top = torch.cat([(high >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1).view(n, -1)
            codes = codes | (top << 4)
        return codes

    def row_factors(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and biases [n, groups] of rows `ids`, float32."""
        scales = self.scales.index_select(0, ids).float()
        if self.factors in (K, K_SYMMETRIC):
            scales = scales * self.super_scales.index_select(0, ids).repeat_interleave(self.per_super, dim=1)
        if self.factors == K:
            biases = self.biases.index_select(0, ids).float() * \
                self.super_biases.index_select(0, ids).repeat_interleave(self.per_super, dim=1)
        elif self.factors == HALF:
            biases = self.biases.index_select(0, ids).float()
        else:
            biases = -self.zero * scales
        return scales, biases

    def tensors(self) -> list[torch.Tensor]:
        return [self.low, self.high, self.scales, self.biases, self.super_scales, self.super_biases]
