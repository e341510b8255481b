"""Which tensors and files a shard needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exo_like.models.checkpoint import files_for_shard, local_tensor_name, plan_shard_load, weight_map
from exo_like.models.shard import Shard


def names(n_layers: int, tied: bool) -> list[str]:
    out = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    for i in range(n_layers):
        out += [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"]
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_every_tensor_lands_in_exactly_the_right_shards(tied: bool) -> None:
    shards = [Shard("m", 0, 2, 8), Shard("m", 2, 5, 8), Shard("m", 5, 8, 8)]
    for name in names(8, tied):
        owners = [s for s in shards if local_tensor_name(name, s, tied)]
        if name.startswith("model.layers."):
            assert len(owners) == 1
        elif name == "model.embed_tokens.weight":
            assert owners == ([shards[0], shards[2]] if tied else [shards[0]])
        else:
            assert owners == [shards[2]]


def test_layers_renumbered_from_zero() -> None:
    shard = Shard("m", 5, 8, 8)
    local = local_tensor_name("model.layers.6.mlp.down_proj.weight", shard, False)
    assert local == "model.layers.1.mlp.down_proj.weight"
    assert local_tensor_name("model.layers.4.mlp.down_proj.weight", shard, False) is None
    assert local_tensor_name("model.rotary_emb.inv_freq", shard, False) is None


def test_plan_uses_index_and_lists_only_needed_files(tmp_path: Path) -> None:
    weights = {name: f"part-{i % 3}.safetensors" for i, name in enumerate(names(4, False))}
    weights["model.layers.3.extra.weight"] = "part-9.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    assert weight_map(tmp_path) == weights
    shard = Shard("m", 0, 1, 4)
    plan = plan_shard_load(tmp_path, shard, tied_embeddings=False)
    expected_files = {f for n, f in weights.items() if n.startswith(("model.embed_tokens", "model.layers.0."))}
    assert {p.name for p in plan.files} == expected_files == files_for_shard(weights, shard, False)
    assert plan.tensor_count == 3


def test_missing_weights_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        weight_map(tmp_path)
