"""The PyTorch engine against Hugging Face transformers (the oracle), whole and split into shards.

Every test builds real checkpoints with transformers (tests/checkpoints.py) and runs the real engine on them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from exo_like.activations import Activations
from exo_like.checkpoint import INDEX_FILE, safetensors_header
from exo_like.engines import torch_engine, torch_model
from exo_like.engines.torch_engine import TorchEngine
from exo_like.errors import InvalidRequestError
from exo_like.model_config import ModelArgs
from exo_like.shard import Shard
from tests.checkpoints import ARCHITECTURES, make_checkpoint

N_LAYERS = 6
SEED = 1  # weights whose greedy continuations of PROMPT_TEXT vary (not one token repeated)
NEW_TOKENS = 32
# Three uneven shards of the 6-layer models: 1, 2 and 3 layers.
SPLITS = ((0, 1), (1, 3), (3, 6))
VARIANTS = (*ARCHITECTURES, "llama-hub")
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One float32 6-layer checkpoint per architecture, plus llama with a Hub-style config.json."""
    dirs = {}
    for variant in VARIANTS:
        arch = variant.removesuffix("-hub")
        path = tmp_path_factory.mktemp(variant)
        dirs[variant] = make_checkpoint(
            path, arch, n_layers=N_LAYERS, seed=SEED, hub_style_config=variant.endswith("-hub")
        )
    return dirs


@pytest.fixture(scope="session")
def prompt(model_dirs) -> np.ndarray:
    tokenizer = Tokenizer.from_file(str(model_dirs["llama"] / "tokenizer.json"))
    return np.array(tokenizer.encode(PROMPT_TEXT).ids, dtype=np.int64)


@pytest.fixture(scope="session")
def reference(model_dirs, prompt) -> dict[str, tuple[list[int], np.ndarray]]:
    """transformers' greedy tokens and per-step logits for each variant (eos stopping off: all 32 tokens)."""
    from transformers import AutoModelForCausalLM

    results = {}
    for variant, path in model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.from_numpy(prompt)[None]
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        results[variant] = (tokens, torch.cat(out.logits).float().numpy())
    return results


def load_engine(path: Path, start: int, end: int, dtype: str = "float32") -> TorchEngine:
    args = ModelArgs.from_dir(path)
    engine = TorchEngine(device="cpu", dtype=dtype)
    engine.load(path, args, Shard("test", start, end, args.num_hidden_layers))
    return engine


def load_chain(path: Path, splits=SPLITS, dtype: str = "float32") -> list[TorchEngine]:
    return [load_engine(path, start, end, dtype) for start, end in splits]


def run_chain(engines: list[TorchEngine], request_id: str, tokens: np.ndarray) -> np.ndarray:
    """Feed tokens through every shard; hidden states cross each boundary as wire-encoded Activations."""
    x = tokens
    for engine in engines:
        x = engine.forward(request_id, x)
        if isinstance(x, Activations):
            x = Activations.from_wire(x.to_wire())
    assert isinstance(x, np.ndarray) and x.dtype == np.float32
    return x


def greedy(
    engines: list[TorchEngine], prompt: np.ndarray, n: int, request_id: str = "r"
) -> tuple[list[int], np.ndarray]:
    tokens, logits, x = [], [], prompt
    for _ in range(n):
        step = run_chain(engines, request_id, x)
        logits.append(step)
        tokens.append(int(np.argmax(step)))
        x = np.array([tokens[-1]], dtype=np.int64)
    for engine in engines:
        engine.release(request_id)
    return tokens, np.stack(logits)


@pytest.mark.parametrize("variant", VARIANTS)
def test_whole_model_greedy_matches_transformers(model_dirs, prompt, reference, variant):
    engine = load_engine(model_dirs[variant], 0, N_LAYERS)
    tokens, logits = greedy([engine], prompt, NEW_TOKENS)
    ref_tokens, ref_logits = reference[variant]
    assert tokens == ref_tokens
    assert len(set(tokens)) > 4  # a varied continuation, so the comparison means something
    # Logits too, so a small error (e.g. rope scaling) cannot hide behind a still-correct argmax.
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=2e-4)
    assert engine.cached_length("r") == 0  # released
    # All of the checkpoint's tensors, each once (a tied head shares the embedding's memory).
    header = safetensors_header(model_dirs[variant] / "model.safetensors")
    assert engine.parameter_bytes() == sum(end - begin for begin, end in (t["data_offsets"] for t in header.values()))


@pytest.mark.parametrize("variant", VARIANTS)
def test_three_uneven_shards_match_transformers(model_dirs, prompt, reference, variant):
    engines = load_chain(model_dirs[variant])
    hidden = engines[0].forward("probe", prompt)
    assert isinstance(hidden, Activations)
    assert (hidden.dtype, hidden.shape) == ("float32", (len(prompt), 64))
    tokens, logits = greedy(engines, prompt, NEW_TOKENS)
    assert tokens == reference[variant][0]
    np.testing.assert_allclose(logits, reference[variant][1], rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_chunked_prefill_matches_one_shot(model_dirs, prompt, variant):
    engine = load_engine(model_dirs[variant], 0, N_LAYERS)
    one_shot = engine.forward("whole", prompt)
    for piece in (prompt[:5], prompt[5:9]):
        engine.forward("chunked", piece)
    assert engine.cached_length("chunked") == 9
    chunked = engine.forward("chunked", prompt[9:])
    assert engine.cached_length("chunked") == engine.cached_length("whole") == len(prompt)
    np.testing.assert_allclose(chunked, one_shot, rtol=1e-5, atol=1e-4)
    # And decoding continues identically from either cache.
    token = np.array([int(np.argmax(one_shot))])
    np.testing.assert_allclose(engine.forward("chunked", token), engine.forward("whole", token), rtol=1e-5, atol=1e-4)


def test_interleaved_requests_keep_separate_caches(model_dirs, prompt):
    engine = load_engine(model_dirs["qwen2"], 0, N_LAYERS)
    prompts = {"a": prompt, "b": prompt[::-1][:7].copy()}
    alone = {rid: greedy([engine], p, 8, request_id=rid) for rid, p in prompts.items()}
    inputs = dict(prompts)
    logits: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for _ in range(8):
        for rid in ("a", "b"):
            step = engine.forward(rid, inputs[rid])
            logits[rid].append(step)
            inputs[rid] = np.array([int(np.argmax(step))])
    assert engine.cached_length("a") == len(prompt) + 7 and engine.cached_length("b") == 7 + 7
    for rid in ("a", "b"):
        np.testing.assert_array_equal(np.stack(logits[rid]), alone[rid][1])
    engine.release("a")
    assert engine.cached_length("a") == 0 and engine.cached_length("b") == 14
    engine.release("unknown")  # ignored


def test_cache_growth_in_small_chunks_changes_nothing(model_dirs, prompt, monkeypatch):
    engine = load_engine(model_dirs["mistral"], 0, N_LAYERS)
    _, expected = greedy([engine], prompt, 12)
    monkeypatch.setattr(torch_model, "CACHE_CHUNK", 3)  # grow (copy) every 3 positions
    _, logits = greedy([engine], prompt, 12)
    np.testing.assert_array_equal(logits, expected)


def test_bfloat16_activations_cross_shards(model_dirs, prompt):
    path = model_dirs["qwen3"]
    chain = load_chain(path, dtype="bfloat16")
    whole = load_engine(path, 0, N_LAYERS, dtype="bfloat16")
    assert whole.dtype_name == "bfloat16"
    hidden = chain[0].forward("probe", prompt)
    assert (hidden.dtype, hidden.shape, len(hidden.data)) == ("bfloat16", (len(prompt), 64), len(prompt) * 64 * 2)
    assert hidden.bits().dtype == np.uint16
    chain_tokens, chain_logits = greedy(chain, prompt, 4)
    whole_tokens, whole_logits = greedy([whole], prompt, 4)
    assert chain_tokens[0] == whole_tokens[0]
    assert chain_tokens == whole_tokens
    # bf16 hidden states travel bit-exactly, so splitting changes nothing at all.
    np.testing.assert_array_equal(chain_logits, whole_logits)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_bfloat16_matches_transformers_bfloat16(model_dirs, prompt, variant):
    """bfloat16 runs on other CPU kernels (packed weights, native matrix-vector); they must agree with
    transformers in bfloat16 too, to within bfloat16 rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs[variant], dtype=torch.bfloat16).eval()
    ids = torch.from_numpy(prompt)[None]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=8,
        min_new_tokens=8,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens, logits = greedy([load_engine(model_dirs[variant], 0, N_LAYERS, dtype="bfloat16")], prompt, 8)
    assert tokens == out.sequences[0, len(prompt) :].tolist()
    np.testing.assert_allclose(logits, torch.cat(out.logits).float().numpy(), rtol=2e-2, atol=0.1)


def test_float32_shard_accepts_bfloat16_activations(model_dirs, prompt):
    path = model_dirs["llama"]
    first = load_engine(path, 0, 3, dtype="bfloat16")
    rest = load_engine(path, 3, N_LAYERS, dtype="float32")
    hidden = first.forward("r", prompt)
    logits = rest.forward("r", hidden)
    expected = load_engine(path, 3, N_LAYERS).forward(
        "r", Activations("float32", hidden.shape, (hidden.bits().astype(np.uint32) << 16).tobytes())
    )
    np.testing.assert_array_equal(logits, expected)


@pytest.fixture(scope="session")
def multi_file_dirs(tmp_path_factory) -> dict[str, Path]:
    """8-layer checkpoints split into many small safetensors files: untied (llama) and tied (qwen2)."""
    return {
        arch: make_checkpoint(tmp_path_factory.mktemp(f"{arch}-multi"), arch, n_layers=8, max_shard_size="100KB")
        for arch in ("llama", "qwen2")
    }


def needed_tensor_names(names: list[str], start: int, tied: bool) -> set[str]:
    """The last shard's tensors: its layers, the final norm, and the head (the embedding when tied)."""
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    return {
        n
        for n in names
        if n in (head, "model.norm.weight") or any(n.startswith(f"model.layers.{i}.") for i in range(start, 8))
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_last_quarter_opens_only_its_files(multi_file_dirs, monkeypatch, arch):
    path = multi_file_dirs[arch]
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    tied = arch == "qwen2"
    wanted = needed_tensor_names(list(weight_map), 6, tied)
    expected_files = {weight_map[name] for name in wanted}
    all_files = set(weight_map.values())
    assert len(all_files) > 8 and len(expected_files) < len(all_files) / 2  # the test means something

    opened: list[str] = []
    real_safe_open = torch_engine.safe_open

    def recording_safe_open(filename, *args, **kwargs):
        opened.append(Path(filename).name)
        return real_safe_open(filename, *args, **kwargs)

    monkeypatch.setattr(torch_engine, "safe_open", recording_safe_open)
    engine = load_engine(path, 6, 8)
    assert set(opened) == expected_files and len(opened) == len(expected_files)

    headers = {file: safetensors_header(path / file) for file in expected_files}
    expected_bytes = 0
    for name in wanted:
        begin, end = headers[weight_map[name]][name]["data_offsets"]
        expected_bytes += end - begin
    assert engine.parameter_bytes() == expected_bytes

    # The shard works on its own: hidden states in, logits out.
    logits = engine.forward("r", Activations("float32", (3, 64), np.ones((3, 64), np.float32).tobytes()))
    assert logits.shape == (engine.args.vocab_size,) and np.isfinite(logits).all()


def test_float16_checkpoint_runs_as_bfloat16_on_cpu(tmp_path, prompt, caplog):
    path = make_checkpoint(tmp_path / "fp16", "qwen2", n_layers=2, dtype=torch.float16)
    args = ModelArgs.from_dir(path)
    assert args.torch_dtype == "float16"
    engine = TorchEngine()  # device and dtype chosen automatically
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert engine.device_name == "cpu"
    with caplog.at_level(logging.INFO, logger=torch_engine.__name__):
        engine.load(path, args, Shard.whole("fp16", 2))
    if engine.device.type == "cpu":
        assert engine.dtype_name == "bfloat16"
        assert any("float16 runs as bfloat16" in record.getMessage() for record in caplog.records)
    assert np.isfinite(engine.forward("r", prompt)).all()
    # float16 -> bfloat16 keeps two bytes per value, whatever layout the CPU kernels store weights in.
    header = safetensors_header(path / "model.safetensors")
    assert engine.parameter_bytes() == sum(end - begin for begin, end in (t["data_offsets"] for t in header.values()))
    explicit = TorchEngine(device="cpu", dtype="float32")
    explicit.load(path, args, Shard.whole("fp16", 2))
    assert explicit.dtype_name == "float32" and explicit.device_name == "cpu"


def test_rejects_malformed_inputs(model_dirs, prompt):
    path = model_dirs["llama"]
    first, second = load_engine(path, 0, 3), load_engine(path, 3, N_LAYERS)
    with pytest.raises(InvalidRequestError):
        first.forward("r", prompt.astype(np.float32))
    with pytest.raises(InvalidRequestError):
        first.forward("r", np.array([first.args.vocab_size]))
    with pytest.raises(InvalidRequestError):
        second.forward("r", prompt)
    with pytest.raises(InvalidRequestError):
        second.forward("r", Activations("float32", (2, 32), np.zeros((2, 32), np.float32).tobytes()))
    assert first.cached_length("r") == 0 and second.cached_length("r") == 0
