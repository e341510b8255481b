"""GGUF files of the families beyond Llama/Qwen as llama.cpp's converter lays them out: the mixtures of experts
(Qwen3-MoE, Qwen2-MoE, Mixtral: experts stacked per projection, Mixtral as a `llama` file with experts), Phi-3
(q/k/v as `attn_qkv`, gate/up as `ffn_up`, its sliding window in the metadata), Gemma 2/3 and gpt-oss (expert
biases stacked beside the experts, sinks, YaRN in the metadata) and DeepSeek V2/V3 (`deepseek2`: latent attention's
kv_b_proj split into `attn_k_b` / `attn_v_b`, shared experts, V3's routing bias). Float files against transformers
on the Hugging Face checkpoint; quantized ones, dequantized (--dtype float32), against transformers on the values
the file holds."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from exo_like.models.config import ModelArgs, rope_attention_factor  # noqa: E402
from exo_like.models.gguf.file import open_gguf  # noqa: E402
from tests.checkpoints import (  # noqa: E402
    FUSED_ARCHITECTURES, GEMMA_ARCHITECTURES, MLA_ARCHITECTURES, MOE_ARCHITECTURES, PHI3_LONGROPE,
    SINK_ARCHITECTURES, make_checkpoint)
from tests.engine_driver import engine_greedy  # noqa: E402
from tests.gguf_checkpoints import write_gguf  # noqa: E402
from tests.oracle import Oracle, gguf_dequantized_greedy  # noqa: E402
from tests.native_kernels import NATIVE  # noqa: E402

from tests.gc_freeze import freeze_what_lives_now  # noqa: E402

# Collections skip what this file keeps (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("objects_kept_by_this_file_frozen", "earlier_tests_objects_frozen")

HAS_MLX = importlib.util.find_spec("mlx") is not None
CHAINS = {"torch": ["torch"], "mlx": ["mlx"], "torch+mlx+torch": ["torch", "mlx", "torch"]}
N_TOKENS = 48
PROMPT = [5 + (i * 37) % 600 for i in range(40)]
# llama.cpp has no dense layers among a Qwen3-MoE's sparse ones (its converter cannot map them): none here.
# llama.cpp's Gemma graphs imply the layers' pattern (Gemma 3: five sliding layers to one full: six layers here)
# and scale queries by 1/sqrt(head_dim): the checkpoints follow.
GGUF_OVERRIDES = {"qwen3_moe": {"mlp_only_layers": []}, "qwen2_moe": {}, "mixtral": {}, "phi3": {},
                  "gemma2": {"query_pre_attn_scalar": 16},
                  "gemma3_text": {"query_pre_attn_scalar": 16, "sliding_window_pattern": 6, "n_layers": 6},
                  "gpt_oss": {}, "deepseek_v3": {}, "deepseek_v2": {}}
ARCHITECTURES = (*MOE_ARCHITECTURES, *FUSED_ARCHITECTURES, *GEMMA_ARCHITECTURES, *SINK_ARCHITECTURES,
                 *MLA_ARCHITECTURES)
# K-quants take rows of 256: every matrix's input that long.
K_OVERRIDES = {
    "qwen3_moe": {"hidden_size": 256, "head_dim": 64, "intermediate_size": 256, "moe_intermediate_size": 256},
    "qwen2_moe": {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256,
                  "shared_expert_intermediate_size": 256},
    "mixtral": {"hidden_size": 256, "intermediate_size": 256},
    "phi3": {"hidden_size": 256, "intermediate_size": 256},
    "gemma2": {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64, "query_pre_attn_scalar": 64},
    "gemma3_text": {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64, "query_pre_attn_scalar": 64},
    "gpt_oss": {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64},
    "deepseek_v3": {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256, "q_lora_rank": 256,
                    "kv_lora_rank": 256, "qk_nope_head_dim": 64, "v_head_dim": 64},
    "deepseek_v2": {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256,
                    "kv_lora_rank": 256, "qk_nope_head_dim": 64, "v_head_dim": 64},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-gguf")

    @cache
    def folder(arch: str, k_sizes: bool) -> Path:
        overrides = {"n_layers": 4, **GGUF_OVERRIDES[arch], **(K_OVERRIDES[arch] if k_sizes else {})}
        return make_checkpoint(root / f"{arch}-{k_sizes}", arch, seed=5, **overrides)

    @cache
    def gguf(arch: str, kind: str) -> Path:
        hf = folder(arch, kind.endswith("_K"))
        return write_gguf(hf, root / f"{arch}-{kind}.gguf", kind)

    return folder, gguf


@cache
def transformers_tokens(folder: Path) -> list[int]:
    tokens = Oracle(folder).generate(tuple(PROMPT), N_TOKENS)
    freeze_what_lives_now()  # the modeling code transformers imported: the engines' loads need not walk it
    return tokens


def dequantized_tokens(path: Path, config_dir: Path) -> list[int]:
    tokens = gguf_dequantized_greedy(path, config_dir, PROMPT, N_TOKENS)
    freeze_what_lives_now()
    return tokens


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_config_comes_from_the_file_as_the_checkpoint_has_it(folders, arch) -> None:
    folder, gguf = folders
    from_file, from_folder = ModelArgs.from_dict(open_gguf(gguf(arch, "F32")).config()), ModelArgs.from_dir(
        folder(arch, False))
    assert from_file.model_type == from_folder.model_type == arch
    assert from_file.moe == from_folder.moe and from_file.mla == from_folder.mla
    assert (from_file.attn_scale or 0) == pytest.approx(from_folder.attn_scale or 0, rel=1e-6)
    assert from_file.context_length == min(from_folder.context_length, from_file.max_position_embeddings)


@pytest.mark.parametrize("chain", [c for c in CHAINS if HAS_MLX or "mlx" not in c])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_float_file_gives_transformers_tokens_on_the_checkpoint(folders, arch, chain) -> None:
    folder, gguf = folders
    expected = transformers_tokens(folder(arch, False))
    assert engine_greedy(gguf(arch, "F32"), CHAINS[chain], PROMPT, N_TOKENS) == expected
    assert len(set(expected)) > 10


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_quantized_file_dequantized_gives_transformers_tokens_on_its_values(folders, arch, kind) -> None:
    """--dtype float32 on a quantized file: each expert dequantized from its own bytes of the stack."""
    folder, gguf = folders
    path = gguf(arch, kind)
    expected = dequantized_tokens(path, folder(arch, kind.endswith("_K")))
    engines = ["torch", "mlx"] if HAS_MLX else ["torch"]
    assert engine_greedy(path, engines, PROMPT, N_TOKENS, dtype="float32") == expected
    assert len(set(expected)) > 10


@pytest.mark.parametrize("engine_name", ["torch", "mlx"] if HAS_MLX else ["torch"])
def test_quantized_experts_run_on_the_quantized_kernels(folders, engine_name) -> None:
    """A Q4_K Qwen2-MoE file loaded as is: every expert (and the shared expert) stays 4-bit; routers are float in
    the file, as llama-quantize leaves them, and so is the shared expert's one-output gate, which it stores as a
    vector. Torch holds each expert's gate and up as one matrix; MLX each projection's experts as one stack."""
    from exo_like.engines.choice import create_engine
    from exo_like.models.shard import Shard

    _, gguf = folders
    path = gguf("qwen2_moe", "Q4_K")
    args = ModelArgs.from_dict(open_gguf(path).config())
    engine = create_engine(engine_name, device="cpu")
    engine.load(path, args, Shard(path.name, 1, 3, 4))
    experts, layers = args.moe.n_experts, 2
    if engine_name == "torch":
        # per layer: qkv, o, each expert's gate_up and down, the shared expert's gate_up and down
        assert engine.weight_forms.quantized == {"Q4_K": layers * (2 + 2 * experts + 2)}
        assert engine.weight_forms.dequantized == {}
    else:
        assert engine.weight_forms.quantized == {"Q4_K": layers * (4 + 3 * experts + 3)}
        assert engine.weight_forms.dequantized == {}


def test_mxfp4_experts_read_exactly_and_stay_quantized(folders) -> None:
    """gpt-oss's GGUF files keep the experts in MXFP4 (power-of-two scale per 32, FP4 values): dequantized
    (--dtype float32) the file gives transformers' tokens on its values; loaded as is, every MXFP4 matrix stays
    quantized on both engines, as exact 5-bit affine groups (2 * value + 12, scale 2^(e - 128))."""
    from exo_like.engines.choice import create_engine
    from exo_like.models.shard import Shard

    folder, gguf = folders
    path = gguf("gpt_oss", "MXFP4")
    expected = dequantized_tokens(path, folder("gpt_oss", False))
    engines = ["torch", "mlx"] if HAS_MLX else ["torch"]
    assert engine_greedy(path, engines, PROMPT, N_TOKENS, dtype="float32") == expected
    args = ModelArgs.from_dict(open_gguf(path).config())
    matrices = 2 + 2 * args.moe.n_experts  # per layer: q/k/v, o, each expert's gate+up and down (torch's fusions)
    for engine_name in engines:
        engine = create_engine(engine_name, device="cpu")
        engine.load(path, args, Shard(path.name, 1, 3, 4))
        if engine_name == "mlx":  # q, k, v, o; each expert's gate, up and down (stacked once read)
            matrices = 4 + 3 * args.moe.n_experts
        assert engine.weight_forms.quantized == {"MXFP4": 2 * matrices}, engine_name
        assert engine.weight_forms.dequantized == {}, engine_name


def test_a_longrope_phi3_file_gives_transformers_tokens(tmp_path) -> None:
    """Phi-3-mini-128k's LongRoPE as llama.cpp's converter stores it (the factors as `rope_factors_long/short`
    tensors, the attention factor and original window in the metadata), with Phi-4-mini's partial rotary
    (`rope.dimension_count` below the head width): prompts past the original window, on both engines."""
    arch, overrides = PHI3_LONGROPE
    folder = make_checkpoint(tmp_path / "phi3-longrope", arch, n_layers=4, seed=5, **overrides)
    path = write_gguf(folder, tmp_path / "phi3-longrope.gguf", "F32")
    args, expected_args = ModelArgs.from_dict(open_gguf(path).config()), ModelArgs.from_dir(folder)
    assert args.rotary_dim == expected_args.rotary_dim == 12
    assert args.rope_scaling["long_factor"] == expected_args.rope_scaling["long_factor"]
    assert args.rope_scaling["attention_factor"] == pytest.approx(rope_attention_factor(expected_args), rel=1e-6)
    expected = transformers_tokens(folder)
    assert engine_greedy(path, ["torch", "mlx"] if HAS_MLX else ["torch"], PROMPT, N_TOKENS) == expected
    assert len(set(expected)) > 10


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss", *MLA_ARCHITECTURES])
def test_the_footprint_counts_what_each_engine_holds_of_a_quantized_file(folders, arch) -> None:
    """A Q4_K file's per-layer bytes as planning sees them (from the header) equal what each engine holds of a
    shard: MLX its quantized matrices, torch its int4 packs, torch --dtype float32 everything dequantized;
    DeepSeek's per-head projections (attn_k_b / attn_v_b) held as stored: quantized where a kernel takes them."""
    from exo_like.engines.choice import create_engine
    from exo_like.models.gguf.hub import gguf_description
    from exo_like.models.shard import Shard

    _, gguf = folders
    path = gguf(arch, "Q4_K")
    args, footprint = gguf_description(path)
    shard = Shard(path.name, 1, 3, args.num_hidden_layers)
    for engine_name, dtype in [("torch", None), ("torch", "float32"), *([("mlx", None)] if HAS_MLX else [])]:
        engine = create_engine(engine_name, device="cpu", dtype=dtype)
        engine.load(path, args, shard)
        assert footprint.held_by(engine_name, dtype, "cpu", NATIVE).shard_bytes(shard) == engine.parameter_bytes(), \
            (engine_name, dtype)
