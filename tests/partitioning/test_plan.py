"""Plans: digests agree when views agree, footprints come from headers, fit errors name bytes per node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from exo_like.models.config import ModelArgs
from exo_like.models.footprint import ModelFootprint, footprint_from_tensors, model_footprint
from exo_like.models.quantization import QuantSpec
from exo_like.models.shard import Shard
from partitioning import NodeCapacity
from partitioning.plan import Holder, fit_problems, make_plan
from tests.checkpoints import make_checkpoint
from tests.native_kernels import NATIVE

GIB = 1 << 30


def test_digest_same_for_same_view_in_any_order_and_differs_otherwise() -> None:
    nodes = [NodeCapacity("a", 6 * GIB), NodeCapacity("b", 3 * GIB), NodeCapacity("c", GIB)]
    plan = make_plan("m", 7, nodes)
    assert plan.digest == make_plan("m", 7, nodes[::-1]).digest
    assert plan.digest != make_plan("m", 7, nodes[:2]).digest
    assert plan.digest != make_plan("other", 7, nodes).digest
    assert plan.digest != make_plan("m", 7, [NodeCapacity("a", 6 * GIB + 1), *nodes[1:]]).digest
    assert plan.to_json()["stages"] == [{"node_id": "a", "start_layer": 0, "end_layer": 4},
                                        {"node_id": "b", "start_layer": 4, "end_layer": 6},
                                        {"node_id": "c", "start_layer": 6, "end_layer": 7}]
    assert plan.shard_for("b") == Shard("m", 4, 6, 7) and plan.shard_for("zz") is None


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2", "qwen2", n_layers=4, max_shard_size="60KB")


def tensor_bytes(model_dir: Path, predicate) -> int:
    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if predicate(name):
                    tensor = f.get_tensor(name)
                    total += tensor.numel() * tensor.element_size()
    return total


def test_footprint_matches_tensor_bytes(tied_checkpoint: Path) -> None:
    args = ModelArgs.from_dir(tied_checkpoint)
    footprint = model_footprint(tied_checkpoint, 4, args.tie_word_embeddings)
    assert footprint.layer_bytes[2] == tensor_bytes(tied_checkpoint, lambda n: n.startswith("model.layers.2."))
    embed = tensor_bytes(tied_checkpoint, lambda n: n.startswith("model.embed_tokens."))
    norm = tensor_bytes(tied_checkpoint, lambda n: n.startswith("model.norm."))
    last = Shard("m", 3, 4, 4)
    assert footprint.shard_bytes(last) == footprint.layer_bytes[3] + norm + embed  # tied head = embedding
    assert footprint.held_by("torch", "bfloat16").shard_bytes(last) == footprint.shard_bytes(last) // 2


@pytest.mark.parametrize("engine_name", ["torch", "mlx"])
def test_footprint_in_a_chosen_dtype_is_what_the_engine_holds(tied_checkpoint: Path, engine_name: str) -> None:
    pytest.importorskip(engine_name)
    from exo_like.engines import create_engine

    args = ModelArgs.from_dir(tied_checkpoint)
    footprint = model_footprint(tied_checkpoint, 4, args.tie_word_embeddings)
    for dtype in (None, "float32", "bfloat16", "float16"):
        for shard in (Shard("m", 0, 1, 4), Shard("m", 1, 3, 4), Shard("m", 3, 4, 4)):
            engine = create_engine(engine_name, device="cpu", dtype=dtype)
            engine.load(tied_checkpoint, args, shard)
            held = footprint.held_by(engine_name, dtype, native=NATIVE).shard_bytes(shard)
            assert held == engine.parameter_bytes(), (dtype, shard)


def test_the_fit_check_counts_a_nodes_dtype(tied_checkpoint: Path) -> None:
    args = ModelArgs.from_dir(tied_checkpoint)
    footprint = model_footprint(tied_checkpoint, 4, args.tie_word_embeddings)  # a float32 checkpoint
    whole = footprint.shard_bytes(Shard("m", 0, 4, 4))
    plan = make_plan("m", 4, [NodeCapacity("a", whole * 3 // 4)])
    assert fit_problems(plan, footprint, {"a": Holder("torch", "bfloat16")}) == []
    assert fit_problems(plan, footprint, {"a": Holder("torch")}) == [
        f"the model needs {whole} bytes in total; the cluster has {whole * 3 // 4} bytes",
        f"node a needs {whole} bytes for layers [0, 4) but has {whole * 3 // 4} bytes available"]


def test_fit_problems_name_bytes_per_node(tied_checkpoint: Path) -> None:
    args = ModelArgs.from_dir(tied_checkpoint)
    footprint = model_footprint(tied_checkpoint, 4, args.tie_word_embeddings)
    roomy = make_plan("m", 4, [NodeCapacity("a", GIB), NodeCapacity("b", GIB)])
    assert fit_problems(roomy, footprint, {}) == []
    tight = make_plan("m", 4, [NodeCapacity("a", 1000), NodeCapacity("b", 1000)])
    problems = fit_problems(tight, footprint, {})
    assert problems[0].startswith("the model needs") and "the cluster has 2000 bytes" in problems[0]
    needed_a = footprint.shard_bytes(tight.shard_for("a"))
    assert f"node a needs {needed_a} bytes for layers [0, 2) but has 1000 bytes available" in problems


def test_a_quantized_footprint_survives_the_manifest_cache_and_older_manifests_still_load() -> None:
    # A 4-bit MLX checkpoint, groups of 64: a [128, 64] embedding and a [256, 64] up projection.
    tensors = [("model.embed_tokens.weight", "U32", 4096, (128, 8)),
               ("model.embed_tokens.scales", "BF16", 256, (128, 1)),
               ("model.embed_tokens.biases", "BF16", 256, (128, 1)),
               ("model.layers.0.mlp.up_proj.weight", "U32", 8192, (256, 8)),
               ("model.layers.0.mlp.up_proj.scales", "BF16", 512, (256, 1)),
               ("model.layers.0.mlp.up_proj.biases", "BF16", 512, (256, 1)),
               ("model.layers.0.input_layernorm.weight", "BF16", 128, (64,)), ("model.norm.weight", "BF16", 128, (64,))]
    footprint = footprint_from_tensors(tensors, 1, True, QuantSpec(64, 4))
    assert footprint.layer_bytes == (8192 + 512 + 512 + 128,)
    # Dequantized (a float --dtype): each stored byte holds two 4-bit values, each becomes a float of that dtype.
    assert footprint.held_by("torch", "bfloat16").layer_bytes == (8192 * 2 * 2 + 128,)
    assert footprint.held_by("torch", "float32").embed_bytes == 4096 * 2 * 4
    # The torch CPU kernel: half a byte per weight and a bfloat16 scale and zero per group of 64; norms in float32.
    assert footprint.held_by("torch").layer_bytes == (256 * 64 // 2 + 256 * 4 + 64 * 4,)
    # A CUDA node holds the same packing on the GPU (engines/torch/cuda/), its float tensors in bfloat16.
    assert footprint.held_by("torch", device="cuda:0").layer_bytes == (256 * 64 // 2 + 256 * 2 * 2 + 64 * 2,)
    def sizes(f: ModelFootprint) -> tuple:
        return f.layer_bytes, f.embed_bytes, f.head_bytes

    assert sizes(footprint.held_by("mlx")) == sizes(footprint.held_by("mlx", "float32")) == sizes(footprint)
    assert ModelFootprint.from_json(json.loads(json.dumps(footprint.to_json()))) == footprint
    saved_earlier = {k: v for k, v in footprint.to_json().items() if k not in ("unpacked", "quantized")}
    assert ModelFootprint.from_json(saved_earlier).held_by("torch").layer_bytes == footprint.layer_bytes
    assert footprint_from_tensors(tensors, 1, True).held_by("torch") == footprint_from_tensors(tensors, 1, True)


