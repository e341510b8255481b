"""The PyTorch engine against Hugging Face transformers (the oracle), whole and split into shards.

Every test builds real checkpoints with transformers (tests/checkpoints.py) and runs the real engine on them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from exo_like.engines.activations import Activations
from exo_like.engines.torch import engine as torch_engine
from exo_like.engines.torch import loading as torch_loading
from exo_like.engines.torch.engine import TorchEngine
from exo_like.engines.work import BLOCK_SIZE, WorkItem, blocks_for
from exo_like.errors import InvalidRequestError
from exo_like.models.checkpoint import INDEX_FILE, safetensors_header
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from tests.checkpoints import ARCHITECTURES, make_checkpoint
from tests.engine_driver import INVALID_ITEMS, SPEC, Driver, generate_together, invalid_item, steps_meeting

# Collections skip what this file keeps (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("objects_kept_by_this_file_frozen", "earlier_tests_objects_frozen")

N_LAYERS = 6
SEED = 1  # weights whose greedy continuations of PROMPT_TEXT vary (not one token repeated)
NEW_TOKENS = 32
# Three uneven shards of the 6-layer models: 1, 2 and 3 layers.
SPLITS = ((0, 1), (1, 3), (3, 6))
VARIANTS = (*ARCHITECTURES, "llama-hub")
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
# Other prompts for batches: 12, 5 and 63 tokens (PROMPT_TEXT has 16, exactly one KV block).
OTHER_TEXTS = (
    "Memory bandwidth bounds decoding; prefill is bound by compute.",
    "Hello there",
    "A ring of nodes, each holding some layers of one model, passes hidden states along; the last one samples the "
    "next token and sends it back to the first.",
)


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


@functools.cache
def hf_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_generate(path: Path, prompt: np.ndarray, n: int, dtype: torch.dtype = torch.float32
                ) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and per-step logits (eos stopping off: all n tokens); computed once per
    checkpoint, prompt, length and dtype (the batched test asks the same for the whole model and three shards)."""
    tokens, logits = hf_generate_once(path, tuple(int(t) for t in prompt), n, dtype)
    return list(tokens), logits


@functools.cache
def hf_generate_once(path: Path, prompt: tuple[int, ...], n: int, dtype: torch.dtype
                     ) -> tuple[tuple[int, ...], np.ndarray]:
    model = hf_model(path, dtype)
    ids = torch.tensor([prompt], dtype=torch.int64)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits = torch.cat(out.logits).float().numpy()
    logits.flags.writeable = False  # shared by every caller
    return tuple(out.sequences[0, len(prompt) :].tolist()), logits


@pytest.fixture(scope="session")
def reference(model_dirs, prompt) -> dict[str, tuple[list[int], np.ndarray]]:
    """transformers' greedy tokens and per-step logits for each variant (all NEW_TOKENS tokens)."""
    return {variant: hf_generate(path, prompt, NEW_TOKENS) for variant, path in model_dirs.items()}


@pytest.fixture(scope="session")
def other_prompts(model_dirs) -> list[np.ndarray]:
    tokenizer = Tokenizer.from_file(str(model_dirs["llama"] / "tokenizer.json"))
    return [np.array(tokenizer.encode(text).ids, dtype=np.int64) for text in OTHER_TEXTS]


def load_engine(path: Path, start: int, end: int, dtype: str = "float32") -> TorchEngine:
    args = ModelArgs.from_dir(path)
    engine = TorchEngine(device="cpu", dtype=dtype)
    engine.load(path, args, Shard("test", start, end, args.num_hidden_layers))
    return engine


def load_chain(path: Path, splits=SPLITS, dtype: str = "float32") -> list[TorchEngine]:
    return [load_engine(path, start, end, dtype) for start, end in splits]


def greedy(driver: Driver, prompt: np.ndarray, n: int, request_id: str = "r") -> tuple[list[int], np.ndarray]:
    """n greedy tokens of one request, one engine step each (the prompt in one); then the request is released."""
    tokens, logits, x = [], [], prompt
    for _ in range(n):
        step = driver.forward(request_id, x)
        assert isinstance(step, np.ndarray) and step.dtype == np.float32
        logits.append(step)
        tokens.append(int(np.argmax(step)))
        x = np.array([tokens[-1]], dtype=np.int64)
    driver.release(request_id)
    return tokens, np.stack(logits)


@pytest.mark.parametrize("variant", VARIANTS)
def test_whole_model_greedy_matches_transformers(model_dirs, prompt, reference, variant):
    engine = load_engine(model_dirs[variant], 0, N_LAYERS)
    driver = Driver([engine])
    tokens, logits = greedy(driver, prompt, NEW_TOKENS)
    ref_tokens, ref_logits = reference[variant]
    assert tokens == ref_tokens
    assert len(set(tokens)) > 4  # a varied continuation, so the comparison means something
    # Logits too, so a small error (e.g. rope scaling) cannot hide behind a still-correct argmax.
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=2e-4)
    assert driver.cached_length("r") == 0 and driver.pool.used == 0  # released
    # All of the checkpoint's tensors, each once (a tied head shares the embedding's memory).
    header = safetensors_header(model_dirs[variant] / "model.safetensors")
    assert engine.parameter_bytes() == sum(end - begin for begin, end in (t["data_offsets"] for t in header.values()))


@pytest.mark.parametrize("variant", VARIANTS)
def test_three_uneven_shards_match_transformers(model_dirs, prompt, reference, variant):
    engines = load_chain(model_dirs[variant])
    hidden = Driver(engines[:1]).forward("probe", prompt)
    assert isinstance(hidden, Activations)
    assert (hidden.dtype, hidden.shape) == ("float32", (len(prompt), 64))
    tokens, logits = greedy(Driver(engines), prompt, NEW_TOKENS)
    assert tokens == reference[variant][0]
    np.testing.assert_allclose(logits, reference[variant][1], rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_chunked_prefill_matches_one_shot(model_dirs, prompt, variant):
    driver = Driver([load_engine(model_dirs[variant], 0, N_LAYERS)])
    one_shot = driver.forward("whole", prompt)
    for piece in (prompt[:5], prompt[5:9]):
        driver.forward("chunked", piece)
    assert driver.cached_length("chunked") == 9
    chunked = driver.forward("chunked", prompt[9:])
    assert driver.cached_length("chunked") == driver.cached_length("whole") == len(prompt)
    np.testing.assert_allclose(chunked, one_shot, rtol=1e-5, atol=1e-4)
    # And decoding continues identically from either cache.
    token = np.array([int(np.argmax(one_shot))])
    np.testing.assert_allclose(driver.forward("chunked", token), driver.forward("whole", token), rtol=1e-5, atol=1e-4)


def test_interleaved_requests_keep_separate_caches(model_dirs, prompt):
    driver = Driver([load_engine(model_dirs["qwen2"], 0, N_LAYERS)])
    prompts = {"a": prompt, "b": prompt[::-1][:7].copy()}
    alone = {rid: greedy(driver, p, 8, request_id=rid) for rid, p in prompts.items()}
    inputs = dict(prompts)
    logits: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for _ in range(8):
        for rid in ("a", "b"):
            step = driver.forward(rid, inputs[rid])
            logits[rid].append(step)
            inputs[rid] = np.array([int(np.argmax(step))])
    assert driver.cached_length("a") == len(prompt) + 7 and driver.cached_length("b") == 7 + 7
    for rid in ("a", "b"):
        np.testing.assert_array_equal(np.stack(logits[rid]), alone[rid][1])
    driver.release("a")
    assert driver.cached_length("a") == 0 and driver.cached_length("b") == 14


def interleaved(driver: Driver, prompt: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """greedy() of request "r", with another request taking the next block whenever r is about to need a new
    one, so r's table interleaves with the other's (r's own steps still run alone, as in greedy)."""
    vocab = driver.engines[0].args.vocab_size
    logits, x = [], prompt
    for _ in range(n):
        if driver.cached_length("r") % BLOCK_SIZE == 0:
            driver.forward("other", rng.integers(0, vocab, BLOCK_SIZE))
        step = driver.forward("r", x)
        logits.append(step)
        x = np.array([int(np.argmax(step))])
    return np.stack(logits)


# Block tables unlike the plain one (blocks 0, 1, 2, ... in order): the pool's view path with an offset, and the
# gather path for tables that are not consecutive.
TABLES = ("from a high block", "descending", "interleaved with another request")


@pytest.mark.parametrize("table", TABLES)
def test_where_the_blocks_lie_changes_nothing(model_dirs, prompt, table):
    """Replaces the old cache-growth test: a request's logits depend on its tokens only, never on which KV
    blocks hold them, nor on the blocks of others around them."""
    engine = load_engine(model_dirs["mistral"], 0, N_LAYERS)
    n, n_blocks = 20, 64
    plain = Driver([engine], n_blocks)
    _, expected = greedy(plain, prompt, n)
    needed = blocks_for(len(prompt) + n - 1)
    if table == "from a high block":
        driver = Driver([engine], n_blocks, first_block=n_blocks - needed)
        logits = np.stack([driver.forward("r", x) for x in _replay(prompt, expected)])
        blocks = driver.blocks("r")
        assert blocks == tuple(range(n_blocks - needed, n_blocks))
    elif table == "descending":
        driver = Driver([engine], n_blocks, block_ids=range(n_blocks - 1, -1, -1))
        logits = np.stack([driver.forward("r", x) for x in _replay(prompt, expected)])
        blocks = driver.blocks("r")
        assert blocks == tuple(range(n_blocks - 1, n_blocks - 1 - needed, -1))
    else:
        driver = Driver([engine], n_blocks)
        logits = interleaved(driver, prompt, n, np.random.default_rng(0))
        blocks = driver.blocks("r")
        assert blocks == tuple(range(1, 2 * needed, 2))  # the other request holds blocks 0, 2, 4, ...
    assert len(blocks) == needed > 1
    np.testing.assert_array_equal(logits, expected)


def _replay(prompt: np.ndarray, logits: np.ndarray) -> list[np.ndarray]:
    """The inputs of greedy()'s steps that produced `logits`: the prompt, then each step's token."""
    return [prompt] + [np.array([int(np.argmax(row))]) for row in logits[:-1]]


# ---- several requests in one step --------------------------------------------------------------------------


@pytest.mark.parametrize("shards", ["whole", "three shards"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_steps_match_each_request_alone_and_transformers(model_dirs, prompt, other_prompts, arch, shards):
    """Four requests (16, 12, 5 and 63 prompt tokens) joining one after another, all in every engine step: steps
    carry prompt chunks of 7 and decode tokens of requests at different cached lengths, only some of them
    sampled. Each request's tokens and logits are its own, as alone, and as transformers gives them."""
    path = model_dirs[arch]
    engines = load_chain(path, splits=SPLITS if shards == "three shards" else ((0, N_LAYERS),))
    prompts = dict(zip("abcd", [prompt, *other_prompts]))
    n = 12
    together = generate_together(Driver(engines, first_block=5), prompts, n, chunk=7,
                                 joins={"a": 0, "b": 1, "c": 2, "d": 3})
    assert together.widest == 4 and together.mixed_steps >= 5  # the batches were what this test is about
    driver = Driver(engines)
    for rid, p in prompts.items():
        alone_tokens, alone_logits = greedy(driver, p, n, request_id=rid)
        hf_tokens, hf_logits = hf_generate(path, p, n)
        assert together.tokens[rid] == alone_tokens == hf_tokens, rid
        np.testing.assert_allclose(together.stacked(rid), alone_logits, rtol=1e-5, atol=2e-4, err_msg=rid)
        np.testing.assert_allclose(together.stacked(rid), hf_logits, rtol=1e-5, atol=2e-4, err_msg=rid)
    assert len({t for tokens in together.tokens.values() for t in tokens}) > 8  # varied continuations


@pytest.mark.parametrize("kind", INVALID_ITEMS)
def test_an_invalid_item_fails_its_step_and_leaves_the_others_alone(model_dirs, prompt, other_prompts, reference,
                                                                    kind):
    """A step holding an invalid item raises InvalidRequestError; run again without it (as the ring does), the
    other requests' results are exactly those of the same steps never having met it."""
    engines = load_chain(model_dirs["llama"])
    n_blocks = 32
    engines[0].allocate_kv(2 * n_blocks)  # so the first shard runs an item the second refuses
    prompts = {"a": prompt, "b": other_prompts[0], "c": other_prompts[1]}
    bad = invalid_item(kind, n_blocks, engines[0].args.context_length)
    clean = steps_meeting(Driver(engines, n_blocks), prompts, None)
    failed = steps_meeting(Driver(engines, n_blocks), prompts, bad)
    for rid in prompts:
        assert len(clean[rid]) > 3
        np.testing.assert_array_equal(np.stack(failed[rid]), np.stack(clean[rid]), err_msg=rid)
    # And those are the right results: a's are transformers'.
    assert [int(np.argmax(row)) for row in clean["a"]] == reference["llama"][0][:10]
    np.testing.assert_allclose(np.stack(clean["a"]), reference["llama"][1][:10], rtol=1e-5, atol=2e-4)


def test_bfloat16_activations_cross_shards(model_dirs, prompt):
    path = model_dirs["qwen3"]
    chain = load_chain(path, dtype="bfloat16")
    whole = load_engine(path, 0, N_LAYERS, dtype="bfloat16")
    assert whole.dtype_name == "bfloat16"
    hidden = Driver(chain[:1]).forward("probe", prompt)
    assert (hidden.dtype, hidden.shape, len(hidden.data)) == ("bfloat16", (len(prompt), 64), len(prompt) * 64 * 2)
    assert hidden.bits().dtype == np.uint16
    chain_tokens, chain_logits = greedy(Driver(chain), prompt, 4)
    whole_tokens, whole_logits = greedy(Driver([whole]), prompt, 4)
    assert chain_tokens[0] == whole_tokens[0]
    assert chain_tokens == whole_tokens
    # bf16 hidden states travel bit-exactly, so splitting changes nothing at all.
    np.testing.assert_array_equal(chain_logits, whole_logits)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_bfloat16_matches_transformers_bfloat16(model_dirs, prompt, variant):
    """bfloat16 runs on other CPU kernels (packed weights, native matrix-vector); they must agree with
    transformers in bfloat16 too, to within bfloat16 rounding."""
    hf_tokens, hf_logits = hf_generate(model_dirs[variant], prompt, 8, dtype=torch.bfloat16)
    tokens, logits = greedy(Driver([load_engine(model_dirs[variant], 0, N_LAYERS, dtype="bfloat16")]), prompt, 8)
    assert tokens == hf_tokens
    np.testing.assert_allclose(logits, hf_logits, rtol=2e-2, atol=0.1)


def test_float32_shard_accepts_bfloat16_activations(model_dirs, prompt):
    path = model_dirs["llama"]
    first = load_engine(path, 0, 3, dtype="bfloat16")
    rest = load_engine(path, 3, N_LAYERS, dtype="float32")
    hidden = Driver([first]).forward("r", prompt)
    logits = Driver([rest]).forward("r", hidden)
    expected = Driver([load_engine(path, 3, N_LAYERS)]).forward(
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
    real_safe_open = torch_loading.safe_open

    def recording_safe_open(filename, *args, **kwargs):
        opened.append(Path(filename).name)
        return real_safe_open(filename, *args, **kwargs)

    monkeypatch.setattr(torch_loading, "safe_open", recording_safe_open)
    engine = load_engine(path, 6, 8)
    assert set(opened) == expected_files and len(opened) == len(expected_files)

    headers = {file: safetensors_header(path / file) for file in expected_files}
    expected_bytes = 0
    for name in wanted:
        begin, end = headers[weight_map[name]][name]["data_offsets"]
        expected_bytes += end - begin
    assert engine.parameter_bytes() == expected_bytes

    # The shard works on its own: hidden states in, logits out.
    logits = Driver([engine]).forward("r", Activations("float32", (3, 64), np.ones((3, 64), np.float32).tobytes()))
    assert logits.shape == (engine.args.vocab_size,) and np.isfinite(logits).all()


def test_float16_checkpoint_keeps_two_bytes_a_weight_on_cpu(tmp_path, prompt, caplog):
    """On CPU a float16 checkpoint's matrices stay float16 beside float32 activations where the native kernels
    run (test_half_storage.py), else the model runs as bfloat16 (CPU float16 kernels are slow): two bytes a
    weight either way."""
    path = make_checkpoint(tmp_path / "fp16", "qwen2", n_layers=2, dtype=torch.float16)
    args = ModelArgs.from_dir(path)
    assert args.torch_dtype == "float16"
    engine = TorchEngine()  # device and dtype chosen automatically
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert engine.device_name == "cpu"
    with caplog.at_level(logging.INFO, logger=torch_engine.__name__):
        engine.load(path, args, Shard.whole("fp16", 2))
    header = safetensors_header(path / "model.safetensors")
    stored = {name: t["data_offsets"][1] - t["data_offsets"][0] for name, t in header.items()}
    if engine.device.type == "cpu" and engine.half is not None:
        assert (engine.half, engine.dtype_name) == (torch.float16, "float32")
        # the matrices as stored, the vectors (norms, biases) in float32
        assert engine.parameter_bytes() == sum(n if len(header[name]["shape"]) == 2 else 2 * n
                                               for name, n in stored.items())
    else:
        if engine.device.type == "cpu":
            assert engine.dtype_name == "bfloat16"
            assert any("float16 runs as bfloat16" in record.getMessage() for record in caplog.records)
        # float16 -> bfloat16 keeps two bytes per value, whatever layout the CPU kernels store weights in.
        assert engine.parameter_bytes() == sum(stored.values())
    assert np.isfinite(Driver([engine]).forward("r", prompt)).all()
    explicit = TorchEngine(device="cpu", dtype="float32")
    explicit.load(path, args, Shard.whole("fp16", 2))
    assert explicit.dtype_name == "float32" and explicit.device_name == "cpu"


def test_rejects_malformed_inputs(model_dirs, prompt, reference):
    path = model_dirs["llama"]
    first, second = load_engine(path, 0, 3), load_engine(path, 3, N_LAYERS)
    head, tail = Driver([first]), Driver([second])
    with pytest.raises(InvalidRequestError):
        head.forward("r", prompt.astype(np.float32))
    with pytest.raises(InvalidRequestError):
        head.forward("r", np.array([first.args.vocab_size]))
    with pytest.raises(InvalidRequestError):
        head.forward("r", np.array([-1]))
    with pytest.raises(InvalidRequestError):
        tail.forward("r", prompt)
    with pytest.raises(InvalidRequestError):
        tail.forward("r", Activations("float32", (2, 32), np.zeros((2, 32), np.float32).tobytes()))
    with pytest.raises(InvalidRequestError):  # two items of 2 and 4 rows, but hidden states for 3 rows
        second.step([WorkItem("s", "test", 0, 2, (0,), SPEC), WorkItem("t", "test", 0, 4, (1,), SPEC)],
                    Activations("float32", (3, 64), bytes(3 * 64 * 4)))
    with pytest.raises(InvalidRequestError):
        first.step([], prompt)
    assert head.cached_length("r") == 0 and tail.cached_length("r") == 0
    # The rejected steps left nothing behind: the request then runs as if they never happened.
    tokens, logits = greedy(Driver([first, second]), prompt, 4)
    assert tokens == reference["llama"][0][:4]
    np.testing.assert_allclose(logits, reference["llama"][1][:4], rtol=1e-5, atol=2e-4)


# oneDNN products at many row counts, as a serving node's prefill chunks make them, in a process that created a
# torch engine first (the engine caps oneDNN's caches of compiled products; each library reads its size once).
# Prints the resident growth in MB.
MANY_ROW_COUNTS = """
import psutil, torch
from exo_like.engines.torch.engine import TorchEngine
TorchEngine()
torch.set_num_threads(1)
shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i), 16) for o, i in shapes]
process = psutil.Process()
base = process.memory_info().rss
for rows in range(1, 257):
    for weight, (_, inputs) in zip(weights, shapes):
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, inputs), weight, None, "none", [], "")
print((process.memory_info().rss - base) / 2**20)
"""


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch build has no oneDNN")
def test_a_torch_engine_bounds_the_memory_onednn_caches_for_new_row_counts():
    # With the libraries' default caches (1,024 entries each) this grows by about 600 MB; capped, by under 100.
    env = {name: value for name, value in os.environ.items()
           if name not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", MANY_ROW_COUNTS], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    assert float(done.stdout) < 200, f"oneDNN's caches grew the process by {float(done.stdout):.0f} MB"


@pytest.mark.parametrize("bits", [4, 8])  # 8 bits: two packs (Q8_0, as SmolLM2's tied embedding)
def test_an_int4_embedding_reads_its_rows_from_the_packs_in_this_builds_layout(bits: int) -> None:
    from exo_like.models.affine import AffineGroups
    from exo_like.engines.torch.int4 import NibbleCodes, code_planes, int4_packs, pack_layout
    from exo_like.engines.torch.quant import QuantEmbedding

    # AVX-512, AVX2 and scalar builds each write one of the layouts read here: the embedding needs no copy.
    layout = pack_layout()
    assert layout is not None, torch.backends.cpu.get_cpu_capability()
    rng = np.random.default_rng(bits)
    rows, inputs, group = 4096 + 96, 64, 32  # two pack calls; a last block shorter than 64 rows
    groups = AffineGroups(rng.integers(0, 2**bits, (rows, inputs), dtype=np.uint8),
                          rng.random((rows, inputs // group), dtype=np.float32) / 100,
                          -rng.random((rows, inputs // group), dtype=np.float32) / 100, bits, group, "test")
    packs = int4_packs(groups)
    planes = code_planes(groups)
    ids = torch.from_numpy(rng.integers(0, rows, 300))
    for pack, plane in zip(packs, planes):
        assert torch.equal(pack.codes(ids, layout), torch.from_numpy(plane)[ids])
    # A build writing another layout keeps a copy of the codes, two to a byte; its rows are the same to the bit.
    from_packs = QuantEmbedding(packs, torch.float32, layout)
    from_copies = QuantEmbedding(packs, torch.float32, None, [NibbleCodes(plane) for plane in planes])
    assert torch.equal(from_packs(ids), from_copies(ids))
    assert sum(t.nbytes for t in from_copies.tensors()) - sum(t.nbytes for t in from_packs.tensors()) == \
        len(planes) * rows * inputs // 2
