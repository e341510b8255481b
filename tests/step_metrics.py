"""A node's engine steps as its /metrics counts them (the `iteration_tokens_total` histogram: rows, that is
positions, per step of the node's layers), to observe how a request was cut into steps rather than infer it."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from exo_like.serving.scheduler import DEFAULT_MAX_BATCH_TOKENS
from tests.api_server import NodeProcess

HISTOGRAM = "exo_like:iteration_tokens_total"


@dataclass(frozen=True)
class Steps:
    count: int  # steps
    rows: int  # rows of all of them
    at_most: dict[float, int]  # steps of at most this many rows, by the histogram's bucket bounds

    def __sub__(self, before: "Steps") -> "Steps":
        """The steps taken since `before`."""
        return Steps(self.count - before.count, self.rows - before.rows,
                     {bound: n - before.at_most[bound] for bound, n in self.at_most.items()})

    def over(self, rows: int) -> int:
        """Steps of more than `rows` rows (`rows` must be one of the histogram's bucket bounds)."""
        return self.count - self.at_most[float(rows)]


def steps(node: NodeProcess) -> Steps:
    status, _, raw = node.request("GET", "/metrics")
    assert status == 200, raw
    count, rows, at_most = None, None, {}
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            if sample.name == HISTOGRAM + "_count":
                count = int(sample.value)
            elif sample.name == HISTOGRAM + "_sum":
                rows = int(sample.value)
            elif sample.name == HISTOGRAM + "_bucket":
                at_most[float(sample.labels["le"])] = int(sample.value)
    assert count is not None and rows is not None and at_most, raw
    return Steps(count, rows, at_most)


def own_entry(node: NodeProcess) -> dict:
    """The node's own entry in its /v1/cluster."""
    view = node.get_json("/v1/cluster")
    return next(n for n in view["nodes"] if n["id"] == view["node_id"])


def batch_rows(node: NodeProcess) -> int:
    """The most rows the node's scheduler puts in one step by default, which depends on where it computes."""
    return DEFAULT_MAX_BATCH_TOKENS["cpu" if own_entry(node)["device"] == "cpu" else "accelerator"]
