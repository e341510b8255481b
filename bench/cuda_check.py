"""The GPU check (issue 46): what a CUDA node must do, measured on one NVIDIA GPU, in one run of at most ~8 minutes.

Prints one line per check, PASS or FAIL with its figures, then a summary:
  1. greedy tokens = transformers' on the GPU, float32 and bfloat16, for a dense (Llama), a mixture (Qwen3-MoE) and a
     latent-attention (DeepSeek V3) model;
  2. each quantized type's GPU kernel (engines/torch/cuda/) against exact arithmetic on its dequantized weights
     rounded to the activations' dtype, within the kernel's stated error (kernels.py's docstring);
  3. a Q4_K_M file (Q4_K, with Q6_K for v_proj and down_proj as llama-quantize's mix) greedy on the quantized
     kernels against the same file dequantized (--dtype bfloat16), and the GPU memory it holds against the file's
     bytes (<= 1.15x);
  4. single-stream decode tok/s of that file against transformers' `generate` (bfloat16, the same shape) and
     against the bandwidth bound (the bytes a token reads over the GPU's measured copy bandwidth); 8 streams in
     one batch against 1;
  5. a two-node ring of node processes sharing the GPU answers what one node does, and so does a ring of a GPU node
     and a CPU node; a tensor-parallel group of two CUDA ranks over NCCL where there are two GPUs (else SKIP).
Random checkpoints made here (tests/checkpoints.py): nothing is downloaded.

The machine it runs on has CUDA torch, Triton and transformers; the project's other dependencies come as wheels
(`make gpu-wheels` writes them to .gpu-wheels/, at most ~40 MB), installed without an index:
  python3 -m pip install --no-index --find-links .gpu-wheels -r .gpu-wheels/requirements.txt
  PYTHONPATH=. python3 bench/cuda_check.py
`--device cpu` runs the same checks on CPU (small shapes, the Triton kernels under its interpreter) to try the
script itself where there is no GPU."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS: list[tuple[str, bool, str]] = []
SKIPPED: list[tuple[str, str]] = []
PROMPT = [3, 17, 29, 5, 11, 42, 7, 19, 23, 2, 31, 13]


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def skip(name: str, why: str) -> None:
    SKIPPED.append((name, why))
    print(f"SKIP  {name}: {why}", flush=True)


def section(name: str, run: Callable[[], None]) -> None:
    started = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        run()
    except Exception as error:  # noqa: BLE001 - one broken section must not hide the others' lines
        traceback.print_exc()
        report(name, False, f"raised {type(error).__name__}: {error}")
    print(f"   ({time.perf_counter() - started:.1f} s)", flush=True)


# -- 1. families against transformers ---------------------------------------------------------------------------

def load_engine(path: Path, device: str, dtype: str | None):
    from exo_like.engines.choice import create_engine
    from exo_like.models.config import ModelArgs
    from exo_like.models.gguf.file import is_gguf, open_gguf
    from exo_like.models.shard import Shard

    args = ModelArgs.from_dict(open_gguf(path).config()) if is_gguf(path) else ModelArgs.from_dir(path)
    engine = create_engine("torch", device=device, dtype=dtype)
    engine.load(path, args, Shard.whole(path.name, args.num_hidden_layers))
    return engine


def engine_greedy(engine, n_tokens: int, prompt: list[int] = PROMPT) -> list[int]:  # noqa: ANN001
    import numpy as np

    from tests.engine_driver import Driver

    driver, tokens, inputs = Driver([engine]), [], np.array(prompt, dtype=np.int64)
    for _ in range(n_tokens):
        tokens.append(int(np.argmax(driver.forward("r", inputs))))
        inputs = np.array([tokens[-1]], dtype=np.int64)
    return tokens


def ours_greedy(path: Path, device: str, dtype: str | None, n_tokens: int) -> list[int]:
    return engine_greedy(load_engine(path, device, dtype), n_tokens)


def transformers_greedy(path: Path, device: str, dtype: str, n_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    inputs = torch.tensor([PROMPT], device=device)
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    del model
    return out[0, len(PROMPT):].tolist()


def check_families(work: Path, device: str, n_tokens: int) -> None:
    from tests.checkpoints import make_checkpoint

    for arch in ("llama", "qwen3_moe", "deepseek_v3"):
        path = make_checkpoint(work / arch, arch, n_layers=4, seed=5)
        for dtype in ("float32", "bfloat16"):
            ours = ours_greedy(path, device, dtype, n_tokens)
            theirs = transformers_greedy(path, device, dtype, n_tokens)
            same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
            report(f"{arch} {dtype} greedy = transformers", ours == theirs,
                   f"{same}/{n_tokens} tokens agree" + ("" if ours == theirs else f" (ours {ours}, theirs {theirs})"))


# -- 2. the quantized kernels -----------------------------------------------------------------------------------

def check_kernels(device: str) -> None:
    import numpy as np
    import torch

    from exo_like.engines.torch.cuda.matrix import GpuMatrix
    from tests.engines.test_cuda_kernels import CASES

    dtypes = [torch.bfloat16, torch.float16] if device == "cuda" else [torch.float16]
    rounding = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}
    for case, make in CASES.items():
        groups = make()
        matrix = GpuMatrix.pack(groups, torch.device(device))
        weights = torch.from_numpy(groups.dequantize())
        worst, ok = 0.0, True
        for dtype in dtypes:
            for rows in (1, 8, 300):
                x = torch.from_numpy(np.random.default_rng(rows).standard_normal(
                    (rows, groups.shape[1]), dtype=np.float32)).to(dtype)
                out = matrix.matmul(x.to(device)).double().cpu()
                rounded = weights.to(dtype).double()
                exact = x.double() @ rounded.T
                bound = (4 * rounding[dtype] + groups.shape[1] * 2.0 ** -24) * (x.double().abs() @ rounded.abs().T)
                excess = ((out - exact).abs() / (bound + 1e-30)).max().item()
                worst, ok = max(worst, excess), ok and excess <= 1.0
        report(f"kernel {case}", ok, f"worst error {worst:.2f} of the stated bound")


# -- 3 and 4. a Q4_K_M file: exactness, memory, speed -----------------------------------------------------------

def q4_k_m_file(work: Path, shape: dict, n_layers: int) -> tuple[Path, Path]:
    import torch

    from tests.checkpoints import make_checkpoint
    from tests.gguf_checkpoints import write_gguf

    folder = make_checkpoint(work / "q4km-float", "llama", n_layers=n_layers, seed=5, dtype=torch.float16, **shape)
    path = write_gguf(folder, work / "model-Q4_K_M.gguf", "Q4_K", "Q6_K",
                      types={"v_proj.weight": "Q6_K", "down_proj.weight": "Q6_K"})
    return folder, path


def check_q4_k_m(work: Path, device: str, shape: dict, n_layers: int, n_tokens: int) -> None:
    import torch

    folder, path = q4_k_m_file(work, shape, n_layers)
    file_bytes = path.stat().st_size
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    engine = load_engine(path, device, None)
    held = engine.parameter_bytes()
    allocated = (torch.cuda.memory_allocated() - before) if device == "cuda" else held
    quantized = engine_greedy(engine, n_tokens)
    forms = engine.weight_forms
    dequantized = ours_greedy(path, device, "bfloat16" if device == "cuda" else "float32", n_tokens)
    same = next((i for i, (a, b) in enumerate(zip(quantized, dequantized)) if a != b), n_tokens)
    report("Q4_K_M greedy = the dequantized file's", quantized == dequantized, f"{same}/{n_tokens} tokens agree")
    report("Q4_K_M held quantized", not forms.dequantized,
           f"quantized {forms.quantized}, dequantized {forms.dequantized or 'none'}")
    ratio = max(held, allocated) / file_bytes
    report("Q4_K_M GPU memory <= 1.15x the file", ratio <= 1.15,
           f"held {held / 1e6:.1f} MB, allocated {allocated / 1e6:.1f} MB, file {file_bytes / 1e6:.1f} MB: "
           f"{ratio:.3f}x")
    check_speed(folder, engine, device)  # (on CPU, --device cpu: the script's own trial, not a figure)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes a second a device-to-device copy moves (read + written)."""
    import torch

    a = torch.empty(2 ** 30 if device == "cuda" else 2 ** 27, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    started = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * 10 / (time.perf_counter() - started)


def decode_rate(engine, device: str, streams: int, n_tokens: int = 64) -> float:  # noqa: ANN001
    """The engine's decode tokens a second, all streams together, each stream a request of its own."""
    import numpy as np

    from tests.engine_driver import Driver

    driver = Driver([engine], n_blocks=64 * streams)
    last = {}
    for s in range(streams):
        last[f"s{s}"] = int(np.argmax(driver.forward(f"s{s}", np.array(PROMPT, dtype=np.int64) + s)))

    def step() -> None:
        out = driver.step([(rid, np.array([token], dtype=np.int64)) for rid, token in last.items()])
        for rid, row in zip(last, out):
            last[rid] = int(np.argmax(row))

    for _ in range(4):
        step()
    sync(device)
    started = time.perf_counter()
    for _ in range(n_tokens):
        step()
    sync(device)
    rate = streams * n_tokens / (time.perf_counter() - started)
    graphs = engine.graphs
    print(f"   {streams} stream(s): decode graphs {'captured: ' + str(sorted(graphs.buckets)) if graphs else 'off'}",
          flush=True)
    return rate


def transformers_rate(folder: Path, device: str, n_tokens: int = 64) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device)
    inputs = torch.tensor([PROMPT], device=device)
    kwargs = dict(attention_mask=torch.ones_like(inputs), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(inputs, max_new_tokens=8, **kwargs)
        sync(device)
        started = time.perf_counter()
        model.generate(inputs, max_new_tokens=n_tokens + 1, min_new_tokens=n_tokens + 1, **kwargs)
        sync(device)
    return n_tokens / (time.perf_counter() - started)


def check_speed(folder: Path, engine, device: str) -> None:  # noqa: ANN001
    held = engine.parameter_bytes()
    one = decode_rate(engine, device, 1)
    eight = decode_rate(engine, device, 8)
    theirs = transformers_rate(folder, device)
    bandwidth = copy_bandwidth(device)
    bound = bandwidth / held
    report("decode >= 1.5x transformers generate (bfloat16)", one >= 1.5 * theirs,
           f"ours {one:.1f} tok/s, transformers {theirs:.1f} tok/s: {one / theirs:.2f}x")
    report("decode >= 0.6 of the bandwidth bound", one >= 0.6 * bound,
           f"{held / 1e9:.2f} GB a token at {bandwidth / 1e12:.2f} TB/s: bound {bound:.0f} tok/s, "
           f"ours {one / bound:.2f} of it")
    report("8 streams >= 4x one", eight >= 4 * one, f"8 streams {eight:.1f} tok/s, one {one:.1f}: {eight / one:.2f}x")


# -- 5. a two-node ring on one GPU ------------------------------------------------------------------------------

def completion(port: int, body: dict) -> str:
    import json
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["text"]


def check_ring(work: Path, device: str) -> None:
    from tests.checkpoints import make_checkpoint
    from tests.cluster_harness import start_cluster, wait_until_ready

    folder = make_checkpoint(work / "ring", "llama", n_layers=4, seed=5)
    body = {"model": folder.name, "prompt": "one two three", "max_tokens": 16, "temperature": 0}
    answers = []
    for members in (1, 2):
        nodes = start_cluster(work / f"ring-{members}", str(folder), [8.0] * members, dtype="float32",
                              extra=("--device", device, "--placement", "memory"))
        try:
            wait_until_ready(nodes, members, timeout=120)
            answers.append(completion(nodes[-1].port, body))
        finally:
            for node in nodes:
                node.stop()
    report("a two-node ring on the GPU = one node", answers[0] == answers[1] and bool(answers[0]),
           f"one node {answers[0]!r}, two nodes {answers[1]!r}")


def check_mixed_ring(work: Path, device: str) -> None:
    """A CUDA node and a CPU node in one ring (layers split by memory), against one node alone."""
    from tests.checkpoints import make_checkpoint
    from tests.cluster_harness import free_ports, launch_member, wait_until_ready

    folder = make_checkpoint(work / "mixed", "llama", n_layers=4, seed=5)
    body = {"model": folder.name, "prompt": "one two three", "max_tokens": 16, "temperature": 0}
    ports = free_ports(2)
    nodes = [launch_member(work / "mixed-ring", str(folder), ports, i, 8.0, dtype="float32",
                           extra=("--device", member_device, "--placement", "memory")).serving()
             for i, member_device in enumerate((device, "cpu"))]
    try:
        wait_until_ready(nodes, 2, timeout=120)
        mixed = completion(nodes[0].port, body)
    finally:
        for node in nodes:
            node.stop()
    alone = launch_member(work / "mixed-alone", str(folder), free_ports(1), 0, 8.0, dtype="float32",
                          extra=("--device", "cpu")).serving()
    try:
        wait_until_ready([alone], 1, timeout=120)
        expected = completion(alone.port, body)
    finally:
        alone.stop()
    report(f"a ring of a {device} node and a cpu node = one cpu node", mixed == expected,
           f"ring {mixed!r}, one node {expected!r}")


def check_nccl_group(work: Path, device: str) -> None:
    """A tensor-parallel group of two CUDA ranks over NCCL (a GPU a rank): greedy = one engine's."""
    import torch

    if device != "cuda" or torch.cuda.device_count() < 2:
        skip("an NCCL tensor-parallel group", f"needs two GPUs, this machine has {torch.cuda.device_count()}")
        return
    from exo_like.models.config import ModelArgs
    from tests.checkpoints import make_checkpoint
    from tests.engine_driver import Driver
    from tests.tensor_parallel.local_group import N_BLOCKS, close_group, greedy, load_group, rank_shard, start_group

    folder = make_checkpoint(work / "nccl", "llama", n_layers=3, seed=5)
    args = ModelArgs.from_dir(folder)
    expected = ours_greedy(folder, "cuda:0", "float32", 16)
    group = start_group(2, devices=["cuda:0", "cuda:1"])
    try:
        load_group(group, folder, args, rank_shard(args, folder.name, 2), N_BLOCKS)
        tokens, _ = greedy(Driver(group[:1], n_blocks=N_BLOCKS))
    finally:
        close_group(group)
    report("an NCCL tensor-parallel group = one engine", tokens[:16] == expected,
           f"group {tokens[:16]}, one engine {expected}" if tokens[:16] != expected else "16/16 tokens agree")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tokens", type=int, default=24)
    options = parser.parse_args()
    device = options.device
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            print("FAIL  no CUDA device here (--device cpu tries the script on CPU)")
            return 1
        print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    started = time.perf_counter()
    # The speed model: Llama-shaped, ~1.2 B parameters on a GPU (a ~0.7 GB Q4_K_M file); tiny on CPU.
    shape = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4) \
        if device == "cuda" else dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                       num_key_value_heads=2)
    layers = 22 if device == "cuda" else 2
    with tempfile.TemporaryDirectory(prefix="cuda-check-") as folder:
        work = Path(folder)
        section("1. families against transformers", lambda: check_families(work, device, options.tokens))
        section("2. quantized kernels", lambda: check_kernels(device))
        section("3-4. a Q4_K_M file", lambda: check_q4_k_m(work, device, shape, layers, options.tokens))
        section("5. a two-node ring", lambda: check_ring(work, device))
        section("5b. a ring of a GPU node and a CPU node", lambda: check_mixed_ring(work, device))
        section("5c. an NCCL tensor-parallel group", lambda: check_nccl_group(work, device))
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"== {len(RESULTS) - len(failed)} passed, {len(failed)} failed, {len(SKIPPED)} skipped in "
          f"{time.perf_counter() - started:.0f} s"
          + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
