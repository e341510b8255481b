"""Decode steps as CUDA graphs run padded (engines/torch/cuda/graphs.py): rows to a bucket, every request's
positions to a bucket, padding rows writing to the pool's spare block. On CPU the same padded step runs eagerly
(graphs are captured on a GPU only, bench/cuda_check.py): here it must decode what the unpadded step does, for one
request and for several at different lengths (padding rows among them), on a first, a middle and a last stage."""

from __future__ import annotations

import numpy as np
import pytest

from exo_like.engines.choice import create_engine
from exo_like.engines.torch.cuda.graphs import ROWS, DecodeGraphs, refusal
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from tests.checkpoints import make_checkpoint
from tests.engine_driver import Driver

# Collections skip what this file keeps (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("objects_kept_by_this_file_frozen", "earlier_tests_objects_frozen")

N_BLOCKS = 64
PROMPTS = {"a": [3, 17, 29, 5, 11, 42, 7], "b": [19, 23, 2, 31, 13, 8, 9, 10, 44, 45, 46, 3, 5, 7, 11, 13, 17, 19,
                                                 23], "c": [4]}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-graphs")
    return {arch: make_checkpoint(root / arch, arch, n_layers=3, seed=5) for arch in ("llama", "qwen3", "phi3")}


def chain(model_dir, graphs: bool) -> list:  # noqa: ANN001
    """The model as three one-layer shards (first, middle, last), each with its padded decode path or not."""
    args = ModelArgs.from_dir(model_dir)
    engines = []
    for layer in range(3):
        engine = create_engine("torch", device="cpu", dtype="float32")
        engine.load(model_dir, args, Shard(model_dir.name, layer, layer + 1, 3))
        engine.model.native_decode = None  # both sides on the Python layers: the padding is what differs
        engine.allocate_kv(N_BLOCKS)
        if graphs:
            assert refusal(engine.model) is None
            engine.pool = engine.model.new_pool(N_BLOCKS, spare=1)
            engine.graphs = DecodeGraphs(engine.model, engine.pool, capture=False)
        engines.append(engine)
    return engines


def decode_together(engines: list, n_steps: int) -> dict[str, list[np.ndarray]]:
    """Each prompt's prefill, then n_steps steps of every request's next greedy token together; every step's
    logits per request."""
    driver = Driver(engines, n_blocks=N_BLOCKS)
    last = {rid: np.array(prompt, dtype=np.int64) for rid, prompt in PROMPTS.items()}
    logits: dict[str, list[np.ndarray]] = {rid: [] for rid in PROMPTS}
    for rid in PROMPTS:
        out = driver.forward(rid, last[rid])
        logits[rid].append(out)
        last[rid] = np.array([int(np.argmax(out))], dtype=np.int64)
    for step in range(n_steps):
        active = list(PROMPTS) if step % 3 else ["b"]  # alone, and three together (a padding row among them)
        out = driver.step([(rid, last[rid]) for rid in active])
        for rid, row in zip(active, out):
            logits[rid].append(row)
            last[rid] = np.array([int(np.argmax(row))], dtype=np.int64)
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_the_padded_decode_step_computes_what_the_step_does(model_dirs, arch):
    padded_engines = chain(model_dirs[arch], graphs=True)
    padded = decode_together(padded_engines, 9)
    plain = decode_together(chain(model_dirs[arch], graphs=False), 9)
    assert {len(engine.graphs.buckets) for engine in padded_engines} == {2}  # (1, 128) and (4, 128)
    assert {key[0] for key in padded_engines[0].graphs.buckets} == {1, 4} and 4 in ROWS
    for rid in PROMPTS:
        assert [int(np.argmax(x)) for x in padded[rid]] == [int(np.argmax(x)) for x in plain[rid]], rid
        # (sdpa over a padded, masked row sums in another order than over the row alone)
        np.testing.assert_allclose(np.stack(padded[rid]), np.stack(plain[rid]), rtol=1e-5, atol=1e-4)


def test_mixtures_windows_and_ranks_are_not_captured(tmp_path):
    for arch, why in (("qwen3_moe", "a mixture of experts"), ("gemma3_text", "sliding-window layers")):
        model_dir = make_checkpoint(tmp_path / arch, arch, n_layers=2, seed=5)
        args = ModelArgs.from_dir(model_dir)
        engine = create_engine("torch", device="cpu", dtype="float32")
        engine.load(model_dir, args, Shard.whole(model_dir.name, args.num_hidden_layers))
        assert refusal(engine.model).startswith(why)
