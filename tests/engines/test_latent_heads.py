"""DeepSeek's per-head projections (families/deepseek.py): kv_b_proj split at load into embed_q [heads, rank, nope] and
unembed_out [heads, v, rank], held in their stored precision on both engines: from an mlx-lm conversion (which stores
them so, quantized), from a GGUF file (attn_k_b / attn_v_b), and from a quantized kv_b_proj (its value rows stay
quantized; MLX multiplies its key rows transposed as stored, torch dequantizes them, and says so). Each loaded form
gives its reference's greedy tokens (mlx-lm; transformers on the file's dequantized values) and holds the bytes
its footprint says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from exo_like.engines.choice import create_engine
from exo_like.models.config import ModelArgs
from exo_like.models.footprint import model_footprint
from exo_like.models.gguf.file import open_gguf
from exo_like.models.gguf.hub import gguf_description
from exo_like.models.shard import Shard
from tests.checkpoints import make_checkpoint
from tests.engine_driver import Driver, agrees_where_clear, engine_greedy
from tests.native_kernels import NATIVE
from tests.oracle import gguf_dequantized_greedy

# Collections skip what this file keeps (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("objects_kept_by_this_file_frozen", "earlier_tests_objects_frozen")

HAS_MLX = importlib.util.find_spec("mlx") is not None
N_TOKENS = 16
PROMPT = [3, 17, 29, 5, 11, 42, 7, 19, 23, 2, 31, 13]
# Every per-head matrix's inputs a multiple of 32: quantized in GGUF's blocks and in MLX groups of 32.
SHAPE = {"hidden_size": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
         "intermediate_size": 192, "moe_intermediate_size": 96}
SPECIFIC = {"deepseek_v3": {"q_lora_rank": 64}, "deepseek_v2": {}}
GROUP_SIZE = 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each architecture's float checkpoint, and (`-hub`) the same with its config as the Hub writes it, which
    mlx-lm reads."""
    root = tmp_path_factory.mktemp("latent-heads")
    return {f"{arch}{suffix}": make_checkpoint(root / f"{arch}{suffix}", arch, n_layers=3, seed=5,
                                               hub_style_config=bool(suffix), **SHAPE, **extra)
            for arch, extra in SPECIFIC.items() for suffix in ("", "-hub")}


def per_head_modules(engine) -> list[str]:  # noqa: ANN001
    """The class of each layer's embed_q and unembed_out."""
    layers = engine.model.layers if engine.name == "torch" else engine._model.model.layers
    return sorted({type(getattr(layer.self_attn, name)).__name__ for layer in layers
                   for name in ("embed_q", "unembed_out")})


def greedy(engine, n_tokens: int = N_TOKENS) -> list[int]:  # noqa: ANN001
    driver, tokens, inputs = Driver([engine]), [], np.array(PROMPT, dtype=np.int64)
    for _ in range(n_tokens):
        tokens.append(int(np.argmax(driver.forward("r", inputs))))
        inputs = np.array([tokens[-1]], dtype=np.int64)
    return tokens


@pytest.mark.parametrize("arch", list(SPECIFIC))
def test_a_quantized_gguf_holds_the_per_head_projections_quantized(folders, tmp_path, arch):
    from tests.gguf_checkpoints import write_gguf

    path = write_gguf(folders[arch], tmp_path / "model-Q8_0.gguf", "Q8_0")
    assert {open_gguf(path).tensors[f"model.layers.1.self_attn.{name}.weight"].type_name
            for name in ("embed_q", "unembed_out")} == {"Q8_0"}
    expected = gguf_dequantized_greedy(path, folders[arch], PROMPT, N_TOKENS)
    args, footprint = gguf_description(path)
    for engine_name in ["torch", "mlx"] if HAS_MLX else ["torch"]:
        engine = create_engine(engine_name, device="cpu")
        engine.load(path, args, Shard.whole(path.name, args.num_hidden_layers))
        assert per_head_modules(engine) == (["QuantHeads"] if engine_name == "torch" else ["QuantizedPerHead"])
        assert not engine.weight_forms.dequantized
        held = footprint.held_by(engine_name, None, "cpu", NATIVE).shard_bytes(engine.shard)
        assert held == engine.parameter_bytes(), engine_name
        gguf = open_gguf(path)
        weights = {(index, name): gguf.read(f"model.layers.{index}.self_attn.{name}.weight")
                   for index in range(args.num_hidden_layers) for name in ("embed_q", "unembed_out")}
        if engine_name == "torch":
            torch_heads_hold(engine, weights)
        else:
            mlx_heads_hold(engine, weights)
    assert engine_greedy(path, ["torch"], PROMPT, N_TOKENS, dtype="float32") == expected  # the dequantized path
    quantized, reference = (create_engine("torch", device="cpu", dtype=dtype) for dtype in (None, "float32"))
    for engine in (quantized, reference):
        engine.load(path, args, Shard.whole(path.name, args.num_hidden_layers))
    agrees_where_clear(quantized, reference, PROMPT, N_TOKENS)  # the quantized kernels, on the same CPU


def torch_heads_hold(engine, weights: dict) -> None:  # noqa: ANN001
    """Each head's matrix holds exactly `weights[(layer, name)][head]` (its rows, dequantized by its kernel), and
    the module's product is each head's own product, bit for bit (one parallel region, the same kernel)."""
    import torch

    for index, layer in enumerate(engine.model.layers, start=engine.shard.start_layer):
        for name in ("embed_q", "unembed_out"):
            module = getattr(layer.self_attn, name)
            if (index, name) not in weights or not hasattr(module, "pieces"):
                continue  # not asked about, or held dense
            expected = torch.from_numpy(weights[index, name])
            x = torch.randn(3, expected.shape[0], expected.shape[2])
            out = module(x)
            for head, (piece, own) in enumerate(zip(module.pieces, module.heads)):
                if hasattr(piece, "rows"):
                    assert torch.equal(piece.rows(torch.arange(expected.shape[1])), expected[head]), (name, head)
                assert torch.equal(out[:, head], own.forward(x[:, head])), (name, head)


def mlx_heads_hold(engine, weights: dict) -> None:  # noqa: ANN001
    """Each head's stored matrix is the file's (up to the bfloat16 scales MLX keeps), and the batched product of
    every head is each head's own quantized product, bit for bit."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    for index, layer in enumerate(engine._model.model.layers, start=engine.shard.start_layer):
        for name in ("embed_q", "unembed_out"):
            module, weight = getattr(layer.self_attn, name), weights[index, name]
            stored = np.array(mx.dequantize(module.weight, module.scales, module.biases, group_size=module.group_size,
                                            bits=module.bits).astype(mx.float32))
            assert np.abs(stored - weight).max() <= 2 ** -6 * np.abs(weight).max(), name
            x = mx.array(rng.standard_normal((weight.shape[0], 3, weight.shape[2])).astype(np.float32))
            x = x.astype(module.scales.dtype)
            out = module(x)
            for head in range(weight.shape[0]):
                alone = mx.quantized_matmul(x[head], module.weight[head], module.scales[head], module.biases[head],
                                            transpose=not module.transposed, group_size=module.group_size,
                                            bits=module.bits, mode=module.mode)
                assert mx.array_equal(out[head], alone).item(), (name, head)


# (mlx-lm's V2 model reads a YaRN rope_scaling that V2-Lite's config does not have: V3 only)
@pytest.mark.parametrize("arch", ["deepseek_v3"])
def test_an_mlx_lm_conversion_runs_its_quantized_heads_on_both_engines(folders, tmp_path, arch):
    """mlx-lm stores embed_q and unembed_out themselves, quantized (3-D, with their scales and biases): the MLX
    engine gives mlx-lm's tokens; torch holds every head quantized on its kernels, each head exactly the values
    its dequantized path (--dtype float32) holds, and that path gives mlx-lm's tokens."""
    pytest.importorskip("mlx_lm", reason="mlx-lm (converts the checkpoint, the oracle) is not installed")
    from mlx_lm.convert import convert

    from tests.engines.test_mlx_engine import mlx_lm_greedy

    quantized = tmp_path / "mlx-q4"
    convert(str(folders[f"{arch}-hub"]), mlx_path=str(quantized), quantize=True, q_group_size=GROUP_SIZE, q_bits=4,
            dtype="float32")
    args = ModelArgs.from_dir(quantized)
    expected = mlx_lm_greedy(quantized, np.array(PROMPT, dtype=np.int64))[:N_TOKENS]
    footprint = model_footprint(quantized, args.num_hidden_layers, args.tie_word_embeddings, args.quant)
    engines = {}
    for engine_name, dtype, modules in (("mlx", None, ["QuantizedPerHead"]), ("torch", None, ["QuantHeads"]),
                                        ("torch", "float32", ["PerHead"])):
        engine = engines[engine_name, dtype] = create_engine(engine_name, device="cpu", dtype=dtype)
        engine.load(quantized, args, Shard.whole(quantized.name, args.num_hidden_layers))
        assert per_head_modules(engine) == modules
        held = footprint.held_by(engine_name, dtype, "cpu", NATIVE).shard_bytes(engine.shard)
        assert held == engine.parameter_bytes(), (engine_name, dtype)
        if (engine_name, dtype) != ("torch", None):
            assert greedy(engine) == expected, (engine_name, dtype)
    dequantized = {(index, name): getattr(layer.self_attn, name).weight.numpy()
                   for index, layer in enumerate(engines["torch", "float32"].model.layers)
                   for name in ("embed_q", "unembed_out")}
    torch_heads_hold(engines["torch", None], dequantized)  # every head quantized, holding mlx-lm's values


def test_a_quantized_kv_b_proj_keeps_its_value_rows_quantized(folders, tmp_path):
    """A checkpoint holding kv_b_proj itself quantized (MLX-format conversions before mlx-lm split it, GGUF files
    before llama.cpp's converter did; written here by quantizing the float file's kv_b_proj with mx.quantize):
    MLX multiplies the key rows transposed as stored and the value rows as stored (nothing requantized: the
    tokens are those of the same values dequantized); torch holds the value rows quantized and the key rows
    dequantized, counted so."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (install the 'mlx' extra)")
    import json

    import mlx.core as mx
    import torch
    from safetensors.numpy import load_file, save_file

    source, out = folders["deepseek_v3"], tmp_path / "kv-b-q4"
    out.mkdir()
    tensors, dequantized = load_file(str(source / "model.safetensors")), {}
    for name in [n for n in tensors if n.endswith("kv_b_proj.weight")]:
        packed, scales, biases = mx.quantize(mx.array(tensors[name]), group_size=GROUP_SIZE, bits=4)
        prefix = name.removesuffix(".weight")
        tensors[name] = np.array(packed)
        tensors[f"{prefix}.scales"], tensors[f"{prefix}.biases"] = np.array(scales), np.array(biases)
        dequantized[name] = np.array(mx.dequantize(packed, scales, biases, group_size=GROUP_SIZE, bits=4))
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4}
    config["quantization"].update({name.removesuffix(".weight"): False for name in tensors
                                   if name.endswith(".weight") and f"{name.removesuffix('.weight')}.scales"
                                   not in tensors})
    (out / "config.json").write_text(json.dumps(config))
    for extra in source.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            (out / extra.name).write_bytes(extra.read_bytes())
    reference = tmp_path / "dequantized"  # the float checkpoint with kv_b_proj's dequantized values
    reference.mkdir()
    floats = load_file(str(source / "model.safetensors"))
    floats.update(dequantized)
    save_file(floats, str(reference / "model.safetensors"))
    for extra in source.iterdir():
        if extra.name != "model.safetensors":
            (reference / extra.name).write_bytes(extra.read_bytes())
    reference_args = ModelArgs.from_dir(reference)
    one = create_engine("torch", device="cpu", dtype="float32")
    one.load(reference, reference_args, Shard.whole(reference.name, reference_args.num_hidden_layers))
    expected = greedy(one)

    args = ModelArgs.from_dir(out)
    mlx_engine = create_engine("mlx", device="cpu")
    mlx_engine.load(out, args, Shard.whole(out.name, args.num_hidden_layers))
    assert per_head_modules(mlx_engine) == ["QuantizedPerHead"]
    assert {layer.self_attn.embed_q.transposed for layer in mlx_engine._model.model.layers} == {True}
    assert greedy(mlx_engine) == expected
    torch_engine = create_engine("torch", device="cpu")
    torch_engine.load(out, args, Shard.whole(out.name, args.num_hidden_layers))
    assert per_head_modules(torch_engine) == ["PerHead", "QuantHeads"]
    assert list(torch_engine.weight_forms.dequantized) == \
        ["mlx 4-bit (DeepSeek's key rows of kv_b_proj, used transposed)"]
    reference_path = create_engine("torch", device="cpu", dtype="float32")  # everything dequantized
    reference_path.load(out, args, Shard.whole(out.name, args.num_hidden_layers))
    assert greedy(reference_path) == expected
    torch_heads_hold(torch_engine, {(index, "unembed_out"): layer.self_attn.unembed_out.weight.numpy()
                                    for index, layer in enumerate(reference_path.model.layers)})
    for held, dequantized in zip(torch_engine.model.layers, reference_path.model.layers):
        assert torch.equal(held.self_attn.embed_q.weight, dequantized.self_attn.embed_q.weight)
