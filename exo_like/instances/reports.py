"""What a node says about itself, added up over its instances' parts: /health's status, the load it announces to
its peers (cluster/node_load.py), and the counters of its clients' requests (/v1/debug/requests, /metrics)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from exo_like.cluster.node_load import NodeLoad
from exo_like.engines.base import Engine
from exo_like.instances.runtime import InstancePart
from exo_like.models.hub.progress import DownloadProgress
from exo_like.models.names.resolver import LoadedModel


class NodeReports:
    """`parts`: this node's parts of the instances now; `served`: the models the cluster serves; `engine`: the node's
    own engine (its device and numerics stand for the node while it holds no layers)."""

    def __init__(self, node_id: str, engine: Engine, download: DownloadProgress,
                 parts: Callable[[], list[InstancePart]], served: Callable[[], list[LoadedModel]], started: float):
        self.node_id = node_id
        self.engine = engine
        self.download = download
        self.parts = parts
        self.served = served
        self.started = started  # time.time() at the node's start
        self.replays = 0  # this node's clients' requests resumed on a new ring

    def generation_stats(self) -> dict[str, object]:
        totals = {"in_flight_requests": 0, "active_kv_caches": 0, "requests_total": 0, "tokens_generated_total": 0,
                  "replays_total": self.replays}
        for part in self.parts():
            for key, value in part.generator.stats().items():
                if key != "replays_total":
                    totals[key] += int(value)  # type: ignore[call-overload]
        return totals

    def status(self, stopping: bool, ready: bool) -> dict[str, object]:
        """What /health reports (and what a dashboard shows about this node)."""
        served = self.served()
        engines = [part.serving for part in self.parts()]
        return {
            "status": "stopping" if stopping else "ok",
            "node_id": self.node_id,
            "model": served[0].model_id if served else None,
            "models": [model.model_id for model in served],
            "engine": self.engine.name,
            "device": self.engine.device_name,
            "dtype": engines[0].dtype_name if engines else self.engine.dtype_name,
            # The bytes this node's layers hold; of a quantized model, the matrices run quantized and those
            # dequantized for want of a kernel.
            "weights": {"parameter_bytes": sum(engine.parameter_bytes() for engine in engines),
                        "quantized": added(engine.weight_forms.quantized for engine in engines),
                        "dequantized": added(engine.weight_forms.dequantized for engine in engines)},
            "uptime_seconds": round(time.time() - self.started, 1),
            "cluster_ready": ready,
            **self.generation_stats(),
        }

    def current_load(self) -> NodeLoad:
        """What this node is doing now (shared with peers in its announcements)."""
        parts = self.parts()
        engines = [part.serving for part in parts]
        numerics = next((engine.numerics() for engine in engines if engine.shard is not None), None)
        weights = {"quantized_weights": added(engine.weight_forms.quantized for engine in engines),
                   "dequantized_weights": added(engine.weight_forms.dequantized for engine in engines),
                   "numerics": numerics if numerics is not None else self.engine.numerics()}
        if not parts:
            return NodeLoad(download=self.download.status(), **weights)
        steps = [s for part in parts if (s := part.stage.decode_step_seconds.median()) is not None]
        counts: dict[str, int] = {}
        for part in parts:
            for key, value in part.stage.scheduler_counts().items():
                counts[key] = counts.get(key, 0) + value
        return NodeLoad(sum(p.stage.throughput.rate() for p in parts),
                        sum(p.generator.throughput.rate() for p in parts),
                        sum(len(p.generator.in_flight) for p in parts), any(p.stage.busy() for p in parts),
                        self.download.status(), max(p.stage.step_seconds() for p in parts),
                        max(steps) * 1000 if steps else None, sum(engine.kv_blocks for engine in engines),
                        kv_window_blocks=sum((e.kv_size and e.kv_size.window_blocks) or 0 for e in engines),
                        **counts, **weights, replays=self.replays,
                        recovering=added(p.generator.recovering() for p in parts))

    def in_flight(self) -> list[dict[str, object]]:
        return [progress.to_json() for part in self.parts() for progress in part.generator.in_flight.values()]


def added(counts: Iterable[Any]) -> dict[str, int]:
    """Maps of counts added key by key."""
    total: dict[str, int] = {}
    for each in counts:
        for key, value in each.items():
            total[key] = total.get(key, 0) + value
    return total
