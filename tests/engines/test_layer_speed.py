"""Measuring a node's layer speed: the engines' random layer of a model's shape, the timing that sees a CPU quota,
and the probe's cache in <home> (measured once, then read; --remeasure measures again)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exo_like.cluster.speed import CACHE_FILE, SpeedProbe
from exo_like.engines import layer_speed
from exo_like.engines.layer_speed import LayerRunner, LayerSpeed, mean_ns, time_layer
from exo_like.models.config import ModelArgs

CONFIG = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 300, "max_position_embeddings": 512}
SHAPES = {
    "llama": CONFIG,
    "qwen2": {**CONFIG, "model_type": "qwen2"},  # q/k/v biases
    "qwen3": {**CONFIG, "model_type": "qwen3", "head_dim": 48},  # q/k norms, head_dim != hidden / heads
    "llama-4bit": {**CONFIG, "quantization": {"group_size": 32, "bits": 4}},  # an MLX-format quantized model
    # a mixture: 64 experts, 8 a token (the probe holds 4 x 8 of them), a shared gated expert
    "qwen2_moe": {**CONFIG, "model_type": "qwen2_moe", "num_experts": 64, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128},
    "qwen3_moe-4bit": {**CONFIG, "model_type": "qwen3_moe", "num_experts": 16, "num_experts_per_tok": 4,
                       "moe_intermediate_size": 64, "quantization": {"group_size": 32, "bits": 4}},
}


class StepClock:
    """layer_speed's clock, moved only by the steps a test times (a real sleep lasts longer on a busy machine, by
    however much it is busy), and no time spent waiting for a CPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        from exo_like.engines import cpu_wait

        self.now = 0
        monkeypatch.setattr(layer_speed, "time", self)
        monkeypatch.setattr(cpu_wait, "waited_ns", lambda: 0)
        monkeypatch.setattr(cpu_wait, "throttled_ns", lambda: 0)

    def perf_counter_ns(self) -> int:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += round(seconds * 1e9)


def test_the_mean_over_a_window_sees_a_cpu_quota_that_single_steps_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """A throttled process runs at full speed until its quota is spent, then waits: most steps are fast."""
    clock, calls = StepClock(monkeypatch), []

    def throttled_step() -> None:
        calls.append(1)
        clock.sleep(0.001 if len(calls) % 4 else 0.031)

    # Steps until 0.2 s have passed: 24 of them (six rounds of 3 x 1 ms + 31 ms, 204 ms); the median step is 1 ms.
    assert mean_ns(throttled_step, 0.2) == 8_500_000 and len(calls) == 24


def test_time_layer_warms_up_then_reports_per_step_and_per_position(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, counts = StepClock(monkeypatch), {"decode": 0, "prefill": 0}

    def step(kind: str, seconds: float):  # type: ignore[no-untyped-def]
        def run() -> None:
            counts[kind] += 1
            clock.sleep(seconds)
        return run

    speed = time_layer(LayerRunner(step("decode", 0.002), step("prefill", 0.064)), 0.03, 0.1)
    assert speed.decode_ns == 2_000_000
    assert speed.prefill_ns == 1_000_000  # 64 ms over the chunk's 64 positions
    # Warm-up, four windows of 15 steps (30 ms of 2 ms steps); a first chunk, then two more until 0.1 s passed.
    assert counts == {"decode": 2 + 4 * 15, "prefill": 1 + 2}


@pytest.mark.parametrize("engine_name", ["torch", "mlx"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_engine_builds_and_times_a_layer_of_the_model_s_shape(engine_name: str, shape: str,
                                                                    tmp_path: Path) -> None:
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core"}[engine_name])
    from exo_like.engines.choice import create_engine

    engine = create_engine(engine_name, "cpu", None)
    args = ModelArgs.from_dict(SHAPES[shape])
    form = engine.layer_form(tmp_path, args)
    assert ("4-bit groups of 32" in form) == shape.endswith("4bit")
    runner = engine.layer_runner(tmp_path, args)
    speed = time_layer(runner, 0.05, 0.02)
    # Only that it ran: which is faster, a decode step or a prefill position, depends on the engine, the CPU and
    # how busy it is (per position is test_time_layer_warms_up_then_reports_per_step_and_per_position's, exactly).
    assert speed.decode_ns > 0 and speed.prefill_ns > 0
    assert engine.shard is None  # measuring loads nothing: the engine holds what it held


class CountingEngine:
    """Stands in for an engine: counts measurements, each taking `seconds`."""

    name, device_name = "fake", "cpu"

    def __init__(self, seconds: float = 0.05, fail: bool = False):
        self.seconds, self.fail, self.measured = seconds, fail, 0

    def layer_form(self, model_dir: Path, args: ModelArgs) -> str:
        return "float32"

    def measure_layer(self, model_dir: Path, args: ModelArgs) -> LayerSpeed:
        if self.fail:
            raise RuntimeError("no kernel for this shape")
        self.measured += 1
        time.sleep(self.seconds)
        return LayerSpeed(2_000_000, 100_000)


def probe(engine: CountingEngine, home: Path, executor: ThreadPoolExecutor, remeasure: bool = False,
          notices: list[str] | None = None) -> SpeedProbe:
    args = ModelArgs.from_dict(CONFIG)
    return SpeedProbe("n1", engine, executor, home, "compute", remeasure, lambda key: (home, args),  # type: ignore
                      lambda: {"peer": 0.0003}, lambda: notices is not None and notices.append("measured"))


async def until_done(speed: SpeedProbe, model: str) -> None:
    while speed.result(model) is None:
        await asyncio.sleep(0.01)


async def test_measured_once_then_read_from_the_cache_unless_remeasure(tmp_path: Path) -> None:
    executor = ThreadPoolExecutor(1)
    engine, notices = CountingEngine(), []
    first = probe(engine, tmp_path, executor, notices=notices)
    assert first.figures("m").decode_ns is None  # nothing yet: measuring starts when asked for
    started = time.monotonic()
    first.measure("m")
    await until_done(first, "m")
    seen = time.monotonic() - started
    figures = first.figures("m")
    assert (figures.decode_ns, figures.prefill_ns, figures.cached, figures.model) == (2_000_000, 100_000, False, "m")
    # The engine's 0.05 s, in seconds, and no more than this test saw pass.
    assert 0.05 <= figures.measure_seconds <= seen and notices == ["measured"]
    assert figures.rtt_us == {"peer": 2048}
    assert engine.measured == 1 and len(json.loads((tmp_path / CACHE_FILE).read_text())) == 1
    again = probe(engine, tmp_path, executor)  # a restart with the same home
    again.measure("m")
    await until_done(again, "m")
    assert again.figures("m").cached and again.figures("m").decode_ns == 2_000_000 and engine.measured == 1
    forced = probe(engine, tmp_path, executor, remeasure=True)
    forced.measure("m")
    await until_done(forced, "m")
    assert not forced.figures("m").cached and engine.measured == 2
    executor.shutdown()


async def test_a_failed_measurement_is_announced_as_the_reason(tmp_path: Path) -> None:
    executor = ThreadPoolExecutor(1)
    failing = probe(CountingEngine(fail=True), tmp_path, executor)
    failing.measure("m")
    await until_done(failing, "m")
    figures = failing.figures("m")
    assert figures.decode_ns is None and figures.problem == "cannot measure its speed: no kernel for this shape"
    assert figures.failed_for("m")
    executor.shutdown()


async def test_nodes_of_one_host_measure_one_at_a_time(tmp_path: Path) -> None:
    engines = [CountingEngine(0.2), CountingEngine(0.2)]
    executors = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]
    probes = [probe(e, tmp_path / str(i), x) for i, (e, x) in enumerate(zip(engines, executors))]
    started = time.monotonic()
    for p in probes:
        p.measure("m")
    await asyncio.gather(*(until_done(p, "m") for p in probes))
    elapsed = time.monotonic() - started
    assert elapsed >= 0.4  # serialised by the host lock
    seconds = [p.figures("m").measure_seconds for p in probes]
    # The wait is not counted as its cost: the two measurements are disjoint spans of what passed here (counting
    # the second's wait for the first would count the first's span twice).
    assert all(s >= 0.2 for s in seconds) and sum(seconds) <= elapsed, (seconds, elapsed)
    for x in executors:
        x.shutdown()


def test_waiting_for_a_cpu_is_left_out_but_a_quota_s_throttling_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other processes' load is the moment's; a CPU quota is the node's (engines/cpu_wait.py)."""
    from exo_like.engines import cpu_wait

    steps, clock = StepClock(monkeypatch), {"waited": 0, "throttled": 0}
    monkeypatch.setattr(cpu_wait, "waited_ns", lambda: clock["waited"])
    monkeypatch.setattr(cpu_wait, "throttled_ns", lambda: clock["throttled"])
    contention = cpu_wait.ContentionClock()
    clock["waited"] += 700  # of which 500 throttled by the quota, 200 behind other processes
    clock["throttled"] += 500
    assert contention.elapsed_ns() == 200

    def step() -> None:
        clock["waited"] += 1_000_000  # each step's 2 ms include 1 ms waiting for a CPU, none of it throttled
        steps.sleep(0.002)

    assert mean_ns(step, 0.05) == 1_000_000


def test_this_kernel_counts_a_thread_s_wait_for_a_cpu() -> None:
    import subprocess
    import sys

    from exo_like.engines.cpu_wait import SCHEDSTAT, waited_ns

    if not SCHEDSTAT.exists():
        pytest.skip("no /proc/thread-self/schedstat on this system: contention is not left out here")
    busy = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: "
                              "pass"]) for _ in range(len(os.sched_getaffinity(0)) + 1)]
    try:
        time.sleep(0.3)
        before, end = waited_ns(), time.monotonic() + 0.5
        while time.monotonic() < end:
            pass
        assert waited_ns() - before > 10_000_000  # more runnable threads than CPUs: this one waited
    finally:
        for process in busy:
            process.wait()
