"""This node's speed on a model, for placement by speed: measured once per layer shape, engine, device, dtype and
thread count, then read from a cache in <home> (--remeasure measures again).

A measurement builds one random layer of the model's shape on the engine and times it (engines/layer_speed.py),
on the engine thread, so the event loop keeps answering peers; it takes about one second. Several nodes on one
host (tests, benches) would slow each other's measurements down, so a measurement holds a host-wide lock: nodes
of one machine measure one at a time, each while the others wait for their figures, before any of them loads.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from exo_like import __version__
from exo_like.cluster.protocol_fields import MAX_COUNTS
from exo_like.engines.base import Engine
from exo_like.engines.layer_speed import LayerSpeed
from exo_like.models.config import ModelArgs
from exo_like.models.tensor_split import TensorSplit, group_sizes, rank_args
from partitioning.speed_figures import LINK_FLOOR_US, RTT_FLOOR_US, SpeedFigures, SpeedSource
from partitioning.tensor import ALLREDUCE_BASE_NS

log = logging.getLogger(__name__)

CACHE_FILE = "layer_speed.json"
HOST_LOCK = Path(tempfile.gettempdir()) / "exo-like-measure.lock"
LOCK_WAIT_SECONDS = 30.0  # then measure anyway: a stuck peer process must not stop this node from planning
MEASURED_GROUPS = 4  # slices are timed for groups up to this size (each a layer's measurement, about a second)


@dataclass(frozen=True)
class Measured:
    speed: LayerSpeed
    seconds: float  # what measuring took (for a cached figure: what it took when measured)
    cached: bool


def rtt_bucket_us(seconds: float | None, floor: int = RTT_FLOOR_US) -> int:
    """A link's round trip as announced: microseconds rounded up to a power of two, at least `floor`.
    Coarse on purpose: plans are made from it, and a plan that followed every jitter would never settle."""
    if seconds is None:
        return floor
    micros = max(1, math.ceil(seconds * 1e6))
    return max(floor, 1 << (micros - 1).bit_length())


def mbit_bucket(bytes_per_second: float) -> int:
    """A link's bandwidth as announced: Mbit/s rounded down to a power of two (at least 1), so that a plan does not
    follow every jitter."""
    mbit = max(1, int(bytes_per_second * 8 / 1e6))
    return 1 << (mbit.bit_length() - 1)


def speed_key(engine: Engine, model_dir: Path, args: ModelArgs) -> str:
    """What a measured figure depends on: the layer's shape, how the engine holds it, where it runs, with how
    many threads, and this version of exo-like."""
    shape = [args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
             args.intermediate_size, args.qkv_bias, args.o_bias, args.mlp_bias, args.qk_norm]
    threads = [os.environ.get("OMP_NUM_THREADS"), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count()]
    body = json.dumps([shape, engine.name, engine.device_name, engine.layer_form(model_dir, args), threads,
                       __version__])
    return hashlib.sha256(body.encode()).hexdigest()[:24]


class SpeedProbe(SpeedSource):
    """This node's figures for the cluster: its --placement, its layer speed on each model the cluster plans for
    (measured, or read from the cache), and its links' round trips."""

    def __init__(self, node_id: str, engine: Engine, executor: ThreadPoolExecutor, home: Path, placement: str,
                 remeasure: bool, locate: Callable[[str], tuple[Path, ModelArgs]],
                 round_trips: Callable[[], dict[str, float | None]], on_measured: Callable[[], None],
                 parallel: str = "auto", bandwidths: Callable[[], dict[str, float]] = dict):
        self.node_id = node_id
        self.engine = engine
        self.executor = executor
        self.cache_path = home / CACHE_FILE
        self.placement = placement
        self.parallel = parallel  # its --parallel, announced with the figures
        self.allreduce_ns: dict[str, int] = {}  # by group (members' ids in rank order): as its leader measured
        self.remeasure = remeasure  # measure every model once in this run, whatever the cache holds
        self._locate = locate  # a model key -> its folder and config (the model is described already)
        self._round_trips = round_trips  # each link's lowest round trip so far, in seconds, by peer node id
        self._bandwidths = bandwidths  # each link's bytes per second, by peer node id
        self._on_measured = on_measured
        self._results: dict[str, Measured | str] = {}  # by model key: figures, or why there are none
        self._tasks: dict[str, asyncio.Task] = {}
        self._slices: dict[str, dict[int, int]] = {}  # by model key: group size -> a rank slice's decode ns
        self._slice_tasks: dict[tuple[str, int], asyncio.Task] = {}

    def figures(self, model: str | None) -> SpeedFigures:
        # A frame holds at most MAX_COUNTS round trips; past that many peers, the other ends' figures count.
        trips = sorted(self._round_trips().items())[:MAX_COUNTS]
        links = {"rtt_us": {peer: rtt_bucket_us(seconds) for peer, seconds in trips},
                 "link_us": {peer: rtt_bucket_us(seconds, LINK_FLOOR_US) for peer, seconds in trips
                             if seconds is not None},
                 "parallel": self.parallel, "allreduce_ns": dict(self.allreduce_ns),
                 "link_mbit": {peer: mbit_bucket(rate) for peer, rate in sorted(self._bandwidths().items())
                               [:MAX_COUNTS]}}
        if self.placement == "memory" or model is None:
            return SpeedFigures(self.placement, **links)
        result = self._results.get(model)
        if isinstance(result, Measured):
            return SpeedFigures(self.placement, model, result.speed.decode_ns, result.speed.prefill_ns,
                                round(result.seconds, 3), result.cached, None,
                                slice_decode_ns={str(n): ns for n, ns in self._slices.get(model, {}).items()},
                                **links)
        return SpeedFigures(self.placement, model, problem=result, **links)  # failed, or still measuring

    def measure(self, model: str, group_limit: int = 1) -> None:
        if self.placement == "compute":
            self.result(model)
            if self.parallel == "auto" and group_limit > 1:
                self._measure_slices(model, min(group_limit, MEASURED_GROUPS))

    def _measure_slices(self, model: str, limit: int) -> None:
        """The planner weighs tensor-parallel groups of up to `limit` of this node's kind: time one rank's slice of
        a layer for each group size it could form (after the whole layer; once per size)."""
        for size in range(2, limit + 1):
            if (model, size) not in self._slice_tasks:
                self._slice_tasks[model, size] = asyncio.ensure_future(self._measure_slice(model, size))

    async def _measure_slice(self, model: str, size: int) -> None:
        while model not in self._results:  # the whole layer first: placement needs it before anything else
            await asyncio.sleep(0.1)
        whole = self._results[model]
        if not isinstance(whole, Measured) or whole.speed.decode_ns < 2 * ALLREDUCE_BASE_NS:
            return  # a layer faster than a group's two all-reduces: no group of any size gains on it
        try:
            model_dir, args = self._locate(model)
            if size not in group_sizes(args):
                return
            measured = await self._figure(model_dir, rank_args(args, TensorSplit(0, size)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # no figure: the planner does not weigh groups of this size
            log.warning("node %s: cannot time a rank's slice of %s for groups of %d: %r", self.node_id, model, size,
                        exc)
            return
        self._slices.setdefault(model, {})[size] = measured.speed.decode_ns
        log.info("node %s: a rank's slice of a layer of %s in a group of %d: decode %.3f ms", self.node_id,
                 Path(model).name, size, measured.speed.decode_ns / 1e6)
        self._on_measured()

    def result(self, model: str) -> Measured | str | None:
        """The figures for `model`, why there are none, or None while they are being measured (started here)."""
        if model in self._results:
            return self._results[model]
        if model not in self._tasks:
            self._tasks[model] = asyncio.ensure_future(self._measure(model))
        return None

    async def close(self) -> None:
        for task in [*self._tasks.values(), *self._slice_tasks.values()]:
            task.cancel()

    async def _measure(self, model: str) -> None:
        try:
            model_dir, args = self._locate(model)
            result: Measured | str = await self._figure(model_dir, args)
            self._log(model, result)

        except asyncio.CancelledError:
            raise
        except Exception as exc:  # placement falls back to the memory split and says why
            log.warning("node %s: cannot measure its speed on %s: %r", self.node_id, model, exc)
            result = f"cannot measure its speed: {exc}"
        self._results[model] = result
        self._on_measured()

    async def _figure(self, model_dir: Path, args: ModelArgs) -> Measured:
        """The layer of `args`'s shape, read from the cache or measured (and cached)."""
        key = speed_key(self.engine, model_dir, args)
        cached = None if self.remeasure else self._read_cache().get(key)
        if cached is not None:
            return Measured(LayerSpeed(cached["decode_ns"], cached["prefill_ns"]), cached["seconds"], cached=True)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self.executor, self._measure_now, model_dir, args)
        self._write_cache(key, result)
        return result

    def _measure_now(self, model_dir: Path, args: ModelArgs) -> Measured:
        """Engine thread: wait for this host's other nodes to finish measuring, then measure."""
        waited = time.monotonic()
        with _host_lock():
            waited = time.monotonic() - waited
            started = time.monotonic()
            speed = self.engine.measure_layer(model_dir, args)
            seconds = time.monotonic() - started
        if waited >= 0.1:
            log.info("node %s: waited %.1fs for this host's other nodes to measure first", self.node_id, waited)
        return Measured(speed, seconds, cached=False)

    def _log(self, model: str, result: Measured) -> None:
        how = "read from the cache (measured in %.2fs)" if result.cached else "measured in %.2fs"
        log.info("node %s: layer speed on %s: decode %.3f ms, prefill %.3f ms per position; " + how, self.node_id,
                 Path(model).name, result.speed.decode_ns / 1e6, result.speed.prefill_ns / 1e6, result.seconds)

    def _read_cache(self) -> dict[str, dict[str, float]]:
        try:
            data = json.loads(self.cache_path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {key: entry for key, entry in data.items() if isinstance(entry, dict) and _valid_entry(entry)}

    def _write_cache(self, key: str, result: Measured) -> None:
        entries = self._read_cache()
        entries[key] = {"decode_ns": result.speed.decode_ns, "prefill_ns": result.speed.prefill_ns,
                        "seconds": round(result.seconds, 3), "measured_at": int(time.time())}
        temporary = self.cache_path.with_suffix(".tmp")
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(entries, indent=1))
            temporary.replace(self.cache_path)  # whole or not at all: a node killed mid-write keeps the old cache
        except OSError as exc:
            log.warning("node %s: cannot cache its layer speed in %s: %s", self.node_id, self.cache_path, exc)


def _valid_entry(entry: dict) -> bool:
    return all(isinstance(entry.get(k), int) and entry[k] > 0 for k in ("decode_ns", "prefill_ns")) and \
        isinstance(entry.get("seconds"), (int, float))


class _host_lock:
    """One measurement at a time on this machine (an flock on a file in the temp folder; released if the process
    dies). Gives up waiting after LOCK_WAIT_SECONDS, and measures without it where the file cannot be opened."""

    def __enter__(self) -> "_host_lock":
        self.fd: int | None = None
        try:
            self.fd = os.open(HOST_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            return self
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError:
                if time.monotonic() >= deadline:
                    return self
                time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
