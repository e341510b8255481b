"""Which tensors of a Hugging Face checkpoint a shard needs, and in which safetensors files they live.

The engines read tensors with their own framework; this module only decides what to read, so that a shard
opens only the files that hold its layers and keeps only its own tensors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from exo_like.models.shard import Shard

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass
class ShardLoadPlan:
    """files: safetensors path -> [(name in checkpoint, name in the shard's model)]."""

    files: dict[Path, list[tuple[str, str]]] = field(default_factory=dict)

    @property
    def tensor_count(self) -> int:
        return sum(len(names) for names in self.files.values())


def local_tensor_name(name: str, shard: Shard, tied_embeddings: bool,
                      rename: Callable[[str], str] | None = None) -> str | None:
    """Map a checkpoint tensor name to the shard's own name (layers renumbered from 0), or None if unneeded.
    rename: the family's renaming of a layer tensor (the part after `model.layers.N.`) to the shared names."""
    match = _LAYER_NAME.match(name)
    if match:
        layer = int(match.group(1))
        if shard.start_layer <= layer < shard.end_layer:
            rest = rename(match.group(2)) if rename is not None else match.group(2)
            return f"model.layers.{layer - shard.start_layer}.{rest}"
        return None
    if name.startswith("model.embed_tokens."):
        # A tied last stage uses the embedding matrix as its LM head.
        return name if shard.is_first or (shard.is_last and tied_embeddings) else None
    if name.startswith("model.norm.") or name.startswith("lm_head."):
        return name if shard.is_last else None
    return None


def weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> file name, from the index if there is one, else from the single file's header."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        return dict(json.loads(index_path.read_text())["weight_map"])
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {model_dir}")
    return {name: SINGLE_FILE for name in safetensors_header(single)}


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors header (reads only the header bytes)."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header


def files_for_shard(weights: dict[str, str], shard: Shard, tied_embeddings: bool) -> set[str]:
    """File names (relative to the model folder) that hold at least one tensor of the shard."""
    return {file for name, file in weights.items() if local_tensor_name(name, shard, tied_embeddings)}


def plan_shard_load(model_dir: Path, shard: Shard, tied_embeddings: bool,
                    rename: Callable[[str], str] | None = None) -> ShardLoadPlan:
    plan = ShardLoadPlan()
    for name, file in sorted(weight_map(model_dir).items()):
        local = local_tensor_name(name, shard, tied_embeddings, rename)
        if local is not None:
            plan.files.setdefault(model_dir / file, []).append((name, local))
    return plan
