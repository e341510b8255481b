"""GGUF files: config, tokenizer and tensors from the file alone, and the same float32 greedy tokens as
transformers loading the same file (it dequantizes to float32), on each engine and on a mixed ring.

Random checkpoints are written here with `gguf`'s writer in several tensor types (the real SmolLM2 file:
test_smollm2.py)."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (install the 'torch' extra)")
pytest.importorskip("gguf", reason="gguf is not installed")

from exo_like.engines.choice import create_engine  # noqa: E402
from exo_like.engines.torch.quant import native_kernels  # noqa: E402
from exo_like.errors import ModelNotFoundError, UnsupportedModelError  # noqa: E402
from exo_like.models.config import ModelArgs, rope_inv_freq  # noqa: E402
from exo_like.models.gguf.file import find_gguf, open_gguf, unpermute_rotary_rows  # noqa: E402
from exo_like.models.gguf.tokenizer import gguf_tokenizer  # noqa: E402
from exo_like.models.names.name import parse_model_name  # noqa: E402
from exo_like.models.names.resolver import read_local_model  # noqa: E402
from exo_like.models.shard import Shard  # noqa: E402
from exo_like.models.tokenizer import ModelTokenizer  # noqa: E402
from tests.checkpoints import built_once, make_checkpoint  # noqa: E402
from tests.engine_driver import engine_greedy  # noqa: E402
from tests.gguf_checkpoints import llama3_rope_factors, permute_rotary_rows, write_gguf  # noqa: E402
from tests.oracle import Oracle  # noqa: E402
from tests.oracle import gguf_greedy as transformers_greedy  # noqa: E402
from tests.native_kernels import NATIVE  # noqa: E402

N_LAYERS, SEED, N_TOKENS = 4, 1, 16
PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
# K-quants need rows of a multiple of 256 values.
K_SIZES = {"hidden_size": 256, "intermediate_size": 512}
QWEN_K = {**K_SIZES, "seed": 3}  # seed 1 at these sizes repeats one token, which would compare nothing
# name -> (architecture, matrix type, embedding type, make_checkpoint overrides)
CASES = {
    "llama-f32": ("llama", "F32", None, {}),
    "llama-f16": ("llama", "F16", None, {}),
    "llama-q8_0": ("llama", "Q8_0", None, {}),
    "llama-q4_1": ("llama", "Q4_1", "Q8_0", {}),
    "qwen2-q4_0": ("qwen2", "Q4_0", None, {}),
    "qwen2-q5_1": ("qwen2", "Q5_1", "F16", {}),
    "llama-q4_k": ("llama", "Q4_K", "Q6_K", K_SIZES),
    "qwen2-q6_k": ("qwen2", "Q6_K", "Q4_K", QWEN_K),
    "qwen2-q5_k": ("qwen2", "Q5_K", None, QWEN_K),
}
HAS_MLX = importlib.util.find_spec("mlx") is not None
ENGINES = ["torch", "mlx"] if HAS_MLX else ["torch"]


@pytest.fixture(scope="session")
def gguf_path(tmp_path_factory) -> Callable[[str], Path]:
    def build(name: str, path: Path) -> Path:
        arch, matrix_type, embedding_type, overrides = CASES[name]
        options = {"seed": SEED, **overrides}
        # No rope scaling: transformers' GGUF loader, the oracle here, ignores llama.cpp's rope_freqs (see the
        # llama3 tests below).
        folder = make_checkpoint(path, arch, n_layers=N_LAYERS, rope_scaling=None, **options)
        return write_gguf(folder, path / f"{name}.gguf", matrix_type, embedding_type)

    return built_once(tmp_path_factory.mktemp("gguf_checkpoints"), build)


def prompt_of(path: Path) -> list[int]:
    return gguf_tokenizer(open_gguf(path).metadata, path.name).encode(PROMPT, add_special_tokens=True)


@pytest.fixture(scope="session")
def expected(gguf_path) -> Callable[[str], list[int]]:
    done: dict[str, list[int]] = {}

    def get(name: str) -> list[int]:
        if name not in done:
            path = gguf_path(name)
            done[name] = transformers_greedy(path, prompt_of(path))
            assert len(set(done[name])) > 1, "degenerate reference continuation; pick another seed or prompt"
        return done[name]

    return get


# -- the file ---------------------------------------------------------------------------------------------------


def test_config_and_tokenizer_come_from_the_file_as_the_folder_has_them(gguf_path) -> None:
    path = gguf_path("llama-q8_0")
    folder = path.parent
    ours = ModelArgs.from_dict(open_gguf(path).config())
    theirs = ModelArgs.from_dir(folder)
    for field in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings", "qkv_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert set(ours.eos_token_ids) <= set(theirs.eos_token_ids)
    tokenizer, reference = gguf_tokenizer(open_gguf(path).metadata, path.name), ModelTokenizer.from_dir(folder)
    for text in (PROMPT, "Unicode: café, 日本語 🙂", "<|eot_id|> special tokens <|begin_of_text|> stay whole"):
        assert tokenizer.encode(text, True) == reference.encode(text, True)
        assert tokenizer.encode(text, False) == reference.encode(text, False)
    messages = [{"role": "user", "content": "Hello"}]
    assert tokenizer.encode_chat(messages) == reference.encode_chat(messages)


def test_llama_rotary_rows_are_put_back_as_the_converter_found_them() -> None:
    weight = np.arange(8 * 3 * 4, dtype=np.float32).reshape(3 * 8, 4)
    assert np.array_equal(unpermute_rotary_rows(permute_rotary_rows(weight, 3), 3), weight)
    assert not np.array_equal(permute_rotary_rows(weight, 3), weight)


def test_a_folder_holding_one_gguf_names_it_and_bad_files_fail_clearly(gguf_path, tmp_path) -> None:
    path = gguf_path("llama-f32")
    assert find_gguf(path) == path
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / path.name).symlink_to(path)
    assert find_gguf(lone) == lone / path.name
    assert parse_model_name(str(lone / path.name), tmp_path).path == lone / path.name
    (lone / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="several GGUF models"):
        find_gguf(lone)
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF file"):
        open_gguf(lone / "other.gguf")
    split = tmp_path / "split"
    split.mkdir()
    (split / "m-00001-of-00002.gguf").symlink_to(path)
    with pytest.raises(ModelNotFoundError, match="missing m-00002-of-00002.gguf"):
        open_gguf(split / "m-00001-of-00002.gguf")


def test_the_header_reads_as_gguf_s_own_reader_reads_it(gguf_path, smollm2) -> None:
    from gguf import GGUFReader

    for path in [gguf_path(name) for name in CASES] + [smollm2]:
        reader = GGUFReader(path)
        theirs = {str(t.name): (t.tensor_type.name, tuple(reversed(t.shape.tolist())), int(t.n_bytes),
                                int(t.data_offset)) for t in reader.tensors}
        checkpoint = open_gguf(path)
        assert checkpoint.metadata == {key: field.contents() for key, field in reader.fields.items()
                                       if not key.startswith("GGUF.")}, path.name
        ours = {e.gguf_name: (e.type_name, e.shape, e.n_bytes, e.offset) for e in checkpoint.tensors.values()}
        assert ours == theirs, path.name


def test_an_unsupported_tensor_type_is_named(tmp_path) -> None:
    folder = make_checkpoint(tmp_path / "tq", "qwen2", n_layers=1, seed=SEED, hidden_size=256, intermediate_size=512)
    path = write_gguf(folder, tmp_path / "tq.gguf", "TQ2_0", "F32")  # ternary weights: no engine here runs them
    with pytest.raises(UnsupportedModelError, match="TQ2_0, which is not supported"):
        _ = open_gguf(path).tensors


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_type_without_a_kernel_is_dequantized_and_counted(gguf_path, engine_name) -> None:
    # Q4_K layers, a Q6_K embedding (groups of 16: MLX's kernel and torch's int4 kernel take none; the native
    # kernels do), and a Q4_K head of 617 outputs, which torch's int4 kernel refuses (not a multiple of 16).
    path = gguf_path("llama-q4_k")
    args = ModelArgs.from_dict(open_gguf(path).config())
    engine = create_engine(engine_name, device="cpu")
    n = args.num_hidden_layers
    engine.load(path, args, Shard(path.name, 0, n, n))
    native = engine_name == "torch" and NATIVE
    refused = {"Q4_K (617 outputs (not a multiple of 16))": 1} if engine_name == "torch" and not native else {}
    assert engine.weight_forms.dequantized == ({} if native else {"Q6_K (groups of 16)": 1, **refused})
    assert set(engine.weight_forms.quantized) == ({"Q4_K", "Q6_K"} if native else {"Q4_K"})
    if engine_name == "torch" and not native:  # held in bfloat16 beside float32 activations: half float32's bytes
        assert engine.model.embed_tokens.weight_rows.dtype == torch.bfloat16
    engine.load(path, args, Shard(path.name, 1, 2, n))  # a middle shard: no embedding, no head
    assert engine.weight_forms.dequantized == {}
    float_engine = create_engine(engine_name, device="cpu", dtype="float32")  # the reference path: no kernels
    float_engine.load(path, args, Shard(path.name, 0, n, n))
    assert (float_engine.weight_forms.quantized, float_engine.weight_forms.dequantized) == ({}, {})


# Q4_0 runs on both engines' kernels; Q6_K (the embedding of one, the layers of the other) on the native kernels
# only: MLX and torch's int4 kernel dequantize it (torch on CPU to bfloat16).
@pytest.mark.parametrize("name", ["qwen2-q4_0", "llama-q4_k", "qwen2-q6_k"])
def test_planning_counts_the_bytes_each_node_holds(gguf_path, name) -> None:
    path = gguf_path(name)
    args, _, footprint = read_local_model(path)
    entries = {n: e for n, e in open_gguf(path).tensors.items() if n.startswith("model.layers.0.")}
    assert footprint.layer_bytes == (sum(e.n_bytes for e in entries.values()),) * args.num_hidden_layers
    assert footprint.tied == name.startswith("qwen2")  # the test qwen2 ties its head to the embedding, llama not
    as_float32 = sum(4 * int(np.prod(e.shape)) for e in entries.values())
    assert footprint.held_by("torch", "float32").layer_bytes == (as_float32,) * args.num_hidden_layers
    whole = Shard(path.name, 0, args.num_hidden_layers, args.num_hidden_layers)
    for engine_name in ENGINES:
        for dtype in (None, "float32"):
            engine = create_engine(engine_name, device="cpu", dtype=dtype)
            engine.load(path, args, whole)
            held = footprint.held_by(engine_name, dtype, "cpu", NATIVE).shard_bytes(whole)
            assert held == engine.parameter_bytes(), (engine_name, dtype)


# -- exactness ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(CASES))
def test_one_engine_matches_transformers_on_the_same_file(gguf_path, expected, name, engine) -> None:
    path = gguf_path(name)
    assert engine_greedy(path, [engine], prompt_of(path)) == expected(name)


RINGS = {"torch": ["torch"] * 3, "mlx": ["mlx"] * 3, "mixed": ["torch", "mlx", "torch"]}


@pytest.mark.parametrize("ring", [r for r in RINGS if HAS_MLX or r == "torch"])
@pytest.mark.parametrize("name", ["llama-q4_1", "qwen2-q4_0", "llama-q4_k", "qwen2-q6_k"])
def test_a_three_stage_ring_matches_transformers(gguf_path, expected, name, ring) -> None:
    path = gguf_path(name)
    assert engine_greedy(path, RINGS[ring], prompt_of(path)) == expected(name)


# -- Llama 3.1's rope scaling: llama.cpp's rope_freqs -----------------------------------------------------------
# llama.cpp's converter stores a llama3 `rope_scaling` only as the tensor `rope_freqs.weight` (per-dimension factors
# that divide the rotary frequencies). A short original context makes it bite at the test's head_dim 16 (theta
# 500000): one frequency kept, one smoothed, six divided by 8, so a 16-token prompt already rotates differently.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@dataclass(frozen=True)
class Llama3Files:
    hf: Path  # the Hugging Face checkpoint (config.json with the llama3 rope_scaling)
    f32: Path  # it as GGUF, float32 matrices
    q8_0: Path  # it as GGUF, Q8_0 matrices
    prompt: list[int]
    hf_tokens: list[int]  # transformers' greedy tokens on `hf`


@pytest.fixture(scope="session")
def llama3(tmp_path_factory) -> Llama3Files:
    root = tmp_path_factory.mktemp("llama3_rope")
    # A context of 4096 (Llama 3.1 says 131072): the nodes' KV pools stay small; the llama3 rope does not use it.
    folder = make_checkpoint(root / "hf", "llama", n_layers=N_LAYERS, seed=SEED, rope_scaling=LLAMA3_ROPE,
                             max_position_embeddings=4096)
    f32 = write_gguf(folder, root / "llama3-f32.gguf", "F32")
    q8_0 = write_gguf(folder, root / "llama3-q8_0.gguf", "Q8_0")
    oracle = Oracle(folder)
    prompt = list(oracle.completion_ids(PROMPT))
    hf_tokens = oracle.generate(tuple(prompt), N_TOKENS)
    assert len(set(hf_tokens)) > 1, "degenerate reference continuation; pick another seed or prompt"
    return Llama3Files(folder, f32, q8_0, prompt, hf_tokens)


def test_llama3_rope_freqs_give_the_frequencies_of_the_checkpoints_rope_scaling(llama3) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    gguf = open_gguf(llama3.f32)
    # The converter writes the tensor only: no metadata names llama3 or its parameters.
    assert "rope_freqs.weight" in gguf.tensors and gguf.metadata.get("llama.rope.scaling.type") is None
    args = ModelArgs.from_dict(gguf.config())
    assert args.rope_scaling is None
    factors = np.array(args.rope_freq_factors)
    assert np.array_equal(factors, llama3_rope_factors(json.loads((llama3.hf / "config.json").read_text())))
    assert factors[0] == 1 and 1 < factors[1] < 8 and np.all(factors[2:] == 8)  # all three llama3 regimes
    hf_args = ModelArgs.from_dir(llama3.hf)
    assert hf_args.rope_scaling["rope_type"] == "llama3" and hf_args.rope_freq_factors is None
    transformers_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(llama3.hf), "cpu")
    for inv_freq in (rope_inv_freq(args), rope_inv_freq(hf_args)):
        np.testing.assert_allclose(inv_freq, transformers_inv_freq.numpy(), rtol=1e-6)
    # Every stage rotates, so every stage has the factors: from the config, not from its share of the tensors.
    for start, end in ((0, 2), (2, N_LAYERS)):
        shard = Shard(llama3.f32.name, start, end, N_LAYERS)
        assert "rope_freqs.weight" not in {name for name, _, _ in gguf.read_shard(shard, args.tie_word_embeddings)}


@pytest.mark.parametrize("ring", [["torch"], ["mlx"], ["torch", "mlx"]] if HAS_MLX else [["torch"]],
                         ids=lambda ring: "-".join(ring))
def test_a_llama3_gguf_gives_transformers_tokens_on_the_hf_checkpoint(llama3, ring) -> None:
    assert engine_greedy(llama3.f32, ring, llama3.prompt) == llama3.hf_tokens
    # The factors matter here: the same file run with unscaled rope (what ignoring rope_freqs would do) diverges.
    unscaled = replace(ModelArgs.from_dict(open_gguf(llama3.f32).config()), rope_freq_factors=None)
    assert engine_greedy(llama3.f32, ring[:1], llama3.prompt, args=unscaled) != llama3.hf_tokens


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_quantized_llama3_gguf_loads_on_kernels_and_float32_matches_transformers_on_the_file(llama3,
                                                                                              engine_name) -> None:
    path = llama3.q8_0
    args = ModelArgs.from_dict(open_gguf(path).config())
    engine = create_engine(engine_name, device="cpu")  # the default: Q8_0 on the quantized kernels
    engine.load(path, args, Shard(path.name, 0, N_LAYERS, N_LAYERS))
    assert set(engine.weight_forms.quantized) == {"Q8_0"}
    # torch's int4 kernel refuses the embedding and head of 617 outputs (not a multiple of 16): they are
    # dequantized; the native kernels take any number of outputs.
    int4 = engine_name == "torch" and native_kernels(torch.device("cpu")) is None
    refused = {"Q8_0 (617 outputs (not a multiple of 16))": 2} if int4 else {}
    assert engine.weight_forms.dequantized == refused
    assert len(engine_greedy(path, [engine_name], llama3.prompt, dtype=None)) == N_TOKENS
    # transformers reads the file's tensors but not its rope_freqs: given the checkpoint's config, it runs the
    # llama3 rope the factors encode.
    expected = transformers_greedy(path, llama3.prompt, config_dir=llama3.hf)
    assert len(set(expected)) > 1
    assert engine_greedy(path, [engine_name], llama3.prompt) == expected


def completion(node, model: str, prompt: str, max_tokens: int = N_TOKENS) -> dict:  # noqa: ANN001
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    status, _, raw = node.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 200, raw
    return json.loads(raw)


@pytest.mark.slow
def test_llama3_ggufs_are_served_through_the_api_as_transformers_answers(llama3, tmp_path) -> None:
    """Real nodes (a node serves one model): the float file on each engine alone and on a torch + MLX ring gives
    transformers' answer on the Hugging Face checkpoint; the Q8_0 file runs on the quantized kernels."""
    from tests.api_server import start_node, stop_nodes
    from tests.cluster_harness import cluster_of, start_cluster, wait_until_ready

    oracle = Oracle(llama3.hf)
    expected = oracle.expected(tuple(llama3.prompt), N_TOKENS)
    assert oracle.generate(tuple(llama3.prompt), N_TOKENS) == llama3.hf_tokens
    served = [(engine_name, llama3.f32) for engine_name in ENGINES] + [("torch", llama3.q8_0)]

    def serve(engine_name: str, path: Path) -> tuple[dict, dict]:
        node = start_node(tmp_path / f"{engine_name}-{path.stem}", str(path), "--no-mdns", "--engine", engine_name)
        try:
            wait_until_ready([node], 1, timeout=120)
            return completion(node, str(path), PROMPT), node.get_json("/health")["weights"]
        finally:
            assert node.stop() == 0, node.log()
            assert "Traceback" not in node.log(), node.log()

    with ThreadPoolExecutor(len(served)) as pool:  # started together: most of a node's start is imports
        results = list(pool.map(lambda item: serve(*item), served))
    for (engine_name, path), (answer, weights) in zip(served, results):
        if path == llama3.f32:
            assert answer_of(answer) == expected, (engine_name, answer)
        else:  # not transformers' float tokens (the weights are Q8_0's): it loads on the kernels and answers
            assert set(weights["quantized"]) == {"Q8_0"} and answer["usage"]["completion_tokens"] == N_TOKENS
    engines = ["torch", "mlx"] if HAS_MLX else ["torch", "torch"]
    # Split by memory: by measured speed, a torch node (its native decode step) may take every layer from an MLX
    # one on a CPU, and the ring is what this checks. With --dtype float32.
    nodes = start_cluster(tmp_path / "ring", str(llama3.f32), [1, 1], engines=engines, extra=("--placement", "memory"))
    try:
        wait_until_ready(nodes, members=2, timeout=120)
        assert len(cluster_of(nodes[0])["plan"]["stages"]) == 2
        for node in nodes:
            assert answer_of(completion(node, str(llama3.f32), PROMPT)) == expected
    finally:
        for node, code in zip(nodes, stop_nodes(nodes)):
            assert code == 0, node.log()


def answer_of(completion_body: dict) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of a completion, as Oracle.expected gives them."""
    choice = completion_body["choices"][0]
    return choice["text"], choice["finish_reason"], completion_body["usage"]["completion_tokens"]
