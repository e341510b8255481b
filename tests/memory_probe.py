"""Resident memory of a real `exo-like` node holding a 4-bit model, against the same node without a model.

Shared by tests/engines/test_memory.py (which asserts the issue's bounds) and bench/bench_memory.py (which prints them,
with the float reference path beside them). The checkpoints are random but large enough that a node which
dequantized its matrices to bfloat16 (3.6x the stored bytes of Q4_K) would break the resident bound.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.api_server import NodeProcess, start_node
from tests.checkpoints import make_checkpoint
from tests.cluster_harness import wait_until_ready
from tests.gguf_checkpoints import write_gguf

# A llama of ~135M parameters: ~77 MB as Q4_K, ~85 MB in MLX's 4-bit format (groups of 64, bfloat16 scales).
SHAPE = {"n_layers": 12, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
         "num_key_value_heads": 4, "rope_scaling": None, "seed": 1}
PARAMETER_RATIO = 1.15  # parameters held / stored bytes, at most
RESIDENT_RATIO, RESIDENT_SLACK = 1.2, 100e6  # resident growth <= ratio * stored bytes + slack


@dataclass(frozen=True)
class Checkpoint:
    name: str
    path: Path
    stored_bytes: int  # the weight files' bytes


@dataclass(frozen=True)
class Measurement:
    checkpoint: Checkpoint
    dtype: str | None
    parameter_bytes: int  # what the node's engine holds (GET /health)
    resident_growth: int  # the node's resident memory after a request, minus that of a node without a model
    weights: dict  # GET /health's "weights"

    @property
    def parameter_ratio(self) -> float:
        return self.parameter_bytes / self.checkpoint.stored_bytes

    @property
    def resident_limit(self) -> float:
        return RESIDENT_RATIO * self.checkpoint.stored_bytes + RESIDENT_SLACK

    def summary(self) -> str:
        return (f"{self.checkpoint.name}: stored {self.checkpoint.stored_bytes / 1e6:.1f} MB, parameters "
                f"{self.parameter_bytes / 1e6:.1f} MB ({self.parameter_ratio:.2f}x), resident growth after a request "
                f"{self.resident_growth / 1e6:.1f} MB (limit {self.resident_limit / 1e6:.1f} MB)")


def build_checkpoints(root: Path) -> list[Checkpoint]:
    """A GGUF Q4_K file (every matrix Q4_K, the embedding too) and, where mlx-lm is installed, the same model in
    MLX's 4-bit format."""
    float_dir = root / "float"
    made = [q4_k_checkpoint("GGUF Q4_K", float_dir, root / "q4_k.gguf", "llama", SHAPE)]
    if importlib.util.find_spec("mlx_lm") is not None:
        mlx_dir = root / "mlx-4bit"
        if not mlx_dir.exists():
            from mlx_lm.convert import convert

            convert(str(float_dir), mlx_path=str(mlx_dir), quantize=True, q_group_size=64, q_bits=4)
        made.append(Checkpoint("MLX 4-bit", mlx_dir, sum(f.stat().st_size for f in mlx_dir.glob("*.safetensors"))))
    return made


# A Qwen3-MoE of ~200M parameters, ~110 MB as Q4_K: 16 experts of 512 per layer, 4 per token. Split over two nodes,
# each holds ~55 MB of layers: a node that held its experts dequantized (3.6x) would break the resident bound.
MOE_SHAPE = {"n_layers": 8, "hidden_size": 1024, "head_dim": 64, "num_attention_heads": 16, "num_key_value_heads": 4,
             "intermediate_size": 1024, "moe_intermediate_size": 512, "num_experts": 16, "num_experts_per_tok": 4,
             "mlp_only_layers": [], "seed": 1}


def build_moe_checkpoint(root: Path) -> Checkpoint:
    return q4_k_checkpoint("Qwen3-MoE GGUF Q4_K", root / "moe-float", root / "moe-q4_k.gguf", "qwen3_moe", MOE_SHAPE)


def q4_k_checkpoint(name: str, float_dir: Path, gguf: Path, arch: str, shape: dict) -> Checkpoint:
    """A random checkpoint of `shape` as a GGUF file with every matrix Q4_K (each built once)."""
    if not (float_dir / "config.json").exists():
        make_checkpoint(float_dir, arch, **shape)
    if not gguf.exists():
        write_gguf(float_dir, gguf, "Q4_K", "Q4_K")
    return Checkpoint(name, gguf, gguf.stat().st_size)


def resident_bytes(node: NodeProcess) -> int:
    return psutil.Process(node.process.pid).memory_info().rss


TORCH_NODE = ("--engine", "torch")
DEFAULT_NODE: tuple[str, ...] = ()  # what `make run` starts: no engine named (torch on a machine without MLX)


def baseline(home: Path, options: tuple[str, ...] = TORCH_NODE) -> int:
    """Resident memory of a node started without a model (with `options`), once it serves."""
    node = start_node(home, None, "--no-mdns", *options, threads=2)
    try:
        node.get_json("/health")
        return resident_bytes(node)
    finally:
        node.stop()


def measure(home: Path, checkpoint: Checkpoint, without_model: int, dtype: str | None = None,
            options: tuple[str, ...] = TORCH_NODE, chat: bool = False) -> Measurement:
    """Start a node on the checkpoint (with `options`, as `baseline` was), answer one request (a chat one with
    `chat`), and read its memory."""
    extra = ["--dtype", dtype] if dtype else []
    node = start_node(home, str(checkpoint.path), "--no-mdns", *options, *extra, threads=2)
    try:
        wait_until_ready([node], 1, timeout=300)
        status, raw = one_request(node, str(checkpoint.path), chat)
        assert status == 200, raw
        weights = node.get_json("/health")["weights"]
        return Measurement(checkpoint, dtype, weights["parameter_bytes"], resident_bytes(node) - without_model,
                           weights)
    finally:
        node.stop()


def one_request(node: NodeProcess, model: str, chat: bool) -> tuple[int, bytes]:
    if chat:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        path, body = "/v1/chat/completions", {"messages": messages}
    else:
        path, body = "/v1/completions", {"prompt": "The capital of France is"}
    body.update({"model": model, "max_tokens": 16, "temperature": 0})
    status, _, raw = node.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, raw
