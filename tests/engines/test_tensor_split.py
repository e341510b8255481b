"""Tensor-parallel engines in one process: each rank an engine (torch or MLX) on its own thread, holding its slice of
every layer (models/tensor_split.py), the group's all-reduce a fake that adds the ranks' partial sums in rank order.
Greedy tokens and logits must be the single engine's, for every family the split handles; the real group (worker
processes over torch.distributed) is tested in tests/tensor_parallel/.

MLX (>= 0.31.2) gives each thread its own default stream: a rank's thread builds its graphs on its own stream, and
arrays cross threads only evaluated (the fake's partial sums are evaluated before another rank reads them)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from exo_like.engines.activations import Activations
from exo_like.engines.base import Engine
from exo_like.engines.choice import create_engine
from exo_like.engines.tensor_group import TensorGroup
from exo_like.engines.torch.engine import DTYPE_NAMES, TORCH_DTYPES
from exo_like.engines.work import WorkItem
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard
from exo_like.models.tensor_split import TensorSplit, head_ranges, rank_args, split_refusal
from tests.checkpoints import make_checkpoint
from tests.engine_driver import Driver

# Collections skip what this file keeps (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("objects_kept_by_this_file_frozen", "earlier_tests_objects_frozen")

N_TOKENS = 48
PROMPT = np.array([3, 17, 29, 5, 11, 42, 7, 19, 23, 2, 31, 13], dtype=np.int64)


class Shared:
    """What the fake group's ranks share: the partial sums of the all-reduce under way, the followers' inboxes."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=30)
        self.parts: list[Any] = [None] * size
        self.inboxes = [queue.Queue() for _ in range(size)]


class ThreadGroup(TensorGroup):
    def __init__(self, rank: int, size: int, shared: Shared):
        self.rank, self.size, self.shared = rank, size, shared
        self.reduces = 0

    def all_reduce(self, tensor: Any) -> Any:
        self.reduces += 1
        self.shared.parts[self.rank] = computed(tensor)
        self.shared.barrier.wait()
        total = self.shared.parts[0]
        for part in self.shared.parts[1:]:
            total = total + part
        computed(total)
        self.shared.barrier.wait()  # everyone has read every part before any is replaced
        return total

    def share_step(self, items: Sequence[WorkItem], hidden: Activations) -> None:
        for inbox in self.shared.inboxes[1:]:
            inbox.put((list(items), hidden))


def computed(tensor: Any) -> Any:
    """The tensor with its value in memory: MLX's arrays are lazy graphs, which must not reach another thread."""
    if not isinstance(tensor, torch.Tensor):
        import mlx.core as mx

        mx.eval(tensor)
    return tensor


def follow(engine: Engine, inbox: queue.Queue) -> None:
    while (step := inbox.get()) is not None:
        engine.follow(*step)
    engine.close()  # MLX: the thread's streams go with the thread, not at the interpreter's exit


class Group:
    """`size` engines holding the model's ranks; the leader's steps drive the followers' threads."""

    def __init__(self, engine_name: str, model_dir: Path, args: ModelArgs, size: int, dtype: str | None = "float32"):
        shared = Shared(size)
        self.engines = []
        for rank in range(size):
            engine = create_engine(engine_name, device="cpu", dtype=dtype)
            engine.group = ThreadGroup(rank, size, shared)
            engine.load(model_dir, args, replace(Shard.whole(model_dir.name, args.num_hidden_layers),
                                                 tp=TensorSplit(rank, size)))
            engine.allocate_kv(64)
            self.engines.append(engine)
        self.shared = shared
        self.threads = [threading.Thread(target=follow, args=(engine, shared.inboxes[rank]), daemon=True)
                        for rank, engine in enumerate(self.engines) if rank]
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        for inbox in self.shared.inboxes[1:]:
            inbox.put(None)
        for thread in self.threads:
            thread.join(timeout=30)


def decoded_by_group(engine_name: str, path: Path, args: ModelArgs, size: int, dtype: str | None = "float32"
                     ) -> tuple[Group, list[int], np.ndarray]:
    """A group of `size` ranks, its leader's greedy tokens and logits (the group closed after)."""
    group = Group(engine_name, path, args, size, dtype)
    try:
        return group, *greedy(Driver(group.engines[:1], n_blocks=64))
    finally:
        group.close()


def greedy(driver: Driver, n_tokens: int = N_TOKENS) -> tuple[list[int], np.ndarray]:
    tokens, logits, inputs = [], [], PROMPT
    for _ in range(n_tokens):
        out = driver.forward("r", inputs)
        logits.append(out)
        tokens.append(int(np.argmax(out)))
        inputs = np.array([tokens[-1]], dtype=np.int64)
    return tokens, np.stack(logits)


# (architecture, config overrides): dense, GQA, KV heads fewer than ranks (replicated), mixtures of experts with
# and without a shared expert, biases split and added once (Qwen2's q/k/v, gpt-oss's o_proj and experts), sinks,
# sandwich norms with soft-capping and windows (Gemma 2), fused q/k/v and gate/up (Phi-3), latent attention split by
# head with its latent cache replicated (DeepSeek V3: q through its low-rank bottleneck, sigmoid routing; V2-Lite: a
# plain q projection, softmax routing, two shared experts), 4 heads over 3 ranks splitting 2, 1, 1.
CASES = {
    "llama": ("llama", {}),
    "mistral-mha": ("mistral", {"num_key_value_heads": 4}),
    "qwen3-one-kv-head": ("qwen3", {"num_key_value_heads": 1}),
    "qwen2": ("qwen2", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "gpt_oss": ("gpt_oss", {}),
    "gemma2": ("gemma2", {}),
    "phi3": ("phi3", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v2": ("deepseek_v2", {}),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tensor-split")
    return {name: make_checkpoint(root / name, arch, n_layers=3, seed=5, **overrides)
            for name, (arch, overrides) in CASES.items()}


@pytest.fixture(scope="module")
def one_engine(model_dirs):
    """(engine, case) -> one engine's greedy tokens and logits, decoded once for both group sizes."""
    decoded: dict[tuple[str, str], tuple[list[int], np.ndarray]] = {}

    def get(engine_name: str, name: str) -> tuple[list[int], np.ndarray]:
        if (engine_name, name) not in decoded:
            model_dir = model_dirs[name]
            args = ModelArgs.from_dir(model_dir)
            whole = create_engine(engine_name, device="cpu", dtype="float32")
            whole.load(model_dir, args, Shard.whole(model_dir.name, args.num_hidden_layers))
            decoded[engine_name, name] = greedy(Driver([whole], n_blocks=64))
        return decoded[engine_name, name]

    return get


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("engine_name", ["torch", "mlx"])
def test_a_group_decodes_what_one_engine_does(model_dirs, one_engine, engine_name, name, size):
    if engine_name == "mlx":
        pytest.importorskip("mlx.core", reason="mlx is not installed (install the 'mlx' extra)")
    model_dir = model_dirs[name]
    args = ModelArgs.from_dir(model_dir)
    tokens, logits = one_engine(engine_name, name)
    group, group_tokens, group_logits = decoded_by_group(engine_name, model_dir, args, size)
    assert group_tokens == tokens
    relative = np.abs(group_logits - logits).max() / np.abs(logits).max()
    assert relative < 1e-4, relative
    # two sums a layer, for every step, on every rank
    assert {engine.group.reduces for engine in group.engines} == {2 * args.num_hidden_layers * N_TOKENS}


def test_heads_split_in_whole_kv_groups_or_kv_heads_replicate():
    assert head_ranges(8, 4, 2) == [(0, 4, 0, 2), (4, 8, 2, 4)]
    assert head_ranges(8, 4, 3) == [(0, 4, 0, 2), (4, 6, 2, 3), (6, 8, 3, 4)]  # uneven: by KV group
    assert head_ranges(4, 2, 3) == [(0, 1, 0, 1), (1, 2, 0, 1), (2, 4, 1, 2)]  # KV head 0 on ranks 0 and 1
    assert head_ranges(4, 1, 4) == [(0, 1, 0, 1), (1, 2, 0, 1), (2, 3, 0, 1), (3, 4, 0, 1)]


def test_a_rank_holds_its_share_of_heads_and_units(model_dirs):
    args = ModelArgs.from_dir(model_dirs["qwen2_moe"])
    parts = [rank_args(args, TensorSplit(rank, 3)) for rank in range(3)]
    assert sum(p.num_attention_heads for p in parts) == args.num_attention_heads
    assert sum(p.moe.expert_size for p in parts) == args.moe.expert_size
    assert sum(p.moe.shared_expert_size for p in parts) == args.moe.shared_expert_size
    assert {p.moe.n_experts for p in parts} == {args.moe.n_experts}  # every rank runs every expert's slice


def test_models_that_cannot_split_say_why(model_dirs):
    args = ModelArgs.from_dir(model_dirs["llama"])  # 4 heads, 2 KV heads, MLP 160 wide
    assert split_refusal(args, 4) is None
    assert split_refusal(args, 5) == "4 attention heads cannot be split over 5 ranks"
    assert split_refusal(replace(args, intermediate_size=3), 4) == "an MLP 3 units wide cannot be split over 4 ranks"
    assert split_refusal(ModelArgs.from_dir(model_dirs["deepseek_v3"]), 5) == \
        "4 attention heads cannot be split over 5 ranks"


# Quantized checkpoints on torch ranks, kept quantized (4-bit groups on the int4 kernel where it takes them): every
# row-parallel split falls on whole quantization groups (64 inputs for the MLX-format one, 32 for GGUF's K-quants).
QUANTIZED_SHAPE = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512}
# DeepSeek's per-head projections quantized too (every input a multiple of 32), each MLP 96 units (3 x 32) wide
DEEPSEEK_SHAPE = {"hidden_size": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                  "v_head_dim": 32, "intermediate_size": 192, "moe_intermediate_size": 96}


@pytest.fixture(scope="module")
def quantized_dirs(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("mlx_lm", reason="mlx-lm (converts the MLX-format checkpoint) is not installed")
    from mlx_lm.convert import convert

    from tests.gguf_checkpoints import write_gguf

    root = tmp_path_factory.mktemp("tensor-split-quantized")
    float_dir = make_checkpoint(root / "float", "llama", n_layers=3, seed=5, hub_style_config=True,
                                **QUANTIZED_SHAPE)
    convert(str(float_dir), mlx_path=str(root / "mlx-q4"), quantize=True, q_group_size=64, q_bits=4,
            dtype="float32")
    (root / "gguf").mkdir()
    gguf = write_gguf(float_dir, root / "gguf" / "model-Q4_K.gguf", "Q4_K", "Q8_0")
    dirs = {"mlx-q4": root / "mlx-q4", "gguf-q4k": gguf}
    for arch, extra in (("deepseek_v3", {"q_lora_rank": 64}), ("deepseek_v2", {})):
        deepseek = make_checkpoint(root / arch, arch, n_layers=3, seed=5, **DEEPSEEK_SHAPE, **extra)
        dirs[f"{arch}-gguf-q8"] = write_gguf(deepseek, root / f"{arch}-Q8_0.gguf", "Q8_0")
    hub_style = make_checkpoint(root / "deepseek_v3-hub", "deepseek_v3", n_layers=3, seed=5, hub_style_config=True,
                                q_lora_rank=64, **DEEPSEEK_SHAPE)
    convert(str(hub_style), mlx_path=str(root / "deepseek_v3-mlx-q4"), quantize=True, q_group_size=32, q_bits=4,
            dtype="float32")  # (mlx-lm stores the per-head projections, quantized)
    dirs["deepseek_v3-mlx-q4"] = root / "deepseek_v3-mlx-q4"
    return dirs


def quantized_args(path: Path) -> ModelArgs:
    from exo_like.models.gguf.file import is_gguf, open_gguf

    return ModelArgs.from_dict(open_gguf(path).config()) if is_gguf(path) else ModelArgs.from_dir(path)


def forced(engines: list[Engine], tokens: list[int]) -> np.ndarray:
    """Logits of the prompt and then of each of `tokens` fed in turn (every engine sees the same inputs)."""
    driver, logits = Driver(engines, n_blocks=64), []
    for inputs in [PROMPT, *(np.array([t], dtype=np.int64) for t in tokens[:-1])]:
        logits.append(driver.forward("r", inputs))
    return np.stack(logits)


@pytest.mark.parametrize(("name", "size"), [("mlx-q4", 2), ("gguf-q4k", 2), ("deepseek_v3-gguf-q8", 2),
                                            ("deepseek_v3-gguf-q8", 3), ("deepseek_v2-gguf-q8", 2),
                                            ("deepseek_v2-gguf-q8", 3)])
def test_torch_ranks_split_quantized_checkpoints_on_their_groups(quantized_dirs, name, size, monkeypatch):
    """A quantized kernel rounds (the native kernels the activations to 16-bit blocks, torch's int4 kernel every
    product to bfloat16) and what no kernel takes is held dequantized in bfloat16, so one quantized engine differs
    from exact arithmetic (the same weights dequantized, in float64) by an error E of its own. The ranks do the same
    arithmetic: the same matrices on the same kernels, row-parallel splits falling on whole activation blocks and
    quantization groups, only the partial sums added in another order (and on the int4 kernel each rounded): each
    side is E away from exact arithmetic, so the group is within 2E of the single engine (not within E: its own
    rounding lands elsewhere, and on some CPUs the two differed by a little more than E); and greedy choices agree
    wherever the two best logits are further apart than twice the difference."""
    path = quantized_dirs[name]
    args = quantized_args(path)
    # float64 is no --dtype a node offers; the engine runs it as any other float dtype (dequantized weights)
    monkeypatch.setitem(TORCH_DTYPES, "float64", torch.float64)
    monkeypatch.setitem(DTYPE_NAMES, torch.float64, "float64")
    engines = {kind: create_engine("torch", device="cpu", dtype=dtype) for kind, dtype in
               (("whole", None), ("exact", "float64"))}
    for engine in engines.values():
        engine.load(path, args, Shard.whole(path.name, args.num_hidden_layers))
    assert engines["exact"].model.norm.weight.dtype == torch.float64
    tokens, whole = greedy(Driver([engines["whole"]], n_blocks=64))
    exact = forced([engines["exact"]], tokens)
    group = Group("torch", path, args, size, dtype=None)
    try:
        leader, follower = group.engines[:2]
        # every layer matrix stays quantized on both ranks (what the whole model dequantizes, its vocabulary of 617
        # rows, only the leader holds)
        assert follower.weight_forms.quantized and not follower.weight_forms.dequantized
        assert leader.weight_forms.dequantized == engines["whole"].weight_forms.dequantized
        split = forced(group.engines[:1], tokens)
    finally:
        group.close()
    kernel_error = np.abs(whole.astype(np.float64) - exact).max()
    difference = np.abs(split.astype(np.float64) - whole).max(axis=1)
    assert difference.max() <= 2 * kernel_error, (difference.max(), kernel_error)
    top2 = np.sort(whole, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * difference
    assert clear.sum() >= len(tokens) // 2
    assert (split.argmax(axis=1) == whole.argmax(axis=1))[clear].all()


def test_quantized_splits_refuse_what_falls_off_their_groups(quantized_dirs):
    args = quantized_args(quantized_dirs["mlx-q4"])
    assert split_refusal(args, 2, align=64) is None
    assert split_refusal(args, 3, align=64) is None  # ranks hold 2, 2 and 4 heads: 64, 64 and 128 values
    assert split_refusal(args, 3, align=128) == \
        "heads of 32 values do not split on quantization groups of 128 over 3 ranks"
    assert split_refusal(replace(args, intermediate_size=544), 2, align=64) == \
        "an MLP 544 units wide does not split on quantization groups of 64"


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("engine_name", ["torch", "mlx"])
def test_a_group_decodes_a_deepseek_gguf_file_as_one_engine_does_its_checkpoint(model_dirs, one_engine, tmp_path,
                                                                                 engine_name, name, size):
    """The file's per-head projections (attn_k_b, attn_v_b) split by head as the checkpoint's kv_b_proj does: the
    group's tokens are the single engine's on the checkpoint (transformers', tests/engines/test_families.py)."""
    if engine_name == "mlx":
        pytest.importorskip("mlx.core", reason="mlx is not installed (install the 'mlx' extra)")
    from tests.gguf_checkpoints import write_gguf

    path = write_gguf(model_dirs[name], tmp_path / "model-F32.gguf", "F32")
    args = quantized_args(path)
    tokens, logits = one_engine(engine_name, name)
    _, group_tokens, group_logits = decoded_by_group(engine_name, path, args, size)
    assert group_tokens == tokens
    assert np.abs(group_logits - logits).max() / np.abs(logits).max() < 1e-4


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", ["mlx-q4", "deepseek_v3-mlx-q4"])
def test_mlx_ranks_split_quantized_checkpoints_on_their_groups(quantized_dirs, name, size):
    """MLX ranks hold their slices of every quantized matrix quantized (packed words, scales and biases cut
    together on whole groups; DeepSeek's per-head projections by head): the same products as the whole engine's,
    only the row-parallel partial sums added in another order."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (install the 'mlx' extra)")
    path = quantized_dirs[name]
    args = ModelArgs.from_dir(path)
    whole = create_engine("mlx", device="cpu")
    whole.load(path, args, Shard.whole(path.name, args.num_hidden_layers))
    tokens, logits = greedy(Driver([whole], n_blocks=64))
    group, group_tokens, group_logits = decoded_by_group("mlx", path, args, size, dtype=None)
    # (the leader also holds the embedding and the head; MLX-format files have no dequantized matrices)
    assert group.engines[0].weight_forms == whole.weight_forms
    assert all(engine.weight_forms.quantized for engine in group.engines[1:])
    assert sum(engine.parameter_bytes() for engine in group.engines) < 1.5 * whole.parameter_bytes()
    assert group_tokens == tokens
    assert np.abs(group_logits - logits).max() / np.abs(logits).max() < 1e-4
