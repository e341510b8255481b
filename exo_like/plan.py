"""A plan: which node runs which layers of which model, with a digest that every member must announce.

Pure data plus the fit check. The digest covers the model, the layer count, the stages and each member's
memory, so two nodes announce the same digest only if they computed the same ring from the same view.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

from exo_like.checkpoint import local_tensor_name, safetensors_header, weight_map
from exo_like.quantization import QUANTIZED_SUFFIXES
from exo_like.shard import Shard
from partitioning import NodeCapacity, Stage, plan_ring

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Plan:
    model_id: str
    n_layers: int
    stages: tuple[Stage, ...]
    memories: tuple[tuple[str, int], ...]  # (node id, memory bytes) of every member the plan was made from

    @cached_property  # read on every message of every request; the plan never changes
    def digest(self) -> str:
        body = json.dumps([self.model_id, self.n_layers, [(s.node_id, s.start_layer, s.end_layer)
                                                          for s in self.stages], self.memories])
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    @property
    def node_ids(self) -> list[str]:
        return [s.node_id for s in self.stages]

    def stage_index(self, node_id: str) -> int | None:
        for i, stage in enumerate(self.stages):
            if stage.node_id == node_id:
                return i
        return None

    def shard_for(self, node_id: str) -> Shard | None:
        index = self.stage_index(node_id)
        if index is None:
            return None
        stage = self.stages[index]
        return Shard(self.model_id, stage.start_layer, stage.end_layer, self.n_layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "n_layers": self.n_layers,
            "digest": self.digest,
            "stages": [{"node_id": s.node_id, "start_layer": s.start_layer, "end_layer": s.end_layer}
                       for s in self.stages],
        }


def make_plan(model_id: str, n_layers: int, members: list[NodeCapacity]) -> Plan:
    stages = plan_ring(n_layers, members)
    memories = tuple(sorted((m.node_id, m.memory_bytes) for m in members))
    return Plan(model_id, n_layers, tuple(stages), memories)


@dataclass(frozen=True)
class ModelFootprint:
    """Parameter bytes of a checkpoint as stored: per layer, plus embedding and head.

    For a quantized checkpoint, `unpacked` is the same checkpoint with every quantized matrix expanded to its
    float dtype: what a torch node holds, as it dequantizes at load (an MLX node keeps the packed form)."""

    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int  # final norm + LM head (0 extra for the head when embeddings are tied)
    tied: bool
    stored_dtype_bytes: int
    unpacked: "ModelFootprint | None" = None

    def shard_bytes(self, shard: Shard) -> int:
        total = sum(self.layer_bytes[shard.start_layer:shard.end_layer])
        if shard.is_first:
            total += self.embed_bytes
        if shard.is_last:
            total += self.head_bytes + (self.embed_bytes if self.tied and not shard.is_first else 0)
        return total

    def held_by(self, engine: str | None, dtype: str | None = None) -> "ModelFootprint":
        """The bytes a node running `engine` holds in memory, with its weights cast to `dtype` (None: as stored)."""
        held = self.unpacked if engine == "torch" and self.unpacked is not None else self
        if dtype is None or held.unpacked is not None:  # kept packed: integer matrices, which no cast changes
            return held
        return held._in_dtype(DTYPE_BYTES.get(dtype, held.stored_dtype_bytes))

    def _in_dtype(self, itemsize: int) -> "ModelFootprint":
        def scale(n: int) -> int:
            return n * itemsize // self.stored_dtype_bytes

        return ModelFootprint(tuple(scale(n) for n in self.layer_bytes), scale(self.embed_bytes),
                              scale(self.head_bytes), self.tied, itemsize)

    def to_json(self) -> dict[str, Any]:
        return {"layer_bytes": list(self.layer_bytes), "embed_bytes": self.embed_bytes,
                "head_bytes": self.head_bytes, "tied": self.tied, "stored_dtype_bytes": self.stored_dtype_bytes,
                "unpacked": self.unpacked.to_json() if self.unpacked is not None else None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelFootprint":
        unpacked = data.get("unpacked")  # absent in manifests saved before it was recorded
        return cls(tuple(int(n) for n in data["layer_bytes"]), int(data["embed_bytes"]), int(data["head_bytes"]),
                   bool(data["tied"]), int(data["stored_dtype_bytes"]),
                   cls.from_json(unpacked) if unpacked else None)


def model_footprint(model_dir: Path, n_layers: int, tied: bool, quant_bits: int | None = None) -> ModelFootprint:
    """Read sizes from the safetensors headers (no tensor data is read)."""
    files = sorted(set(weight_map(model_dir).values()))
    tensors = ((name, entry["dtype"], entry["data_offsets"][1] - entry["data_offsets"][0])
               for file in files for name, entry in safetensors_header(model_dir / file).items())
    return footprint_from_tensors(tensors, n_layers, tied, quant_bits)


def footprint_from_tensors(tensors: Iterable[tuple[str, str, int]], n_layers: int, tied: bool,
                           quant_bits: int | None = None) -> ModelFootprint:
    """The footprint of a checkpoint from its tensors' (name, safetensors dtype, stored bytes).

    Works from headers read locally or fetched from the hub, so a node can plan before it downloads.
    quant_bits: the checkpoint's quantization (see quantization.py), if it has one."""
    whole = Shard("footprint", 0, n_layers, n_layers)
    kept = []
    for name, dtype, size in tensors:
        local = local_tensor_name(name, whole, tied)
        if local is not None:
            kept.append((name, local, dtype, size))
    itemsizes = {4 if dtype == "F32" else 2 for _, _, dtype, _ in kept if dtype in ("F32", "BF16", "F16")}
    float_bytes = max(itemsizes) if itemsizes else 2
    stored = _sum_by_part(((name, local, size) for name, local, _, size in kept), n_layers, tied, float_bytes)
    if quant_bits is None:
        return stored
    unpacked = _sum_by_part(((name, local, _unpacked_bytes(name, dtype, size, quant_bits, float_bytes))
                             for name, local, dtype, size in kept), n_layers, tied, float_bytes)
    return ModelFootprint(stored.layer_bytes, stored.embed_bytes, stored.head_bytes, tied, float_bytes, unpacked)


def _unpacked_bytes(name: str, dtype: str, size: int, bits: int, float_bytes: int) -> int:
    """A packed matrix becomes size*8/bits floats; its scales and biases are folded into them."""
    if name.endswith(QUANTIZED_SUFFIXES):
        return 0
    if dtype == "U32" and name.endswith(".weight"):
        return size * 8 // bits * float_bytes
    return size


def _sum_by_part(sizes: Iterable[tuple[str, str, int]], n_layers: int, tied: bool, float_bytes: int) -> ModelFootprint:
    layers = [0] * n_layers
    embed = head = 0
    for name, local, size in sizes:
        if local.startswith("model.layers."):
            layers[int(name.split(".")[2])] += size
        elif local.startswith("model.embed_tokens."):
            embed += size
        else:
            head += size
    return ModelFootprint(tuple(layers), embed, head, tied, float_bytes)


@dataclass(frozen=True)
class Holder:
    """How a node holds its layers: its engine (a torch node unpacks a quantized model) and its --dtype."""

    engine: str | None = None
    dtype: str | None = None


def fit_problems(plan: Plan, footprint: ModelFootprint, holders: dict[str, Holder]) -> list[str]:
    """One sentence per node whose range needs more memory than it offers; empty when the plan fits.

    holders: how each node holds its layers (missing: as stored)."""
    memory = dict(plan.memories)
    problems = []
    total_needed = 0
    for stage in plan.stages:
        shard = plan.shard_for(stage.node_id)
        assert shard is not None
        holder = holders.get(stage.node_id, Holder())
        needed = footprint.held_by(holder.engine, holder.dtype).shard_bytes(shard)
        total_needed += needed
        if needed > memory[stage.node_id]:
            problems.append(f"node {stage.node_id} needs {needed} bytes for layers [{shard.start_layer}, "
                            f"{shard.end_layer}) but has {memory[stage.node_id]} bytes available")
    total_memory = sum(memory.values())
    if problems and total_needed > total_memory:
        problems.insert(0, f"the model needs {total_needed} bytes in total; the cluster has {total_memory} bytes")
    return problems
