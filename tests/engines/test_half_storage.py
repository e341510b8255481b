"""bfloat16 and float16 checkpoints on a CPU node (engine.half_storage): their matrices stay in their 16-bit dtype,
activations run in float32, and the native kernels widen each weight as they read it (native/half.cpp). So the
results are those of float32 arithmetic on the stored values: the same as a float32 engine loading the same file,
up to summation order. A --dtype keeps its meaning (bfloat16 activations throughout); without the native kernels
the node runs as before. Skipped where no C++ compiler built the kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exo_like.engines.torch.engine import TorchEngine
from exo_like.engines.torch.native import build
from exo_like.engines.torch.native.matrix import HalfMatrix
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from tests.checkpoints import make_checkpoint
from tests.engines.test_native_kernels import _decode_logits

KERNELS = build.kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no native kernels here (no C++ compiler)")
PROMPT = np.arange(3, 40, dtype=np.int64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_the_product_is_the_float32_product_of_the_stored_values(dtype, rows) -> None:
    """Few rows (a decode step) and many (a prompt: widened chunks and a GEMM; 3000 outputs of 896 inputs span
    several chunks), against float64 arithmetic on the same values."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(3000, 896, generator=generator).to(dtype)
    x = torch.randn(rows, 896, generator=generator)
    reference = x.double() @ weight.double().T
    got = KERNELS.half_matmul(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, 3000)
    # float32 sums of 896 products: a few units in the last place of the largest output
    np.testing.assert_allclose(got.double().numpy(), reference.numpy(), rtol=0,
                               atol=1e-5 * float(reference.abs().max()))


def test_the_matrix_must_be_16_bit_and_match_the_activations() -> None:
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        KERNELS.half_matmul(torch.ones(1, 32), torch.ones(8, 32))
    with pytest.raises(RuntimeError, match="width"):
        KERNELS.half_matmul(torch.ones(1, 16), torch.ones(8, 32, dtype=torch.bfloat16))


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def half_dir(request, tmp_path_factory):
    """Grouped-query attention with per-head q/k norms (Qwen3) stored in a 16-bit dtype."""
    return make_checkpoint(tmp_path_factory.mktemp("half"), "qwen3", n_layers=3, seed=3, peaky=True,
                           dtype=request.param), request.param


def load(folder, dtype: str | None) -> TorchEngine:
    args = ModelArgs.from_dir(folder)
    engine = TorchEngine(device="cpu", dtype=dtype)
    engine.load(folder, args, Shard.whole("t", args.num_hidden_layers))
    return engine


def test_a_16_bit_checkpoint_computes_what_float32_does_on_its_values(half_dir) -> None:
    folder, stored = half_dir
    engine, exact = load(folder, None), load(folder, "float32")
    assert (engine.half, engine.dtype_name) == (stored, "float32")
    qkv = engine.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.pieces[0], HalfMatrix) and qkv.pieces[0].weight.dtype == stored
    assert engine.model.native_decode is not None and engine.model.native_decode.has_head
    tokens, logits = _decode_logits(engine, PROMPT, 12)
    exact_tokens, exact_logits = _decode_logits(exact, PROMPT, 12)
    assert tokens == exact_tokens and len(set(tokens)) > 2
    np.testing.assert_allclose(logits, exact_logits, rtol=1e-5, atol=1e-4)  # as the native step vs Python layers
    # Half float32's bytes: the matrices at two bytes each, the vectors (norms) in float32.
    assert engine.parameter_bytes() < 0.55 * exact.parameter_bytes()


def test_the_prompt_path_and_the_python_layers_agree_with_the_native_step(half_dir) -> None:
    """The Python layers (prefill's, and a decode step's where the native step is off) run the same products."""
    folder, _ = half_dir
    engine = load(folder, None)
    native_tokens, native_logits = _decode_logits(engine, PROMPT, 6)
    engine.model.native_decode = None
    python_tokens, python_logits = _decode_logits(engine, PROMPT, 6)
    assert native_tokens == python_tokens
    np.testing.assert_allclose(native_logits, python_logits, rtol=1e-5, atol=1e-4)


def test_a_named_dtype_keeps_its_meaning(half_dir) -> None:
    folder, _ = half_dir
    engine = load(folder, "bfloat16")
    assert engine.half is None and engine.dtype_name == "bfloat16"
    assert engine.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16


def test_without_native_kernels_a_bfloat16_checkpoint_runs_in_bfloat16(half_dir, monkeypatch) -> None:
    folder, stored = half_dir
    monkeypatch.setenv(build.DISABLE, "0")
    build.kernels.cache_clear()
    try:
        engine = load(folder, None)
    finally:
        monkeypatch.delenv(build.DISABLE)
        build.kernels.cache_clear()
    assert engine.half is None and engine.dtype_name == "bfloat16"  # (float16 as bfloat16 on CPU, as before)
