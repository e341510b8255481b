"""A 4-bit model on a torch node holds about its stored bytes: its parameters within 1.15x of the file, and the
node's resident memory after a request within 1.2x the stored bytes + 100 MB of the same node without a model.
The same holds for the default model (SmolLM2-135M Q4_1, what `make run` serves) on a node started as `make run`
starts it. (bench/bench_memory.py prints the same figures, with the dequantized reference path beside them.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (install the 'torch' extra)")
pytest.importorskip("gguf", reason="gguf is not installed")
if not sys.platform.startswith("linux"):
    pytest.skip("reads resident memory as Linux reports it", allow_module_level=True)

from exo_like.models.catalog import PACKAGED  # noqa: E402
from tests.memory_probe import (DEFAULT_NODE, PARAMETER_RATIO, Checkpoint, baseline, build_checkpoints,  # noqa: E402
                                measure)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):  # type: ignore[no-untyped-def]
    return build_checkpoints(tmp_path_factory.mktemp("memory"))


@pytest.fixture(scope="module")
def without_model(tmp_path_factory) -> int:
    return baseline(tmp_path_factory.mktemp("memory-home") / "empty")


@pytest.mark.parametrize("index", [0, 1], ids=["gguf-q4_k", "mlx-4bit"])
def test_a_4_bit_model_on_a_torch_node_holds_about_its_stored_bytes(checkpoints, without_model, index: int,
                                                                    tmp_path: Path, record_property) -> None:
    if index >= len(checkpoints):
        pytest.skip("mlx-lm is not installed (it writes the MLX-format checkpoint)")
    result = measure(tmp_path / "home", checkpoints[index], without_model)
    record_property("report", result.summary())
    # The kernel takes every matrix but the embedding and head, whose 617 rows are not a multiple of 16.
    assert all("617 outputs" in why for why in result.weights["dequantized"]), result.weights
    assert result.parameter_ratio <= PARAMETER_RATIO, result
    assert result.resident_growth <= result.resident_limit, result


def test_the_default_model_on_a_default_node_holds_about_its_file(tmp_path: Path, record_property) -> None:
    # SmolLM2's embedding is Q8_0 (tied to the head), held as two int4 packs, whose rows the embedding reads from
    # the packs in whatever layout this machine's torch build writes them (AVX-512, AVX2, scalar), so the bounds
    # hold on every machine kind.
    packaged = PACKAGED["smollm2-135m"]
    path = packaged.path()
    if path is None:
        pytest.fail(packaged.missing_message())  # the Makefile installs it: its absence is a broken set-up
    without_model = baseline(tmp_path / "empty", DEFAULT_NODE)
    result = measure(tmp_path / "home", Checkpoint("SmolLM2 Q4_1", path, path.stat().st_size), without_model,
                     options=DEFAULT_NODE, chat=True)
    record_property("report", result.summary())
    assert result.weights["dequantized"] == {}, result.weights
    assert result.parameter_ratio <= PARAMETER_RATIO, result
    assert result.resident_growth <= result.resident_limit, result
