"""Quantized MLX checkpoints (mlx-community layout, made here with mlx-lm's own `convert`): the MLX engine runs
them quantized and matches mlx-lm's greedy tokens; the torch engine dequantizes them with mx.dequantize's exact
arithmetic, so mixed torch + MLX chains give the same tokens from the same folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (install the 'mlx' extra)")
torch = pytest.importorskip("torch", reason="torch is not installed (install the 'torch' extra)")
pytest.importorskip("mlx_lm", reason="mlx-lm (the test oracle) is not installed")

import mlx.nn as nn  # noqa: E402

from exo_like.engines.choice import create_engine  # noqa: E402
from exo_like.errors import UnsupportedModelError  # noqa: E402
from exo_like.models.affine import from_mlx, pack_words  # noqa: E402
from exo_like.models.config import ModelArgs  # noqa: E402
from exo_like.models.footprint import model_footprint  # noqa: E402
from exo_like.models.quantization import BITS, QuantSpec, quant_spec  # noqa: E402
from exo_like.models.shard import Shard  # noqa: E402
from partitioning import NodeCapacity  # noqa: E402
from partitioning.plan import Holder, fit_problems, make_plan  # noqa: E402
from tests.checkpoints import (  # noqa: E402
    built_once, make_checkpoint)
from tests.engine_driver import Driver  # noqa: E402
from tests.engines.test_mixed_chain import chain_greedy  # noqa: E402
from tests.engines.test_mlx_engine import N_LAYERS, SEED, UNEVEN_SHARDS, greedy, mlx_lm_greedy, prompt_ids  # noqa: E402
from tests.native_kernels import NATIVE  # noqa: E402

# Collections skip what this file keeps (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("objects_kept_by_this_file_frozen", "earlier_tests_objects_frozen")

GROUP_SIZE, Q_BITS = 64, 4
# name -> (architecture, make_checkpoint keyword arguments). Hub-style configs, so mlx-lm reads rope as written.
# qwen2 keeps intermediate_size 160, not a multiple of the group size: its down_proj stays float, as converters
# leave such layers, so the checkpoint mixes quantized and float matrices.
CASES = {
    "llama": ("llama", {"intermediate_size": 192}),
    "qwen2": ("qwen2", {}),
    # mlx-lm stacks the experts (`switch_mlp`) and keeps the routers at 8 bits (per-module settings in the config)
    "qwen3_moe": ("qwen3_moe", {}),
}
CHAINS = {"mlx-torch-mlx": ("mlx", "torch", "mlx"), "torch-mlx-torch": ("torch", "mlx", "torch")}


def quantize_checkpoint(float_dir: Path, out_dir: Path) -> Path:
    from mlx_lm.convert import convert

    convert(str(float_dir), mlx_path=str(out_dir), quantize=True, q_group_size=GROUP_SIZE, q_bits=Q_BITS,
            dtype="float32")
    return out_dir


@pytest.fixture(scope="session")
def quantized_dir(tmp_path_factory) -> Callable[[str], Path]:
    def build(name: str, path: Path) -> Path:
        arch, kwargs = CASES[name]
        float_dir = make_checkpoint(path.with_name(f"{name}-float"), arch, n_layers=N_LAYERS, seed=SEED,
                                    hub_style_config=True, **kwargs)
        return quantize_checkpoint(float_dir, path)

    return built_once(tmp_path_factory.mktemp("quantized_checkpoints"), build)


@pytest.fixture(scope="session")
def reference_tokens(quantized_dir) -> Callable[[str], list[int]]:
    done: dict[str, list[int]] = {}

    def get(name: str) -> list[int]:
        if name not in done:
            path = quantized_dir(name)
            done[name] = mlx_lm_greedy(path, prompt_ids(path))
            assert len(set(done[name])) > 1, "degenerate reference continuation; pick another seed or prompt"
        return done[name]

    return get


def load(engine_name: str, path: Path, start: int, end: int):
    args = ModelArgs.from_dir(path)
    engine = create_engine(engine_name, device="cpu", dtype="float32")
    engine.load(path, args, Shard(path.name, start, end, args.num_hidden_layers))
    return engine


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_is_in_the_mlx_community_layout(quantized_dir, name):
    path = quantized_dir(name)
    config = json.loads((path / "config.json").read_text())
    assert {k: config["quantization"][k] for k in ("group_size", "bits")} == {"group_size": 64, "bits": 4}
    tensors = mx.load(str(path / "model.safetensors"))
    q_proj = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{q_proj}.weight"].dtype == mx.uint32
    assert {f"{q_proj}.scales", f"{q_proj}.biases", "model.embed_tokens.scales"} <= set(tensors)


@pytest.mark.parametrize("name", list(CASES))
def test_mlx_engine_runs_quantized_and_matches_mlx_lm(quantized_dir, reference_tokens, name):
    path = quantized_dir(name)
    whole = load("mlx", path, 0, N_LAYERS)
    assert isinstance(whole._model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(whole._model.model.embed_tokens, nn.QuantizedEmbedding)
    assert greedy(Driver([whole]), prompt_ids(path)) == reference_tokens(name)
    chain = [load("mlx", path, start, end) for start, end in UNEVEN_SHARDS]
    assert greedy(Driver(chain), prompt_ids(path)) == reference_tokens(name)


@pytest.mark.parametrize("chain_name", list(CHAINS))
@pytest.mark.parametrize("name", list(CASES))
def test_mixed_chain_on_one_quantized_folder_matches_mlx_lm(quantized_dir, reference_tokens, name, chain_name):
    path = quantized_dir(name)
    chain = [load(engine, path, start, end) for engine, (start, end) in zip(CHAINS[chain_name], UNEVEN_SHARDS)]
    assert [engine.name for engine in chain] == list(CHAINS[chain_name])
    assert chain_greedy(chain, prompt_ids(path)) == reference_tokens(name)


def test_an_mlx_format_mixture_is_held_as_its_footprint_says(quantized_dir):
    """Stacked experts and 8-bit routers: each engine holds, per shard, the bytes the footprint (planning) counts;
    torch splits the stacks into one matrix per expert, its int4 packs with the routers dequantized (8 outputs)."""
    path = quantized_dir("qwen3_moe")
    args = ModelArgs.from_dir(path)
    assert args.quant.for_module("model.layers.0.mlp.gate") == QuantSpec(64, 8)
    footprint = model_footprint(path, N_LAYERS, args.tie_word_embeddings, args.quant)
    for engine_name, dtype in (("torch", None), ("torch", "float32"), ("mlx", None)):
        for start, end in UNEVEN_SHARDS:
            engine = create_engine(engine_name, device="cpu", dtype=dtype)
            engine.load(path, args, Shard(path.name, start, end, N_LAYERS))
            shard = Shard(path.name, start, end, N_LAYERS)
            held = footprint.held_by(engine_name, dtype, native=NATIVE).shard_bytes(shard)
            assert held == engine.parameter_bytes(), (engine_name, dtype, start, end)
    assert engine.weight_forms.quantized.get("mlx 8-bit", 0) == sum(args.is_sparse_layer(i) for i in range(start, end))


def test_torch_shard_holds_the_dequantized_matrices(quantized_dir):
    path = quantized_dir("qwen2")
    engine = load("torch", path, 0, N_LAYERS)
    tensors = mx.load(str(path / "model.safetensors"))
    prefix = "model.layers.2.self_attn.k_proj"
    expected = mx.dequantize(tensors[f"{prefix}.weight"], tensors[f"{prefix}.scales"], tensors[f"{prefix}.biases"],
                             GROUP_SIZE, Q_BITS)
    q_dim = ModelArgs.from_dir(path).num_attention_heads * ModelArgs.from_dir(path).head_dim
    k_rows = engine.model.layers[2].self_attn.qkv_proj.dense_weight()[q_dim:q_dim + expected.shape[0]]
    assert np.array_equal(k_rows.numpy(), np.array(expected))
    # The tied head is the dequantized embedding itself.
    assert engine.model.lm_head.weight is engine.model.embed_tokens.weight


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_is_mx_dequantize_bit_for_bit(bits, group_size):
    w = mx.random.normal((48, 256), key=mx.random.key(bits * 1000 + group_size))
    packed, scales, biases = mx.quantize(w, group_size, bits)
    expected = np.array(mx.dequantize(packed, scales, biases, group_size, bits))
    groups = from_mlx(np.array(packed), np.array(scales), np.array(biases), bits, group_size)
    ours = groups.dequantize()
    assert ours.dtype == np.float32
    assert np.array_equal(ours, expected)
    assert np.array_equal(pack_words(groups.codes, bits), np.array(packed))


@pytest.mark.parametrize("entry, hint", [
    ({"group_size": 64, "bits": 4, "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 7}}, "bits=7"),
    ({"group_size": 64, "bits": 4, "lora": True}, "unknown quantization setting"),
    ({"quant_method": "gptq", "bits": 4}, "gptq"),
    ({"group_size": 64, "bits": 4, "mode": "mxfp4"}, "mxfp4"),
    ({"group_size": 32, "bits": 8, "mode": "mxfp8"}, "mxfp8"),
    ({"group_size": 64, "bits": 7}, "bits=7"),
])
def test_other_quantization_forms_are_rejected_clearly(entry, hint):
    with pytest.raises(UnsupportedModelError, match=hint) as caught:
        quant_spec(entry)
    assert caught.value.code == "unsupported_quantization"


def test_uniform_entry_is_accepted():
    assert quant_spec({"group_size": 64, "bits": 4, "mode": "affine"}) == QuantSpec(64, 4)
    assert quant_spec({"group_size": 32, "bits": 4, "mode": "mxfp4"}) == QuantSpec(32, 4, mode="mxfp4")
    hub_gpt_oss = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    assert quant_spec(hub_gpt_oss) == QuantSpec(32, 4, mode="mxfp4")
    assert quant_spec(None) is None


def test_per_module_settings_of_a_mixed_precision_conversion_are_read(quantized_dir, tmp_path):
    """mlx-lm names the modules it quantized otherwise (a mixture's routers at 8 bits); `false` marks one left
    float."""
    config = json.loads((quantized_dir("llama") / "config.json").read_text())
    config["quantization"]["model.layers.0.mlp.down_proj"] = {"group_size": 32, "bits": 8}
    config["quantization"]["model.layers.1.mlp.down_proj"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    quant = ModelArgs.from_dir(tmp_path).quant
    assert quant.for_module("model.layers.0.mlp.down_proj") == QuantSpec(32, 8)
    assert quant.for_module("model.layers.2.mlp.down_proj") == QuantSpec(64, 4)
    assert ModelArgs.from_dir(quantized_dir("llama")).quant == QuantSpec(64, 4)


def test_the_registry_serves_a_quantized_folder(quantized_dir, tmp_path):
    from exo_like.models.names.model_registry import ModelRegistry

    registry = ModelRegistry(tmp_path / "home", tmp_path / "cache", "node-a", lambda _: None)
    model = registry.resolve(str(quantized_dir("qwen2")))
    assert model.args.quant == QuantSpec(64, 4)


def test_a_torch_node_and_an_mlx_node_serve_one_quantized_folder_as_mlx_lm_does(quantized_dir, reference_tokens,
                                                                               tmp_path):
    """The issue's ring, as processes: a torch node (dequantizing) and an MLX node (quantized) on one folder."""
    from tokenizers import Tokenizer

    from tests.api_server import stop_nodes
    from tests.cluster_harness import cluster_of, start_cluster, wait_until_ready

    path = quantized_dir("llama")
    expected = reference_tokens("llama")
    nodes = start_cluster(tmp_path, str(path), [2, 1], engines=["torch", "mlx"],
                          extra=("--placement", "memory"))  # both hold layers, whatever their measured speeds
    try:
        wait_until_ready(nodes, members=2)
        assert [n["engine"] for n in cluster_of(nodes[0])["nodes"]] == ["torch", "mlx"]
        body = json.dumps({"model": path.name, "prompt": prompt_ids(path).tolist(), "max_tokens": len(expected),
                           "temperature": 0, "ignore_eos": True}).encode()
        status, _, raw = nodes[1].request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert status == 200, raw
        text = json.loads(raw)["choices"][0]["text"]
        assert text == Tokenizer.from_file(str(path / "tokenizer.json")).decode(expected)
    finally:
        stop_nodes(nodes)


def test_the_fit_check_counts_what_each_engine_holds(quantized_dir):
    # Each engine holds a quantized checkpoint its own way: MLX as stored, torch on CPU in int4 packs (this
    # checkpoint's fused qkv has 617 outputs, which the kernel refuses: dequantized to float32), and torch with
    # a float --dtype fully dequantized. The plan's fit check must count what each holds, or it hands a node
    # layers that exhaust its memory.
    path = quantized_dir("qwen2")
    args = ModelArgs.from_dir(path)
    footprint = model_footprint(path, N_LAYERS, args.tie_word_embeddings, args.quant)
    for start, end in ((0, 1), (1, N_LAYERS - 1), (N_LAYERS - 1, N_LAYERS), (0, N_LAYERS)):
        shard = Shard(path.name, start, end, N_LAYERS)
        for engine_name, dtype in (("torch", None), ("mlx", None), ("torch", "float32")):
            engine = create_engine(engine_name, device="cpu", dtype=dtype)
            engine.load(path, args, shard)
            held = footprint.held_by(engine_name, dtype, "cpu", NATIVE).shard_bytes(shard)
            assert held == engine.parameter_bytes(), (engine_name, dtype, shard)
    whole = Shard(path.name, 0, N_LAYERS, N_LAYERS)
    stored, unpacked = footprint.shard_bytes(whole), footprint.held_by("torch", "float32").shard_bytes(whole)
    assert unpacked > 2 * stored  # 4-bit weights (with float32 scales and some float matrices) unpacked to float32
    memory = (stored + unpacked) // 2
    plan = make_plan("m", N_LAYERS, [NodeCapacity("t", memory)])
    assert fit_problems(plan, footprint, {"t": Holder("mlx")}) == []
    assert fit_problems(plan, footprint, {"t": Holder("torch", None, "cpu")}) == []
    problems = fit_problems(plan, footprint, {"t": Holder("torch", "float32")})
    assert f"node t needs {unpacked} bytes for layers [0, {N_LAYERS}) but has {memory} bytes available" in problems
