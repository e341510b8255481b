"""Exactness of the MLX engine: greedy tokens equal mlx-lm's on the same checkpoint, and sharding, chunked
prefill, interleaved and batched requests, block tables and partial loading do not change anything."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (install the 'mlx' extra)")

from tokenizers import Tokenizer  # noqa: E402

from exo_like.engines.activations import Activations  # noqa: E402
from exo_like.engines.mlx import engine as mlx_engine  # noqa: E402
from exo_like.engines.mlx.engine import MLXEngine  # noqa: E402
from exo_like.engines.work import (  # noqa: E402
    BLOCK_SIZE,
    WorkItem,  # noqa: E402
    blocks_for,
)
from exo_like.errors import InvalidRequestError  # noqa: E402
from exo_like.models.checkpoint import plan_shard_load, safetensors_header  # noqa: E402
from exo_like.models.config import ModelArgs  # noqa: E402
from exo_like.models.shard import Shard  # noqa: E402
from tests.checkpoints import built_once, make_checkpoint  # noqa: E402
from tests.engine_driver import INVALID_ITEMS, SPEC, Driver, generate_together, invalid_item, steps_meeting  # noqa: E402

# Collections skip what this file keeps (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("objects_kept_by_this_file_frozen", "earlier_tests_objects_frozen")

N_LAYERS = 6
N_TOKENS = 32
# Seed 1 gives every architecture a non-degenerate greedy continuation of PROMPT (tied-embedding models
# otherwise tend to repeat one token, which would make the comparisons weak).
SEED = 1
PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
OTHER_PROMPT = "Memory bandwidth bounds decoding; prefill is bound by compute."
SHORT_PROMPT = "Hello there"
LONG_PROMPT = ("A ring of nodes, each holding some layers of one model, passes hidden states along; the last one "
               "samples the next token and sends it back to the first.")
# name -> (architecture, make_checkpoint keyword arguments)
CASES = {
    "llama": ("llama", {}),
    "llama-hub-config": ("llama", {"hub_style_config": True}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}
UNEVEN_SHARDS = ((0, 1), (1, 4), (4, N_LAYERS))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """name -> checkpoint folder, each written once per session on first use."""
    return built_once(tmp_path_factory.mktemp("mlx_checkpoints"), lambda name, path: make_checkpoint(
        path, CASES[name][0], n_layers=N_LAYERS, seed=SEED, **CASES[name][1]))


def prompt_ids(model_dir: Path, text: str = PROMPT) -> np.ndarray:
    return np.array(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids, dtype=np.int64)


def load_engine(model_dir: Path, start: int, end: int, dtype: str | None = None) -> MLXEngine:
    args = ModelArgs.from_dir(model_dir)
    engine = MLXEngine(dtype=dtype)
    engine.load(model_dir, args, Shard(model_dir.name, start, end, args.num_hidden_layers))
    return engine


def greedy_logits(driver: Driver, prompt: np.ndarray, n_tokens: int = N_TOKENS, request_id: str = "r"
                  ) -> tuple[list[int], np.ndarray]:
    """Greedy tokens of one request through the driver's chain, one step each (the prompt in one), and the
    logits that picked them. The request keeps its blocks."""
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    inputs = prompt
    for _ in range(n_tokens):
        step = driver.forward(request_id, inputs)
        assert isinstance(step, np.ndarray) and step.dtype == np.float32
        logits.append(step)
        tokens.append(int(np.argmax(step)))
        inputs = np.array([tokens[-1]])
    return tokens, np.stack(logits)


def greedy(driver: Driver, prompt: np.ndarray, n_tokens: int = N_TOKENS, request_id: str = "r") -> list[int]:
    return greedy_logits(driver, prompt, n_tokens, request_id)[0]


@pytest.fixture(scope="session")
def whole_model_tokens(model_dir) -> Callable[[str], list[int]]:
    """name -> the whole-model engine's greedy tokens for PROMPT (computed once)."""
    done: dict[str, list[int]] = {}

    def get(name: str) -> list[int]:
        if name not in done:
            path = model_dir(name)
            done[name] = greedy(Driver([load_engine(path, 0, N_LAYERS)]), prompt_ids(path))
        return done[name]

    return get


# ---- mlx-lm as the oracle ------------------------------------------------------------------------------------


def mlx_lm_config_overrides(model_dir: Path) -> dict | None:
    """Rope settings for mlx-lm when it cannot read them from a transformers >= 5 config.json.

    transformers >= 5 writes `rope_parameters` (holding `rope_theta` and any scaling) instead of the Hub's
    `rope_theta` + `rope_scaling`. In mlx-lm 0.32 only some ModelArgs classes (e.g. qwen3) have a
    `rope_parameters` field; llama (which mistral also maps to) and qwen2 do not, and `from_dict` silently drops
    unknown keys, so they fall back to their defaults: rope_theta 10000 (qwen2: 1e6) and no llama3 scaling.
    For those classes, hand mlx-lm the same values under the keys it reads; the Hub-style case needs nothing.
    """
    pytest.importorskip("mlx_lm", reason="mlx-lm (the test oracle) is not installed")
    from mlx_lm.utils import _get_classes

    config = json.loads((model_dir / "config.json").read_text())
    rope = dict(config.get("rope_parameters") or {})
    _, args_class = _get_classes(config)
    if not rope or "rope_parameters" in {f.name for f in dataclasses.fields(args_class)}:
        return None
    theta = rope.pop("rope_theta")
    return {"rope_theta": theta, "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope}


def mlx_lm_greedy(model_dir: Path, prompt: np.ndarray) -> list[int]:
    """mlx-lm's N_TOKENS greedy tokens (computed once per checkpoint and prompt: tests asking again, e.g. for the
    whole model and for three shards, share the answer)."""
    return list(mlx_lm_greedy_once(model_dir, tuple(int(t) for t in prompt)))


@cache
def mlx_lm_model(model_dir: Path):
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm (the test oracle) is not installed")
    return mlx_lm.load(str(model_dir), model_config=mlx_lm_config_overrides(model_dir))[0]


@cache
def mlx_lm_greedy_once(model_dir: Path, prompt: tuple[int, ...]) -> tuple[int, ...]:
    from mlx_lm.generate import generate_step

    # Driving generate_step directly: it never stops at eos, so all N_TOKENS are compared.
    steps = generate_step(
        mx.array(np.array(prompt, dtype=np.int64)), mlx_lm_model(model_dir), max_tokens=N_TOKENS,
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1)
    )
    return tuple(int(token) for token, _ in steps)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_match_mlx_lm(model_dir, whole_model_tokens, name):
    path = model_dir(name)
    expected = mlx_lm_greedy(path, prompt_ids(path))
    assert len(set(expected)) > 1, "degenerate reference continuation; pick another seed or prompt"
    assert whole_model_tokens(name) == expected


def test_hub_style_config_needs_no_help_for_mlx_lm(model_dir):
    # The Hub-style case is the one where mlx-lm reads the config exactly as written.
    assert mlx_lm_config_overrides(model_dir("llama-hub-config")) is None


# ---- sharding and caching ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3"])
def test_three_uneven_shards_match_whole_model(model_dir, whole_model_tokens, name):
    path = model_dir(name)
    driver = Driver([load_engine(path, start, end) for start, end in UNEVEN_SHARDS])
    assert greedy(driver, prompt_ids(path)) == whole_model_tokens(name)
    prompt_and_generated = len(prompt_ids(path)) + N_TOKENS - 1
    assert driver.cached_length("r") == prompt_and_generated
    assert len(driver.blocks("r")) == blocks_for(prompt_and_generated)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bfloat16_shards_chain_like_the_whole_model(model_dir, name):
    path = model_dir(name)
    prompt = prompt_ids(path)
    chain = [load_engine(path, start, end, dtype="bfloat16") for start, end in UNEVEN_SHARDS]
    hidden = Driver(chain[:1]).forward("probe", prompt)
    assert (hidden.dtype, hidden.shape) == ("bfloat16", (len(prompt), 64))
    assert chain[0].dtype_name == "bfloat16"
    whole = load_engine(path, 0, N_LAYERS, dtype="bfloat16")
    assert greedy(Driver(chain), prompt) == greedy(Driver([whole]), prompt)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_chunked_prefill_equals_one_shot(model_dir, name):
    path = model_dir(name)
    driver = Driver([load_engine(path, 0, N_LAYERS)])
    prompt = prompt_ids(path)
    one_shot = driver.forward("one", prompt)
    # Uneven chunks, including a single position in the middle (which runs without a mask).
    for start, end in ((0, 5), (5, 6), (6, len(prompt))):
        chunked = driver.forward("chunked", prompt[start:end])
        assert driver.cached_length("chunked") == end
    np.testing.assert_allclose(chunked, one_shot, rtol=1e-5, atol=1e-5)
    continue_from = np.array([int(np.argmax(one_shot))])
    assert greedy(driver, continue_from, 8, "one") == greedy(driver, continue_from, 8, "chunked")


def test_interleaved_requests_do_not_disturb_each_other(model_dir, whole_model_tokens):
    path = model_dir("qwen2")
    driver = Driver([load_engine(path, start, end) for start, end in UNEVEN_SHARDS])
    prompts = {"a": prompt_ids(path), "b": prompt_ids(path, OTHER_PROMPT)}
    alone_b = greedy(driver, prompts["b"], request_id="b-alone")
    inputs, tokens = dict(prompts), {"a": [], "b": []}
    for _ in range(N_TOKENS):
        for rid in ("a", "b"):
            token = int(np.argmax(driver.forward(rid, inputs[rid])))
            tokens[rid].append(token)
            inputs[rid] = np.array([token])
    assert tokens["a"] == whole_model_tokens("qwen2")
    assert tokens["b"] == alone_b
    driver.release("a")
    assert driver.cached_length("a") == 0
    assert driver.cached_length("b") == len(prompts["b"]) + N_TOKENS - 1


# Block tables unlike the plain one (blocks 0, 1, 2, ... in order): the view with an offset into the pool, and
# the gathered path for tables that are not consecutive.
TABLES = ("from a high block", "descending", "interleaved with another request")


@pytest.mark.parametrize("table", TABLES)
def test_where_the_blocks_lie_changes_nothing(model_dir, table):
    """A request's logits depend on its tokens only, never on which KV blocks hold them, nor on the blocks of
    another request around them."""
    path = model_dir("mistral")
    engine = load_engine(path, 0, N_LAYERS)
    prompt, n, n_blocks = prompt_ids(path), 20, 64
    needed = blocks_for(len(prompt) + n - 1)
    _, expected = greedy_logits(Driver([engine], n_blocks), prompt, n)
    if table == "from a high block":
        driver = Driver([engine], n_blocks, first_block=n_blocks - needed)
        want = tuple(range(n_blocks - needed, n_blocks))
    elif table == "descending":
        driver = Driver([engine], n_blocks, block_ids=range(n_blocks - 1, -1, -1))
        want = tuple(range(n_blocks - 1, n_blocks - 1 - needed, -1))
    else:
        driver = Driver([engine], n_blocks)
        want = tuple(range(1, 2 * needed, 2))  # the other request holds blocks 0, 2, 4, ...
    rng = np.random.default_rng(0)
    logits, inputs = [], prompt
    for _ in range(n):
        if table.startswith("interleaved") and driver.cached_length("r") % BLOCK_SIZE == 0:
            driver.forward("other", rng.integers(0, engine.args.vocab_size, BLOCK_SIZE))  # takes the next block
        logits.append(driver.forward("r", inputs))
        inputs = np.array([int(np.argmax(logits[-1]))])
    assert driver.blocks("r") == want and len(want) > 1
    np.testing.assert_array_equal(np.stack(logits), expected)


def test_inputs_of_the_wrong_kind_are_rejected(model_dir, whole_model_tokens):
    path = model_dir("llama")
    first, middle = load_engine(path, 0, 1), load_engine(path, 1, 4)
    head, body = Driver([first]), Driver([middle])
    hidden = head.forward("r", prompt_ids(path))
    with pytest.raises(InvalidRequestError):
        head.forward("r2", hidden)
    with pytest.raises(InvalidRequestError):
        head.forward("r2", np.array([1, 10_000]))
    with pytest.raises(InvalidRequestError):
        head.forward("r2", np.array([1, -1]))
    with pytest.raises(InvalidRequestError):
        head.forward("r2", np.array([1.0, 2.0]))
    with pytest.raises(InvalidRequestError):
        body.forward("r2", prompt_ids(path))
    with pytest.raises(InvalidRequestError):
        body.forward("r2", Activations("float32", (1, 32), bytes(128)))
    with pytest.raises(InvalidRequestError):  # two items of 2 and 4 rows, but hidden states for 3 rows
        middle.step([WorkItem("s", "test", 0, 2, (0,), SPEC), WorkItem("t", "test", 0, 4, (1,), SPEC)],
                    Activations("float32", (3, 64), bytes(3 * 64 * 4)))
    with pytest.raises(InvalidRequestError):
        first.step([], prompt_ids(path))
    assert head.cached_length("r2") == body.cached_length("r2") == 0
    # The rejected steps left nothing behind: a request then runs as if they never happened.
    last = load_engine(path, 4, N_LAYERS)
    assert greedy(Driver([first, middle, last]), prompt_ids(path), 8) == whole_model_tokens("llama")[:8]


# ---- several requests in one step ----------------------------------------------------------------------------


@pytest.mark.parametrize("shards", ["whole", "three shards"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3"])
def test_batched_steps_match_each_request_alone_and_mlx_lm(model_dir, name, shards):
    """Four requests (16, 12, 5 and 63 prompt tokens) joining one after another, all in every engine step: steps
    carry prompt chunks of 7 and decode tokens of requests at different cached lengths, only some of them
    sampled. Each request's tokens and logits are its own, as alone, and its tokens are mlx-lm's."""
    path = model_dir(name)
    engines = [load_engine(path, start, end) for start, end in (UNEVEN_SHARDS if shards == "three shards"
                                                                  else ((0, N_LAYERS),))]
    texts = (PROMPT, OTHER_PROMPT, SHORT_PROMPT, LONG_PROMPT)
    prompts = {rid: prompt_ids(path, text) for rid, text in zip("abcd", texts)}
    n = 16
    together = generate_together(Driver(engines, first_block=5), prompts, n, chunk=7,
                                 joins={"a": 0, "b": 1, "c": 2, "d": 3})
    assert together.widest == 4 and together.mixed_steps >= 5  # the batches were what this test is about
    driver = Driver(engines)
    for rid, prompt in prompts.items():
        alone_tokens, alone_logits = greedy_logits(driver, prompt, n, request_id=rid)
        driver.release(rid)
        assert together.tokens[rid] == alone_tokens == mlx_lm_greedy(path, prompt)[:n], rid
        np.testing.assert_allclose(together.stacked(rid), alone_logits, rtol=1e-5, atol=1e-5, err_msg=rid)
    assert len({t for tokens in together.tokens.values() for t in tokens}) > 8  # varied continuations


@pytest.mark.parametrize("kind", INVALID_ITEMS)
def test_an_invalid_item_fails_its_step_and_leaves_the_others_alone(model_dir, whole_model_tokens, kind):
    """A step holding an invalid item raises InvalidRequestError; run again without it (as the ring does), the
    other requests' results are exactly those of the same steps never having met it."""
    path = model_dir("llama")
    engines = [load_engine(path, start, end) for start, end in UNEVEN_SHARDS]
    n_blocks = 32
    engines[0].allocate_kv(2 * n_blocks)  # so the first shard runs an item the second refuses
    prompts = {rid: prompt_ids(path, text) for rid, text in zip("abc", (PROMPT, OTHER_PROMPT, SHORT_PROMPT))}
    bad = invalid_item(kind, n_blocks, engines[0].args.context_length)
    clean = steps_meeting(Driver(engines, n_blocks), prompts, None)
    failed = steps_meeting(Driver(engines, n_blocks), prompts, bad)
    for rid in prompts:
        assert len(clean[rid]) > 3
        np.testing.assert_array_equal(np.stack(failed[rid]), np.stack(clean[rid]), err_msg=rid)
    # And those are the right results: a's tokens are the whole model's alone (which are mlx-lm's).
    assert [int(np.argmax(row)) for row in clean["a"]] == whole_model_tokens("llama")[:10]


# ---- loading only what the shard needs -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied and tied (the last stage then needs the embedding)
def test_last_quarter_opens_only_its_files(tmp_path_factory, monkeypatch, arch):
    path = make_checkpoint(
        tmp_path_factory.mktemp("multi_file") / arch, arch, n_layers=8, max_shard_size="100KB", seed=SEED
    )
    args = ModelArgs.from_dir(path)
    shard = Shard(arch, 6, 8, 8)
    plan = plan_shard_load(path, shard, args.tie_word_embeddings)
    all_files = set(path.glob("*.safetensors"))
    assert set(plan.files) < all_files, "the checkpoint should spread over more files than the shard needs"

    opened: list[Path] = []
    real_load = mlx_engine.mx.load

    def spy_load(file, *a, **kw):
        opened.append(Path(file))
        return real_load(file, *a, **kw)

    monkeypatch.setattr(mlx_engine.mx, "load", spy_load)
    engine = MLXEngine()
    engine.load(path, args, shard)

    assert sorted(opened) == sorted(plan.files)
    expected_bytes = 0
    for file, names in plan.files.items():
        header = safetensors_header(file)
        expected_bytes += sum(header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n, _ in names)
    assert engine.parameter_bytes() == expected_bytes
    assert engine.dtype_name == "float32" and engine.device_name.startswith("mlx ")
    logits = Driver([engine]).forward("r", Activations("float32", (3, 64), np.ones((3, 64), np.float32).tobytes()))
    assert logits.shape == (args.vocab_size,) and logits.dtype == np.float32


# A node's life on its engine thread: load, then close when the node stops, then the thread ends and the process
# exits. Without close() the thread's MLX state is destroyed at its exit, racing the interpreter's finalization:
# most such processes abort ("terminate called without an active exception").
ENGINE_THREAD_LIFE = """
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from exo_like.engines.mlx.engine import MLXEngine
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
model_dir = Path(sys.argv[1])
args = ModelArgs.from_dir(model_dir)
engine = MLXEngine(dtype="float32")
thread = ThreadPoolExecutor(1)
n = args.num_hidden_layers
thread.submit(engine.load, model_dir, args, Shard(model_dir.name, 0, n, n)).result()
thread.submit(engine.allocate_kv, 8).result()
thread.submit(engine.close).result()
thread.shutdown(wait=True)
"""


def test_a_process_whose_engine_thread_closed_the_engine_exits_cleanly(model_dir):
    for _ in range(6):
        done = subprocess.run([sys.executable, "-c", ENGINE_THREAD_LIFE, str(model_dir("mistral"))],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
