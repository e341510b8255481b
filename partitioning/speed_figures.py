"""What a node announces for placement by speed (in every plan announcement, like its load): which placement it
runs with, its measured layer speed for the cluster's model, and each of its links' round trips."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PLACEMENTS = ("compute", "memory")
PARALLEL_MODES = ("auto", "pipeline", "tensor")
RTT_FLOOR_US = 2048  # round trips up to this count as this: a LAN's and a loopback's hops all look alike
RTT_SAMPLES = 3  # round trips a link must have measured before its own figure replaces the floor
LINK_FLOOR_US = 32  # the finer round trip (link_us) counts from here


@dataclass(frozen=True)
class SpeedFigures:
    placement: str = "compute"  # its --placement
    model: str | None = None  # the model key the figures below are for (None: no model yet)
    decode_ns: int | None = None  # one layer, one decode step, batch 1 (None: measuring, or failed)
    prefill_ns: int | None = None  # one layer, per position of a prefill chunk
    measure_seconds: float | None = None  # what the measurement cost (read from the cache: what it cost then)
    cached: bool = False  # the figures came from this node's cache: nothing was measured now
    problem: str | None = None  # why there are no figures for the model (its measurement failed)
    # Round trip of each link, by peer node id, in microseconds: the lowest seen (queueing only adds to a round
    # trip), rounded up to a power of two, so a plan does not follow every jitter (see speed.rtt_bucket_us).
    rtt_us: dict[str, int] = field(default_factory=dict)
    parallel: str = "auto"  # its --parallel
    # Tensor parallelism: one layer's decode step on the largest rank slice of a group of N ("2": ns), measured
    # like decode_ns; each link's round trip as rtt_us but finer (a collective waits for it twice per layer, so a
    # LAN's 0.2 ms and a loopback's 0.05 ms matter); each group this node led, its measured all-reduce time (by the
    # members' ids, comma-joined in rank order).
    slice_decode_ns: dict[str, int] = field(default_factory=dict)
    link_us: dict[str, int] = field(default_factory=dict)
    allreduce_ns: dict[str, int] = field(default_factory=dict)
    link_mbit: dict[str, int] = field(default_factory=dict)  # each link's bandwidth, Mbit/s (a power of two)

    def measured_for(self, model: str | None) -> bool:
        return model is not None and self.model == model and self.decode_ns is not None

    def failed_for(self, model: str | None) -> bool:
        return model is not None and self.model == model and self.problem is not None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SpeedFigures":
        """From a map whose fields protocol.decode checked (absent ones read as their defaults)."""
        return cls(**{key: value for key, value in data.items() if key in cls.__dataclass_fields__})


class SpeedSource:
    """Where a cluster gets this node's own figures: its --placement, its measured speed and its links' round
    trips (speed.SpeedProbe in a node). This default runs with --placement memory and measures nothing."""

    def figures(self, model: str | None) -> SpeedFigures:
        return SpeedFigures(placement="memory")

    def measure(self, model: str, group_limit: int = 1) -> None:
        """Start measuring this node's speed on `model` unless done or under way (figures() says when done); and
        with `group_limit` > 1 (members of its engine), a rank's slice for tensor-parallel groups up to that size."""
