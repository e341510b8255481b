"""A tensor-parallel rank's slice of an MLX shard's tensors (models/tensor_split.py's rules), quantized matrices
too: a packed matrix's words, scales and biases slice together, by whole quantization groups of its inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from exo_like.models.config import ModelArgs
from exo_like.models.tensor_split import TensorSplit, split_tensor


@dataclass(frozen=True)
class PackedGroups:
    """A quantized matrix [..., out, in] as MLX holds it: uint32 words of `bits`-bit codes and a scale (and bias)
    per `group_size` inputs, stacked in front by expert or by head. Sliced as tensor_split slices AffineGroups."""

    weight: mx.array
    scales: mx.array
    biases: mx.array | None  # (MXFP4 has none)
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)

    def take_rows(self, start: int, end: int) -> "PackedGroups":
        return self._map(lambda t: t[..., start:end, :])

    def take_inputs(self, start: int, end: int) -> "PackedGroups":
        if start % self.group_size or end % self.group_size:
            raise ValueError(f"inputs [{start}, {end}) do not fall on groups of {self.group_size}")
        words, groups = 32 // self.bits, self.group_size
        weight = self.weight[..., start // words:end // words]
        return PackedGroups(weight, self.scales[..., start // groups:end // groups],
                            None if self.biases is None else self.biases[..., start // groups:end // groups],
                            self.bits, self.group_size)

    def __getitem__(self, index: Any) -> "PackedGroups":
        """Entries of the stack in front (a rank's heads)."""
        return self._map(lambda t: t[index])

    def _map(self, part: Any) -> "PackedGroups":
        return PackedGroups(part(self.weight), part(self.scales), None if self.biases is None else part(self.biases),
                            self.bits, self.group_size)


def rank_tensors(weights: dict[str, mx.array], specs: dict[str, dict[str, Any]], args: ModelArgs,
                 split: TensorSplit) -> dict[str, mx.array]:
    """The rank's slice of the shard's tensors. Fused projections come split already (read_shard_tensors splits
    them by the whole model's head counts, which a fused matrix's rows follow), so each part slices by its own
    rule, as models/tensor_split.unfused would have it. Row-parallel splits fall on `split.align` (the
    checkpoint's quantization groups)."""
    ranked: dict[str, mx.array] = {}
    for path, spec in specs.items():
        if f"{path}.weight" not in weights:
            continue
        packed = PackedGroups(weights.pop(f"{path}.weight"), weights.pop(f"{path}.scales"),
                              weights.pop(f"{path}.biases", None), spec["bits"], spec["group_size"])
        part = split_tensor(f"{path}.weight", packed, args, split)
        ranked[f"{path}.weight"], ranked[f"{path}.scales"] = part.weight, part.scales
        if part.biases is not None:
            ranked[f"{path}.biases"] = part.biases
    ranked.update((name, split_tensor(name, array, args, split)) for name, array in weights.items())
    return ranked
