"""Decode speed of the torch engine against transformers `generate`, on a random Qwen2.5-0.5B-shaped model (or
any checkpoint folder given by --model-dir, e.g. a mixture or DeepSeek built by tests/checkpoints.py).

Builds the checkpoint in a temp folder (no network), then for each dtype times both sides on the same prompt
ids and the same number of new tokens, in the same process and with the same torch thread count:
  - time to first token (prefill + first token),
  - decode-only tokens/s: from the first generated token to the last (prefill excluded); transformers' tokens
    are timestamped by a streamer object whose `put()` records the clock.
Both sides are warmed up first; each measurement is repeated and the median reported (TTFT also over extra
one-token runs, as a prefill is short and easily skewed). Runs alternate between the two sides so background
load hits both alike.

Usage: python bench/bench_torch_vs_hf.py [--new-tokens 64] [--repeats 5] [--threads N] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from exo_like.engines.torch.engine import TorchEngine
from exo_like.engines.work import SampleSpec, SamplingParams, WorkItem, blocks_for
from exo_like.models.config import ModelArgs
from exo_like.models.shard import Shard

QWEN25_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "eos_token_id": None,
}


@dataclass
class Run:
    start: float
    times: list[float]  # clock reading as each generated token became available
    tokens: list[int]

    @property
    def ttft(self) -> float:
        """Seconds from the start to the first generated token (prefill + first token)."""
        return self.times[0] - self.start

    @property
    def decode_tps(self) -> float:
        """Tokens/s from the first generated token to the last: decoding only, prefill excluded."""
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


def build_checkpoint(path: Path) -> Path:
    """A random model with Qwen2.5-0.5B's shapes; weights scaled so greedy decoding is well defined (peaky)."""
    return build_random_checkpoint(path, "Qwen2ForCausalLM", "Qwen2Config", QWEN25_05B)


def build_random_checkpoint(path: Path, model_class: str, config_class: str, shape: dict) -> Path:
    """A random transformers model of that class and shape, peaky (see peaky_state), saved under the Hub's names."""
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**shape))
    model.load_state_dict(peaky_state(model), strict=False, assign=True)
    if shape.get("tie_word_embeddings"):
        model.tie_weights()
    model.save_pretrained(path)
    return path


def peaky_state(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for a model built on the meta device: linear std 1.5/sqrt(fan_in), norms 1 +- 0.1."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in model.named_parameters():  # a tied head is listed once, as the embedding
        if "norm" in name:
            value = 1.0 + (torch.rand(param.shape, generator=generator) - 0.5) * 0.2
        elif name.endswith("bias"):
            value = torch.randn(param.shape, generator=generator) * 0.5
        elif "embed_tokens" in name:
            value = torch.randn(param.shape, generator=generator)
        else:
            value = torch.randn(param.shape, generator=generator) * (1.5 / math.sqrt(param.shape[-1]))
        state[name] = value
    return state


class TokenClock:
    """A transformers streamer that only timestamps: put() is called with the prompt, then once per token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.tokens.extend(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_transformers(model, prompt: np.ndarray, new_tokens: int) -> Run:
    ids = torch.from_numpy(prompt)[None]
    clock = TokenClock()
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        streamer=clock,
    )
    times = clock.times[1:]  # the first put() is the prompt
    assert len(times) == new_tokens, f"expected {new_tokens} tokens, streamer saw {len(times)}"
    return Run(start, times, clock.tokens[len(prompt) :])


def run_engine(engine: TorchEngine, prompt: np.ndarray, new_tokens: int) -> Run:
    """One request's engine steps, as the ring's first (and last) stage runs them, its KV in blocks 0, 1, ..."""
    blocks = tuple(range(blocks_for(len(prompt) + new_tokens)))
    if engine.kv_blocks < len(blocks):
        engine.allocate_kv(len(blocks))
    spec = SampleSpec(SamplingParams(0.0, seed=0), new_tokens, (), len(prompt))
    times, tokens = [], []
    start = time.perf_counter()
    inputs, position = prompt, 0
    for _ in range(new_tokens):
        item = WorkItem("bench", "bench", position, len(inputs), blocks, spec)
        token = int(np.argmax(engine.step([item], inputs)[0]))
        times.append(time.perf_counter())
        tokens.append(token)
        position += len(inputs)
        inputs = np.array([token], dtype=np.int64)
    return Run(start, times, tokens)


def load_transformers(model_dir: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    return model.eval()


def bench_dtype(model_dir: Path, dtype: str, prompt: np.ndarray, opts: argparse.Namespace) -> None:
    args = ModelArgs.from_dir(model_dir)
    engine = TorchEngine(device="cpu", dtype=dtype)
    engine.load(model_dir, args, Shard.whole("bench", args.num_hidden_layers))
    hf = load_transformers(model_dir, dtype)
    run_engine(engine, prompt, 8)  # warm-up: allocator, kernels, rope table
    run_transformers(hf, prompt, 8)
    engine_runs, hf_runs = [], []
    for _ in range(opts.repeats):  # alternate, so background load hits both sides alike
        hf_runs.append(run_transformers(hf, prompt, opts.new_tokens))
        engine_runs.append(run_engine(engine, prompt, opts.new_tokens))
    # A prefill is short, so one burst of background load skews it: take more, cheap, alternating samples.
    engine_ttft = [r.ttft for r in engine_runs]
    hf_ttft = [r.ttft for r in hf_runs]
    for _ in range(opts.ttft_repeats):
        hf_ttft.append(run_transformers(hf, prompt, 1).ttft)
        engine_ttft.append(run_engine(engine, prompt, 1).ttft)
    report(dtype, engine_runs, hf_runs, engine_ttft, hf_ttft)
    del engine, hf
    gc.collect()


def report(
    dtype: str, engine_runs: list[Run], hf_runs: list[Run], engine_ttft: list[float], hf_ttft: list[float]
) -> None:
    label = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    e_tps = statistics.median(r.decode_tps for r in engine_runs)
    h_tps = statistics.median(r.decode_tps for r in hf_runs)
    e_ttft, h_ttft = statistics.median(engine_ttft), statistics.median(hf_ttft)
    agree = min(common_prefix(r.tokens, hf_runs[0].tokens) for r in engine_runs)
    print(f"{label} decode ratio {e_tps / h_tps:.2f} (engine {e_tps:.2f} tok/s, transformers {h_tps:.2f} tok/s)")
    print(
        f"{label} TTFT ratio {e_ttft / h_ttft:.2f} (engine {e_ttft * 1e3:.0f} ms, transformers {h_ttft * 1e3:.0f} ms)"
    )
    # float32 must agree exactly; bfloat16 kernels round differently, so a late divergence is expected there.
    print(f"{label} greedy tokens equal to transformers: {agree}/{len(hf_runs[0].tokens)}")
    print(
        f"{label} runs (decode tok/s) engine {[round(r.decode_tps, 2) for r in engine_runs]}"
        f" transformers {[round(r.decode_tps, 2) for r in hf_runs]}"
    )
    print(
        f"{label} runs (TTFT ms) engine {[round(t * 1e3) for t in engine_ttft]}"
        f" transformers {[round(t * 1e3) for t in hf_ttft]}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="full generations per side")
    parser.add_argument("--ttft-repeats", type=int, default=10, help="extra one-token runs per side for TTFT")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--model-dir", type=Path, help="reuse a folder built by an earlier run")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)  # one setting for the whole process: both sides use it
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, prompt {opts.prompt_tokens} tokens, "
        f"{opts.new_tokens} new tokens, median of {opts.repeats} runs (TTFT: of {opts.repeats + opts.ttft_repeats})",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-qwen25-05b-") as tmp:
        model_dir = opts.model_dir
        if model_dir is None or not (model_dir / "config.json").exists():
            model_dir = build_checkpoint(model_dir or Path(tmp))
        vocab = ModelArgs.from_dir(model_dir).vocab_size  # a --model-dir of any family and vocabulary
        prompt = np.random.default_rng(0).integers(0, vocab, opts.prompt_tokens, dtype=np.int64)
        for dtype in opts.dtypes.split(","):
            bench_dtype(model_dir, dtype, prompt, opts)


if __name__ == "__main__":
    main()
