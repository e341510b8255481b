"""Exactness on llama.cpp's own Q4_K_M: a file made by `llama-quantize` gives the same float32 greedy tokens on
exo-like as on transformers loading the same file.

A random checkpoint (tests/checkpoints.py; rows of 256 so K-quants apply, no rope scaling) is converted to an F32
GGUF by llama.cpp's converter and quantized to Q4_K_M by llama-quantize (../shared/tools/llamacpp.sh), so the
file has the tensor types and block values llama.cpp itself picks (Q4_K, Q6_K, ...), not the tests' simpler
quantizers. Then, from the same prompt ids, transformers' greedy tokens (`from_pretrained(folder,
gguf_file=...)`, which dequantizes to float32) against each engine's with --dtype float32 (the dequantized
reference path): torch, and mlx when it is installed. Exit status 1 on any mismatch.

The mixture and newer families (qwen3_moe, qwen2_moe, mixtral, gpt_oss, deepseek_v3, deepseek_v2), which
transformers' GGUF loader does not read, are compared with transformers on the values the file holds (gguf's reader
dequantizes every tensor, put back under the checkpoint's names: tests/oracle.py gguf_dequantized_greedy, whose
inverse of the converter's layout is checked against that converter).

`llama3` is a llama checkpoint with Llama 3.1's rope scaling (`rope_type: llama3`, an original context short
enough to change the frequencies at this head_dim), which the converter writes as the tensor rope_freqs.weight.
transformers' GGUF loader ignores that tensor, so its reference is given the checkpoint's config.json (the
file's tensors, the llama3 rope the factors encode).

Usage: python bench/check_llamacpp_q4km.py [--archs llama,qwen2,llama3,qwen3_moe,gpt_oss,deepseek_v3,...]
           [--layers 4] [--seed S] [--tokens 32] [--type Q4_K_M]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_vs_llamacpp import llamacpp  # noqa: E402  (first: it limits OpenMP's spin before torch is imported)
from safetensors.numpy import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from exo_like.engines.choice import create_engine  # noqa: E402
from exo_like.models.config import ModelArgs  # noqa: E402
from exo_like.models.gguf.file import open_gguf  # noqa: E402
from exo_like.models.shard import Shard  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.engine_driver import Driver  # noqa: E402
from tests.models.test_gguf_families import GGUF_OVERRIDES, K_OVERRIDES  # noqa: E402
from tests.oracle import gguf_dequantized_greedy  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
K_SIZES = {"hidden_size": 256, "intermediate_size": 512}  # K-quant rows are multiples of 256 values
# Seeds whose greedy continuation is not one token repeated (random qwen2 models at this size often are).
SEEDS = {"llama": 1, "mistral": 1, "qwen2": 4, "qwen3": 1, "llama3": 1, "qwen3_moe": 5, "qwen2_moe": 5, "mixtral": 5,
         "gpt_oss": 5, "deepseek_v3": 5, "deepseek_v2": 5}
# Llama 3.1's rope scaling with an original context of 64: at head_dim 64 (theta 500000) some frequencies are kept,
# some smoothed and most divided by 8.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# name -> (architecture, rope scaling): no rope scaling but for llama3.
CASES = {"llama": ("llama", None), "mistral": ("mistral", None), "qwen2": ("qwen2", None), "qwen3": ("qwen3", None),
         "llama3": ("llama", LLAMA3_ROPE)}
# The families transformers' GGUF loader cannot read: their checkpoints' sizes for K-quants (tests/models/
# test_gguf_families.py), compared on the file's dequantized values.
FAMILIES = {"qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3", "deepseek_v2"}
CASES.update({name: (name, None) for name in sorted(FAMILIES)})


def quantized_file(name: str, opts: argparse.Namespace, work: Path) -> tuple[Path, list[int], Path]:
    """The llama.cpp-quantized file of a random checkpoint, the prompt's ids from its tokenizer, and the
    checkpoint's folder."""
    arch, rope_scaling = CASES[name]
    seed = SEEDS[name] if opts.seed is None else opts.seed
    if name in FAMILIES:
        sizes = {**GGUF_OVERRIDES[name], **K_OVERRIDES[name]}
        if name == "deepseek_v2":  # llama.cpp takes a V2 without q_lora_rank for V2-Lite only by its 27 layers
            sizes["q_lora_rank"] = 256
        folder = make_checkpoint(work / name, arch, n_layers=opts.layers, seed=seed, **sizes)
    else:
        folder = make_checkpoint(work / name, arch, n_layers=opts.layers, seed=seed, rope_scaling=rope_scaling,
                                 **K_SIZES)
    pad_vocabulary(folder, 64)
    f32 = work / f"{name}-f32.gguf"
    # The converter does not know this tokenizer's pre-tokenizer; it needs a name llama.cpp accepts.
    llamacpp("convert", str(folder), str(f32), "f32", env={"LLAMACPP_PRE": "smollm"})
    out = work / f"{name}-{opts.type.lower()}.gguf"
    llamacpp("quantize", str(f32), str(out), opts.type)
    prompt = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids
    return out, prompt, folder


def pad_vocabulary(folder: Path, rows: int) -> None:
    """Zero embedding (and head) rows past the tokenizer's ids, as real checkpoints pad their vocabulary: the
    converter loads a qwen2 folder's tokenizer as transformers' Qwen2 tokenizer, which adds Qwen's own special
    tokens past ours, and refuses ids beyond the vocabulary."""
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] += rows
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(folder / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = np.concatenate([tensors[name], np.zeros((rows, tensors[name].shape[1]), np.float32)])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def transformers_greedy(path: Path, prompt: list[int], n_tokens: int, config_dir: Path | None = None
                        ) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens from the file, and the logits [n_tokens, vocab] that picked them (with
    `config_dir`'s config.json instead of the one transformers makes from the file's metadata)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"config": AutoConfig.from_pretrained(config_dir)} if config_dir is not None else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **config)
    inputs = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n_tokens,
                             min_new_tokens=n_tokens, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).numpy()


def engine_greedy(engine_name: str, path: Path, prompt: list[int], n_tokens: int) -> tuple[list[int], np.ndarray]:
    args = ModelArgs.from_dict(open_gguf(path).config())
    engine = create_engine(engine_name, device="cpu", dtype="float32")
    engine.load(path, args, Shard.whole(path.name, args.num_hidden_layers))
    driver = Driver([engine])
    tokens, logits, inputs = [], [], np.array(prompt, dtype=np.int64)
    for _ in range(n_tokens):
        logits.append(driver.forward("r", inputs))
        tokens.append(int(np.argmax(logits[-1])))
        inputs = np.array(tokens[-1:], dtype=np.int64)
    return tokens, np.stack(logits)


def check(name: str, opts: argparse.Namespace, work: Path) -> bool:
    path, prompt, folder = quantized_file(name, opts, work)
    gguf = open_gguf(path)
    types = Counter(e.type_name for e in gguf.tensors.values() if len(e.shape) == 2)
    print(f"{name}: {path.name}, matrices {', '.join(f'{k} x {n}' for k, n in types.most_common())}", flush=True)
    scaled = CASES[name][1] is not None
    factors = ModelArgs.from_dict(gguf.config()).rope_freq_factors
    if scaled:
        print(f"  rope_freqs.weight from the converter: {np.round(factors, 4).tolist() if factors else None}")
    if name in FAMILIES:  # transformers on the file's own values, through the checkpoint's config
        expected = gguf_dequantized_greedy(path, folder, prompt, opts.tokens)
        reference = None
        print(f"  transformers float32 on the file's dequantized values: {expected}")
    else:
        expected, reference = transformers_greedy(path, prompt, opts.tokens, folder if scaled else None)
        print(f"  transformers float32{' (the checkpoint config)' if scaled else ''}: {expected}")
    ok = len(set(expected)) > 1 and (factors is not None) == scaled
    if not ok:
        print("  degenerate reference (one token repeated): pick another --seed")
    engines = ["torch", "mlx"] if importlib.util.find_spec("mlx") is not None else ["torch"]
    for name in engines:
        tokens, logits = engine_greedy(name, path, prompt, opts.tokens)
        same = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(expected))
        verdict = "same tokens" if tokens == expected else f"MISMATCH from token {same}: {tokens}"
        if reference is None:
            print(f"  exo-like {name} --dtype float32: {verdict}", flush=True)
        else:  # logits compared where both sides saw the same inputs: up to the first differing token
            diff = float(np.abs(logits[:same + 1] - reference[:same + 1]).max())
            print(f"  exo-like {name} --dtype float32: {verdict} (max |logit difference| {diff:.1e}, logits up to "
                  f"{float(np.abs(reference).max()):.0f})", flush=True)
        ok = ok and tokens == expected
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="llama,qwen2,llama3",
                        help=f"of {', '.join(CASES)} (tests/checkpoints.py's architectures, and llama3 rope)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, help="checkpoint seed (default: one whose greedy output varies)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared")
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="check-llamacpp-q4km-") as work:
        results = [check(name, opts, Path(work)) for name in opts.archs.split(",")]
    print("all equal" if all(results) else "MISMATCH")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
