"""Batch-invariant numerics on the torch CPU engine: a position's logits are bit-identical however the steps that
computed it were batched (one prefill, prompt chunks of any length, decode steps beside other requests at other
lengths), for float32 checkpoints, 16-bit ones (bfloat16 matrices widened beside float32 activations) and every
quantized kind the native kernels run. This is what makes a replay after a node's loss exact (docs/failover.md):
a replay recomputes a request's prompt and tokens in other steps than the ones that first computed them.

Each kernel of the native step sums an output the same way for any number of rows (native/rows.cpp, quant.cpp's
integer kernel, the attention over a row's own slots); the logits of every position are read by asking the head
for every row of each step. The machine's best kernels run here (AVX-512 VNNI or AVX2); subprocesses check their
portable code too (what a CPU without AVX2 runs) under ATen's scalar kernels, and on an AVX-512 machine their AVX2
code (what an AVX2-only machine runs). Skipped where no C++ compiler built the kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from exo_like.engines.torch.attention import step_index
from exo_like.engines.torch.engine import TorchEngine
from exo_like.engines.torch.native import build
from exo_like.engines.work import WorkItem, blocks_for
from exo_like.models.config import ModelArgs
from exo_like.models.gguf.file import open_gguf
from exo_like.models.shard import Shard
from tests.checkpoints import make_checkpoint
from tests.gguf_checkpoints import write_gguf

pytestmark = [pytest.mark.skipif(build.kernels() is None, reason="no native kernels here (no C++ compiler)"),
              pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 300  # positions of the request whose logits are compared
QUANTIZED = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "MXFP4")
BLOCKS_EACH = blocks_for(LENGTH + 64)
# Rows of 256 inputs (K-quants' super-blocks), grouped-query attention, a fused q/k/v and gate/up.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("invariance")
    float_dir = make_checkpoint(root / "float32", "llama", n_layers=2, seed=11, **SHAPE)
    paths = {"float32": float_dir,
             "bfloat16": make_checkpoint(root / "bfloat16", "llama", n_layers=2, seed=11, dtype=torch.bfloat16,
                                         **SHAPE)}
    for kind in QUANTIZED:
        paths[kind] = write_gguf(float_dir, root / f"{kind}.gguf", matrix_type=kind, embedding_type="F32")
    return paths


class Steps:
    """One engine run: requests keep blocks of their own, each step's rows all give logits."""

    def __init__(self, path: Path, n_requests: int):
        self.args = ModelArgs.from_dict(open_gguf(path).config()) if path.suffix == ".gguf" else \
            ModelArgs.from_dir(path)
        self.engine = TorchEngine(device="cpu")
        self.engine.load(path, self.args, Shard.whole("t", self.args.num_hidden_layers))
        self.engine.allocate_kv(BLOCKS_EACH * n_requests)
        self.lengths: dict[str, int] = {}
        self.tables: dict[str, tuple[int, ...]] = {}

    def run(self, batch: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """One step of several requests' next tokens; the logits [count, vocab] of each entry's rows."""
        items = []
        for rid, tokens in batch:
            if rid not in self.tables:  # every other request's table runs backwards: slots not in order
                first = len(self.tables) * BLOCKS_EACH
                table = range(first, first + BLOCKS_EACH)
                self.tables[rid] = tuple(table if len(self.tables) % 2 == 0 else reversed(table))
            start = self.lengths.get(rid, 0)
            items.append(WorkItem(rid, "test", start, len(tokens), self.tables[rid]))
            self.lengths[rid] = start + len(tokens)
        model, pool = self.engine.model, self.engine.pool
        index = step_index(items, pool, self.args, self.engine.device)
        every_row = replace(index, layout=replace(index.layout, sample_rows=np.arange(index.layout.rows)))
        with torch.inference_mode():
            h = model.run_layers(model.embed(torch.from_numpy(np.concatenate([t for _, t in batch]))), pool,
                                 every_row)
            logits = model.head(h, every_row).numpy()
        bounds = np.cumsum([0] + [len(t) for _, t in batch])
        return [logits[a:b] for a, b in zip(bounds, bounds[1:])]


def in_chunks(steps: Steps, rid: str, tokens: np.ndarray, chunk: int) -> np.ndarray:
    return np.concatenate([steps.run([(rid, tokens[i:i + chunk])])[0] for i in range(0, len(tokens), chunk)])


def decoded_beside_others(steps: Steps, rid: str, tokens: np.ndarray, seed: int) -> np.ndarray:
    """A 5-token prompt, then one position a step, each step shared with 1 to 3 other requests feeding random
    chunks (1 to 8 tokens) of random tokens at their own lengths; a new one joins as one reaches 64 positions.
    (Steps of 2 to 25 rows, the request's row anywhere among them: longer chunks of others would only add rows to
    compute, most of this test's time on the portable kernels.)"""
    rng = np.random.default_rng(seed)
    others = [f"{rid}-other-{i}" for i in range(3)]
    made = len(others)
    out = [steps.run([(rid, tokens[:5])])[0]]
    for position in range(5, len(tokens)):
        company = [other for other in others if rng.random() < 0.7] or others[:1]
        batch = [(other, rng.integers(0, steps.args.vocab_size, int(rng.integers(1, 9)))) for other in company]
        slot = int(rng.integers(0, len(batch) + 1))
        batch.insert(slot, (rid, tokens[position:position + 1]))
        out.append(steps.run(batch)[slot])
        for i, other in enumerate(others):
            if steps.lengths.get(other, 0) >= 64:
                others[i], made = f"{rid}-other-{made}", made + 1
    return np.concatenate(out)


def bits(logits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(logits, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", *QUANTIZED])
def test_every_position_is_bit_identical_however_its_steps_were_batched(checkpoints, kind) -> None:
    check(checkpoints[kind], kind)


# The other code the machine can run: the native kernels' portable C++ (what a CPU without AVX2 runs) and ATen's
# scalar kernels (the native step's exact copies and sums take ATen's ops).
OTHER_PATHS = {"EXO_LIKE_NATIVE_ISA": "portable", "ATEN_CPU_CAPABILITY": "default"}


def test_the_portable_kernels_are_batch_invariant_too(checkpoints) -> None:
    """A float32 and a K-quant file (the portable quantized kernel is slow: two kinds keep it short)."""
    check_elsewhere(checkpoints, ("float32", "Q4_K"), OTHER_PATHS, "kernels portable (EXO_LIKE_NATIVE_ISA), aten default")


@pytest.mark.skipif(build.kernels() is None or not build.kernels().kernel_name().startswith("avx512"),
                    reason="the AVX2 kernels are what this machine runs (no AVX-512 VNNI): checked above")
def test_the_avx2_kernels_are_batch_invariant_on_an_avx512_machine_too(checkpoints) -> None:
    """Every quantized code layout (nibbles, 5/6-bit, bytes) and groups of 16, on the kernels an AVX2 CPU runs."""
    check_elsewhere(checkpoints, ("Q4_1", "Q6_K", "Q8_0"), {"EXO_LIKE_NATIVE_ISA": "avx2"},
                    "kernels avx2 (EXO_LIKE_NATIVE_ISA)")


def check_elsewhere(checkpoints, kinds: tuple[str, ...], env: dict[str, str], says: str) -> None:
    """`check` for each kind in a subprocess whose environment picks other kernels, and that it ran those."""
    script = "import sys; from pathlib import Path; from tests.engines.test_batch_invariance import check; " \
             "[check(Path(path), kind) for path, kind in zip(sys.argv[1::2], sys.argv[2::2])]"
    done = subprocess.run([sys.executable, "-c", script, *[str(a) for k in kinds for a in (checkpoints[k], k)]],
                          cwd=ROOT, timeout=600, env={**os.environ, **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count(says) == len(kinds), done.stdout[-2000:]


def check(path: Path, kind: str) -> None:
    """Every position's logits in one prefill, against chunks of 1, 7 and 64 and decode steps beside others."""
    print(f"kernels {build.kernels().kernel_name()}, aten {torch.backends.cpu.get_cpu_capability().lower()}")
    # One engine, each way of computing the sequence a request of its own (the pool holds them all).
    steps = Steps(path, 4 + LENGTH // 2)
    assert steps.engine.model.native_decode is not None, "the native step must run this shard"
    tokens = np.random.default_rng(3).integers(0, steps.args.vocab_size, LENGTH)
    one_prefill = steps.run([("prefill", tokens)])[0]
    assert one_prefill.shape == (LENGTH, steps.args.vocab_size) and np.isfinite(one_prefill).all()
    assert len(set(one_prefill.argmax(-1).tolist())) > 3  # a model whose logits vary along the sequence
    for chunk in (1, 7, 64):
        np.testing.assert_array_equal(bits(in_chunks(steps, f"chunks-{chunk}", tokens, chunk)), bits(one_prefill),
                                      err_msg=f"{kind}: chunks of {chunk} against one prefill")
    np.testing.assert_array_equal(bits(decoded_beside_others(steps, "decoded", tokens, seed=len(kind))),
                                  bits(one_prefill), err_msg=f"{kind}: decode steps beside others against one prefill")
