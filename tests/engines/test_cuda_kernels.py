"""The CUDA path's quantized matrices (engines/torch/cuda/), checked without a GPU: the Triton kernel runs under
Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET before anything imports triton).
Every code layout and form of factors the CPU path serves: the GPU matrix holds the native form's bytes (what
planning counts for a CUDA node), its rows are AffineGroups.dequantize's exactly, and its products are exact
arithmetic on the weights rounded to the activations' dtype, within that dtype's rounding of the result.
(bfloat16, a quantized CUDA node's activations, runs on a GPU only: the interpreter's numpy has no bfloat16;
bench/cuda_check.py checks it there.)"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it on Linux x86-64)")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1): these run its kernels on CPU tensors",
                allow_module_level=True)

from exo_like.engines.torch.cuda.matrix import GpuMatrix  # noqa: E402
from exo_like.engines.torch.native.matrix import form_of  # noqa: E402
from exo_like.models.affine import AffineGroups  # noqa: E402
from exo_like.models.footprint import native_bytes  # noqa: E402
from tests.engines.test_native_kernels import FORMS, random_groups  # noqa: E402

CPU = torch.device("cpu")
# (dtype, relative error of one rounding to it)
DTYPES = [(torch.float32, 2.0 ** -23), (torch.float16, 2.0 ** -10)]


def k_quant_groups(type_name: str, out: int = 24, inputs: int = 512) -> AffineGroups:
    """Random K-quant blocks as a GGUF file stores them, read as the engine reads them (scales kept as stored)."""
    from exo_like.models.gguf.blocks import DECODERS, affine_groups

    block_bytes = DECODERS[type_name][0]
    rng = np.random.default_rng(5)
    stored = rng.integers(0, 256, (out, inputs // 256 * block_bytes), dtype=np.uint8)
    blocks = stored.reshape(-1, block_bytes)
    d = (rng.random((blocks.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)  # finite scales
    for offset in ((208,) if type_name == "Q6_K" else (0, 2)):
        blocks[:, offset:offset + 2] = d
    return affine_groups(type_name, stored, (out, inputs))


CASES = {source + f"/{group}": (lambda b=bits, g=group, s=source: random_groups(b, g, s))
         for bits, group, source in FORMS}
CASES.update({name: (lambda n=name: k_quant_groups(n)) for name in ("Q4_K", "Q5_K", "Q6_K")})
# inputs that end inside a tile (tiles take 64 inputs a step): DeepSeek's 32-wide heads, 96-wide experts
CASES.update({"Q8_0/32 x 96": lambda: random_groups(8, 32, "Q8_0", inputs=96),
              "Q4_1/32 x 32": lambda: random_groups(4, 32, "Q4_1", inputs=32)})


@pytest.mark.parametrize("case", list(CASES))
def test_a_gpu_matrix_holds_the_stored_bits_and_gives_exact_rows(case):
    groups = CASES[case]()
    matrix = GpuMatrix.pack(groups, CPU)
    out, inputs = groups.shape
    assert matrix.shape == (out, inputs)
    held = sum(t.numel() * t.element_size() for t in matrix.tensors())
    assert held == native_bytes(groups.bits, groups.group_size, out, inputs, form_of(groups))
    assert torch.equal(matrix.rows(torch.arange(out)), torch.from_numpy(groups.dequantize()))
    picked = torch.tensor([3, 0, out - 1])
    assert torch.equal(matrix.rows(picked), torch.from_numpy(groups.dequantize())[picked])


@pytest.mark.parametrize("rows", [1, 5, 70])  # a decode step, a batch of them, a prompt's chunk past one tile
@pytest.mark.parametrize("dtype,rounding", DTYPES)
@pytest.mark.parametrize("case", ["Q4_0/32", "Q5_1/32", "Q8_0/32", "mxfp4/32", "mlx 4-bit/128", "mlx 6-bit/16",
                                  "mlx 3-bit/16", "Q4_K", "Q6_K", "Q8_0/32 x 96", "Q4_1/32 x 32"])
def test_the_kernel_multiplies_by_the_dequantized_weights(case, dtype, rounding, rows):
    groups = CASES[case]()
    matrix = GpuMatrix.pack(groups, CPU)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((rows, groups.shape[1]), dtype=np.float32))
    x = x.to(dtype)
    out = matrix.matmul(x)
    assert out.dtype == dtype and out.shape == (rows, groups.shape[0])
    weights = torch.from_numpy(groups.dequantize()).to(dtype).double()  # each weight rounded to the dtype
    exact = x.double() @ weights.T
    # float32 sums of the rounded products, then one rounding: within a few roundings of the largest magnitude
    bound = (4 * rounding + groups.shape[1] * 2.0 ** -24) * (x.double().abs() @ weights.abs().T)
    assert bool(((out.double() - exact).abs() <= bound + 1e-30).all())


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """Q8_0 files of a dense model and of DeepSeek V3 (its per-head projections quantized too)."""
    from tests.checkpoints import make_checkpoint
    from tests.gguf_checkpoints import write_gguf

    root = tmp_path_factory.mktemp("cuda-path")
    shapes = {"llama": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                        "num_key_value_heads": 2},
              "deepseek_v3": {"hidden_size": 128, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                              "qk_rope_head_dim": 16, "v_head_dim": 32, "intermediate_size": 192,
                              "moe_intermediate_size": 96}}
    return {arch: write_gguf(make_checkpoint(root / arch, arch, n_layers=2, seed=5, **shape),
                             root / f"{arch}-Q8_0.gguf", "Q8_0") for arch, shape in shapes.items()}


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_a_shard_on_the_gpu_kernels_holds_what_planning_counts_and_decodes_as_dequantized(gguf_files, arch,
                                                                                         monkeypatch):
    """The engine's CUDA path run on CPU tensors (the kernels interpreted, the native kernels turned off): every
    matrix held as a GpuMatrix (fused q/k/v and gate/up, the embedding's lookups, DeepSeek's per-head
    projections), the bytes a CUDA node's plan counts for it (but float tensors, float32 on CPU activations), and
    float32 products: the dequantized path's tokens wherever its choice is clear."""
    import exo_like.engines.torch.engine as torch_engine
    from exo_like.engines.choice import create_engine
    from exo_like.engines.torch.quant import NativeEmbedding, QuantHeads, QuantLinear
    from exo_like.models.gguf.hub import gguf_description
    from exo_like.models.shard import Shard
    from tests.engine_driver import agrees_where_clear

    path = gguf_files[arch]
    args, footprint = gguf_description(path)
    reference = create_engine("torch", device="cpu", dtype="float32")
    reference.load(path, args, Shard.whole(path.name, args.num_hidden_layers))
    monkeypatch.setattr(torch_engine, "native_kernels", lambda device: None)
    monkeypatch.setattr(torch_engine, "triton_available", lambda device: True)
    engine = create_engine("torch", device="cpu")
    engine.load(path, args, Shard.whole(path.name, args.num_hidden_layers))
    quantized = [m for m in engine.model.modules() if isinstance(m, (QuantLinear, QuantHeads, NativeEmbedding))]
    pieces = [p for m in quantized for p in (m.pieces if hasattr(m, "pieces") else [m.matrix])]
    assert pieces and all(isinstance(p, GpuMatrix) for p in pieces)
    assert isinstance(engine.model.embed_tokens, NativeEmbedding)
    assert not engine.weight_forms.dequantized
    floats = sum(t.numel() for t in engine.model.parameters())  # norms, routers: float32 here, bfloat16 on CUDA
    held = footprint.held_by("torch", None, "cuda").shard_bytes(engine.shard)
    assert engine.parameter_bytes() - 2 * floats == held
    agrees_where_clear(engine, reference, [3, 17, 29, 5, 11, 42, 7], 8)
