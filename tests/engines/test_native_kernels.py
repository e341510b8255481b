"""The torch engine's native CPU kernels (engines/torch/native): the quantized product against a float64
statement of the same arithmetic, dequantized rows against AffineGroups, batch invariance, the one-call decode
step against the Python layers, and the fallback without them. Skipped where no C++ compiler built them: the
engine then runs torch's kernels, which the rest of the suite covers alike."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from exo_like.engines.activations import Activations
from exo_like.engines.torch.engine import TorchEngine
from exo_like.engines.torch.native import build
from exo_like.engines.torch.native.matrix import (
    NativeMatrix,
    form_of,
    interleave,
    layout_of,
    quantize_activations,
    reference_matmul,
)
from exo_like.models.affine import AffineGroups
from exo_like.models.config import ModelArgs
from exo_like.models.footprint import native_bytes
from exo_like.models.shard import Shard
from tests.checkpoints import make_checkpoint
from tests.engine_driver import Driver

KERNELS = build.kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no native kernels here (no C++ compiler)")

# (bits, group size, source): every code layout, groups of 16 to 128, float16 and bfloat16 scales, with biases
# and symmetric (Q4_0, Q5_0, Q8_0, MXFP4: bias = -zero * scale).
FORMS = [(4, 32, "Q4_0"), (4, 32, "Q4_1"), (5, 32, "Q5_0"), (5, 32, "Q5_1"), (8, 32, "Q8_0"), (5, 32, "mxfp4"),
         (4, 64, "mlx 4-bit"), (4, 128, "mlx 4-bit"), (6, 16, "mlx 6-bit"), (8, 64, "mlx 8-bit"),
         (3, 16, "mlx 3-bit"), (2, 32, "mlx 2-bit")]
ZEROS = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128, "mxfp4": 12}


def random_groups(bits: int, group: int, source: str, out: int = 40, inputs: int = 256, seed: int = 0) -> AffineGroups:
    """Codes, and scales and biases of the 16-bit type such a checkpoint stores them in."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**bits, (out, inputs), dtype=np.uint8)
    stored = torch.float16 if source.startswith("Q") or bits == 3 else torch.bfloat16
    scales = torch.from_numpy(rng.random((out, inputs // group), dtype=np.float32) * 0.02).to(stored).float().numpy()
    biases = torch.from_numpy(-rng.random((out, inputs // group), dtype=np.float32) * 0.1).to(stored).float().numpy()
    if source in ZEROS:
        biases = np.float32(-ZEROS[source]) * scales
    return AffineGroups(codes, scales, biases, bits, group, source)


@pytest.mark.parametrize("bits,group,source", FORMS)
def test_the_product_is_the_exact_integer_sums_scaled_once_per_block(bits, group, source) -> None:
    groups = random_groups(bits, group, source)
    matrix = NativeMatrix.pack(groups, KERNELS)
    x = np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32)
    x[2, :32] = 0.0  # an all-zero activation block (its scale is 0)
    got = matrix.matmul(torch.from_numpy(x)).numpy()
    expected = reference_matmul(x, groups)
    # float32 accumulation of exact integer sums: within a few float32 roundings of the outputs' magnitude
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    exact = x.astype(np.float64) @ groups.dequantize().astype(np.float64).T  # 16-bit activations: nearly exact
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-4 * np.abs(exact).max())
    held = sum(t.numel() * t.element_size() for t in matrix.tensors())
    assert held == native_bytes(bits, group, *groups.shape, form_of(groups))  # what planning counts
    assert (matrix.biases.numel() == 0) == (source in ZEROS)


def test_the_kernels_quantize_activations_as_numpy_states_it() -> None:
    """The same int16 codes and block scales on every kernel path (the vector code rounds as nearbyint does), and
    for the VNNI kernel each code split exactly in bytes, q = 256 * hi + lo, with each block's lo sum."""
    x = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32) * 3
    x[0, :32] = 0.0  # an all-zero block
    x[1, 40] = 250.0  # an outlier: the rest of its block keeps few bits
    x[2, 64:96] = np.float32(0.5) * np.arange(-16, 16)  # ties: round half to even
    q, d, hi, lo, lo_sum = KERNELS.activation_codes(torch.from_numpy(x))
    expected_q, expected_d = quantize_activations(x)
    np.testing.assert_array_equal(q.numpy(), expected_q)
    np.testing.assert_array_equal(d.numpy(), expected_d)
    if KERNELS.row_block() == 1:
        assert hi.numel() == 0 and lo.numel() == 0  # no VNNI kernel here: nothing split
        return
    np.testing.assert_array_equal(256 * hi.numpy().astype(np.int32) + lo.numpy(), expected_q)
    np.testing.assert_array_equal(lo_sum.numpy(), lo.numpy().astype(np.int32).reshape(3, 8, 32).sum(-1))


def test_interleaving_puts_each_block_of_rows_units_side_by_side() -> None:
    """quant.h's Matrix.unit: unit j of row r at (r - i) * n + j * width + i, the last block narrower."""
    out, n, rows = 37, 5, 16
    t = torch.arange(out * n * 4, dtype=torch.int32).reshape(out, n * 4)
    woven = interleave(t, 4, rows).reshape(-1, 4)
    for r in range(out):
        first = r - r % rows
        width = min(rows, out - first)
        for j in range(n):
            assert torch.equal(woven[first * n + j * width + (r - first)], t[r, 4 * j:4 * j + 4])
    assert interleave(t, 4, 1) is t


@pytest.mark.parametrize("bits,group,source", FORMS)
def test_rows_dequantize_exactly_as_affine_groups_do(bits, group, source) -> None:
    groups = random_groups(bits, group, source)
    ids = torch.tensor([7, 0, 39, 7])
    rows = NativeMatrix.pack(groups, KERNELS).rows(ids).numpy()
    np.testing.assert_array_equal(rows, groups.dequantize()[ids.numpy()])


def test_a_row_gets_the_same_result_in_any_batch_of_decode_rows() -> None:
    """Up to GEMM_ROWS - 1 rows (decode steps), each row alone through the integer kernel, in tiles of 4 rows and a
    remainder: the same result as alone. From GEMM_ROWS on (a prompt), the dequantized weights' float32 product."""
    groups = random_groups(4, 32, "Q4_1", out=96, inputs=512)
    matrix = NativeMatrix.pack(groups, KERNELS)
    x = torch.randn(31, 512)
    together = matrix.matmul(x)
    for row in (0, 5, 29, 30):
        assert torch.equal(matrix.matmul(x[row : row + 1])[0], together[row])
    prompt = torch.randn(70, 512)
    exact = prompt.double() @ torch.from_numpy(groups.dequantize()).double().T
    torch.testing.assert_close(matrix.matmul(prompt).double(), exact, rtol=0, atol=1e-5 * float(exact.abs().max()))


def test_products_in_one_parallel_region_equal_each_product_alone() -> None:
    """A token's experts run in one parallel region (rows_matmuls): each product bit for bit what it is alone,
    across code layouts, groups of 16 and 32, output counts off the kernel's tiles, one row and several."""
    forms = [((4, 32, "Q4_1"), 40), ((5, 32, "Q5_0"), 24), ((6, 16, "mlx 6-bit"), 17), ((8, 32, "Q8_0"), 33)]
    matrices = [NativeMatrix.pack(random_groups(*form, out=out, seed=seed), KERNELS)
                for seed, (form, out) in enumerate(forms)]
    for rows in (1, 3):
        xs = [torch.randn(rows, 256) for _ in matrices]
        together = KERNELS.rows_matmuls(xs, [m.kernel_args() for m in matrices])
        for x, matrix, got in zip(xs, matrices, together):
            assert torch.equal(got, matrix.matmul(x))


def test_codes_of_every_layout_round_trip_through_the_packing() -> None:
    for bits, group, source in FORMS:
        groups = random_groups(bits, group, source)
        matrix = NativeMatrix.pack(groups, KERNELS)
        assert matrix.shape == groups.shape and layout_of(bits) in (0, 1, 2)
        np.testing.assert_array_equal(matrix.rows(torch.arange(groups.shape[0])).numpy(), groups.dequantize())


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """Per-head q/k norms and a grouped-query attention: the most the native step takes of a layer."""
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", n_layers=3, seed=3, peaky=True)


def _decode_logits(engine: TorchEngine, prompt: np.ndarray, n: int) -> tuple[list[int], np.ndarray]:
    """n greedy tokens (the prompt in one step, then one step a token) and each step's logits."""
    driver, tokens, logits, x = Driver([engine]), [], [], prompt
    for _ in range(n):
        logits.append(driver.forward("r", x))
        tokens.append(int(np.argmax(logits[-1])))
        x = np.array([tokens[-1]], dtype=np.int64)
    return tokens, np.stack(logits)


def test_the_native_decode_step_computes_what_the_python_layers_do(qwen3_dir) -> None:
    args = ModelArgs.from_dir(qwen3_dir)
    engine = TorchEngine(device="cpu", dtype="float32")
    engine.load(qwen3_dir, args, Shard.whole("t", args.num_hidden_layers))
    assert engine.model.native_decode is not None and engine.model.native_decode.has_head  # final norm, LM head
    prompt = np.arange(3, 40, dtype=np.int64)
    native_tokens, native_logits = _decode_logits(engine, prompt, 12)
    engine.model.native_decode = None  # the Python layers, the same weights
    python_tokens, python_logits = _decode_logits(engine, prompt, 12)
    assert native_tokens == python_tokens and len(set(native_tokens)) > 2
    np.testing.assert_allclose(native_logits, python_logits, rtol=1e-5, atol=1e-4)  # as chunked vs one-shot


@pytest.mark.parametrize("first,count", [(0, 3), (0, 2), (2, 1)])
def test_gemma3_runs_in_the_native_step_windows_and_all(first, count, tmp_path) -> None:
    """Gemma 3: sandwich and offset norms, the GELU-tanh MLP, per-head norms, sliding windows of 8 positions (shorter
    than the prompt) with their own rotary table beside a global layer with linear scaling; a whole model, a shard of
    only its local layers, and a shard of only its global one."""
    folder = make_checkpoint(tmp_path / "gemma3", "gemma3_text", n_layers=3, seed=4, peaky=True)
    args = ModelArgs.from_dir(folder)
    assert [args.window(layer) for layer in range(3)] == [8, 8, None]
    engine = TorchEngine(device="cpu", dtype="float32")
    engine.load(folder, args, Shard("t", first, first + count, args.num_hidden_layers))
    assert engine.model.native_decode is not None
    native = _shard_outputs(engine, first == 0, args.hidden_size)
    engine.model.native_decode = None  # the Python layers, the same weights
    python = _shard_outputs(engine, first == 0, args.hidden_size)
    np.testing.assert_allclose(native, python, rtol=1e-5, atol=1e-4)  # as chunked vs one-shot


def _shard_outputs(engine: TorchEngine, takes_tokens: bool, hidden: int) -> np.ndarray:
    """A shard's outputs for a 37-position prompt step, then 12 one-position steps: fixed token ids (a first shard)
    or fixed pseudo-random hidden states."""
    rng = np.random.default_rng(1)
    inputs = [np.arange(3, 40, dtype=np.int64)] + [np.array([7 + 5 * i], dtype=np.int64) for i in range(12)]
    if not takes_tokens:
        inputs = [Activations("float32", (len(x), hidden), rng.standard_normal((len(x), hidden)).astype(np.float32)
                              .tobytes()) for x in inputs]
    driver = Driver([engine])
    outputs = [driver.forward("r", x) for x in inputs]
    return np.concatenate([(o.bits() if hasattr(o, "bits") else o).astype(np.float32).reshape(-1) for o in outputs])


def test_without_native_kernels_the_engine_says_so_once_and_runs_torch_s(monkeypatch, caplog) -> None:
    monkeypatch.setenv(build.DISABLE, "0")
    build.kernels.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=build.__name__):
            assert build.kernels() is None and build.kernels() is None
        assert sum("native CPU kernels turned off" in r.message for r in caplog.records) == 1
    finally:
        build.kernels.cache_clear()
        monkeypatch.delenv(build.DISABLE)
        assert build.kernels() is not None


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_run_from_their_stored_scales(type_name) -> None:
    """Random K-quant blocks: the decoder gives gguf's own dequantization exactly, the kernels keep the scales as
    stored (a code a group, a float32 a super-block: the bytes planning counts) and compute the same products."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from exo_like.models.gguf.blocks import DECODERS, affine_groups

    block_bytes = DECODERS[type_name][0]
    rng = np.random.default_rng(5)
    out, inputs = 8, 512
    stored = rng.integers(0, 256, (out, inputs // 256 * block_bytes), dtype=np.uint8)
    blocks = stored.reshape(-1, block_bytes)
    d = (rng.random((blocks.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)  # finite scales
    for offset in ((208,) if type_name == "Q6_K" else (0, 2)):
        blocks[:, offset:offset + 2] = d
    groups = affine_groups(type_name, stored, (out, inputs))
    expected = dequantize(stored, GGMLQuantizationType[type_name]).reshape(out, inputs)
    np.testing.assert_array_equal(groups.dequantize(), expected)
    matrix = NativeMatrix.pack(groups, KERNELS)
    assert matrix.scales.dtype in (torch.uint8, torch.int8) and matrix.super_scales.dtype == torch.float32
    np.testing.assert_array_equal(matrix.rows(torch.arange(out)).numpy(), expected)
    x = rng.standard_normal((3, inputs)).astype(np.float32)
    reference = reference_matmul(x, groups)
    np.testing.assert_allclose(matrix.matmul(torch.from_numpy(x)).numpy(), reference, rtol=0,
                               atol=1e-5 * np.abs(reference).max())
    held = sum(t.numel() * t.element_size() for t in matrix.tensors())
    assert held == native_bytes(groups.bits, groups.group_size, out, inputs, form_of(groups))


@pytest.fixture(scope="module")
def gguf_mixed(tmp_path_factory):
    from tests.gguf_checkpoints import write_gguf

    root = tmp_path_factory.mktemp("mixed")
    folder = make_checkpoint(root / "hf", "llama", n_layers=2, seed=4)
    return write_gguf(folder, root / "mixed.gguf", "Q4_0", "Q8_0", types={"v_proj.weight": "Q8_0"})


def test_a_projection_stacked_from_two_types_runs_in_the_native_step(gguf_mixed) -> None:
    """A GGUF file whose q/k and v differ in type (llama-quantize's Q4_K_M does this) fuses q, k, v into several
    pieces; the native step takes them side by side. Both paths quantize the activations (16-bit blocks), where
    float32 differences in summation order can move a code by one step: so the native step may differ from the
    Python layers by no more than the Python layers differ from exact arithmetic (the file dequantized to float32),
    and picks the same tokens."""
    from exo_like.models.gguf.file import open_gguf

    args = ModelArgs.from_dict(open_gguf(gguf_mixed).config())
    engines = {dtype: TorchEngine(device="cpu", dtype=dtype) for dtype in (None, "float32")}
    for engine in engines.values():
        engine.load(gguf_mixed, args, Shard.whole("t", args.num_hidden_layers))
    engine = engines[None]
    assert len(engine.model.layers[0].self_attn.qkv_proj.pieces) > 1
    assert engine.model.native_decode is not None
    prompt = np.arange(3, 30, dtype=np.int64)
    native_tokens, native_logits = _decode_logits(engine, prompt, 8)
    engine.model.native_decode = None
    python_tokens, python_logits = _decode_logits(engine, prompt, 8)
    exact_tokens, exact_logits = _decode_logits(engines["float32"], prompt, 8)
    assert native_tokens == python_tokens and exact_tokens[0] == python_tokens[0]
    python_error = np.abs(python_logits - exact_logits)[:2].max()  # the prompt and the first token: same inputs
    assert np.abs(native_logits - python_logits)[:2].max() <= python_error


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_a_mixture_of_experts_runs_in_the_native_step(arch, tmp_path) -> None:
    """Qwen3-MoE (a dense layer among mixtures, renormalised top k), Qwen2-MoE (a gated shared expert, top k not
    renormalised), Mixtral: the native step routes and sums the experts as the Python layers do."""
    folder = make_checkpoint(tmp_path / arch, arch, n_layers=3, seed=5, peaky=True)
    args = ModelArgs.from_dir(folder)
    engine = TorchEngine(device="cpu", dtype="float32")
    engine.load(folder, args, Shard.whole("t", args.num_hidden_layers))
    assert engine.model.native_decode is not None
    prompt = np.arange(3, 40, dtype=np.int64)
    native_tokens, native_logits = _decode_logits(engine, prompt, 12)
    engine.model.native_decode = None
    python_tokens, python_logits = _decode_logits(engine, prompt, 12)
    assert native_tokens == python_tokens and len(set(native_tokens)) > 2
    np.testing.assert_allclose(native_logits, python_logits, rtol=1e-5, atol=1e-4)


def test_mixtures_routed_otherwise_are_left_to_the_python_layers() -> None:
    """gpt-oss (softmax over the top k logits, biased clamped experts) and DeepSeek (grouped routing)."""
    from types import SimpleNamespace

    from exo_like.engines.torch.native.decode import plain_mixture
    from exo_like.models.families import MoeArgs, Router

    def routed(**kinds) -> bool:
        return plain_mixture(SimpleNamespace(moe=MoeArgs(8, 2, 64, True, (0,), **kinds)))

    assert routed()
    assert routed(shared_expert_size=96, shared_expert_gated=True)
    assert not routed(router=Router.SOFTMAX_OF_TOP_K, activation="swiglu_clamped", expert_bias=True)
    assert not routed(router=Router.GROUPED_SOFTMAX) and not routed(router=Router.GROUPED_SIGMOID)
    assert not plain_mixture(SimpleNamespace(moe=None))
