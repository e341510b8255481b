"""Suite-wide hooks.

- Workers: `make test` runs the suite in TEST_WORKERS pytest-xdist processes (a file each at a time). Each
  worker's own torch gets its share of the machine's cores (one each on 2 cores): two OpenMP teams wider than
  their share would stall at every barrier while the other worker holds a core, as nodes' teams do
  (tests/api_server.py starts nodes with one thread for the same reason).
- Order: files holding a test marked `slow` (over ~12 s alone) run first. Workers take a file at a time, so the
  long files then start early and the run ends on short ones, not on one worker finishing a long file alone.
  (`-m "not slow"` runs the rest, for a quick look.)
- Collections: at each test file's start, what lives then (the imports of torch, transformers and mlx: hundreds of
  thousands of objects; session fixtures) is frozen out of the garbage collector's passes (gc.freeze), after the
  garbage of the file before is collected. An engine's load runs a full collection (engines/base.py), which
  otherwise walked all of it, half a second a load. Files that load many engines freeze more (the fixtures
  `objects_kept_by_this_file_frozen` and `earlier_tests_objects_frozen`, tests/gc_freeze.py): they unfreeze and
  collect all at their end; the next file's start freezes again.
- Figures a test measures (as `record_property("report", line)`) are printed at the end of the run, passed or
  failed, so `make test` shows them without -s (the int4 quality test's perplexities, for one).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.gc_freeze import freeze_what_lives_now, long_lived_objects_frozen


def pytest_configure(config: pytest.Config) -> None:
    # Triton kernels run in its interpreter, on CPU tensors (tests/engines/test_cuda_kernels.py): set before anything
    # imports triton, which reads it then. (The GPU check, bench/cuda_check.py, runs them compiled.)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Before torch is imported (no plugin imports it), so its OpenMP team starts at this size.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    with_slow_tests = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in with_slow_tests)  # stable: a file's tests stay together, in order


@pytest.fixture(scope="module", autouse=True)
def what_lives_at_a_files_start_frozen() -> None:
    freeze_what_lives_now()  # the collection walks only what was made since the last freeze


@pytest.fixture(scope="module")
def objects_kept_by_this_file_frozen() -> Iterator[None]:
    """What a file keeps (checkpoints, oracles' answers, engines) out of the collections its engines' loads run."""
    with long_lived_objects_frozen():
        yield


@pytest.fixture
def earlier_tests_objects_frozen() -> None:
    """Each test starts by collecting the garbage of the one before and freezing what still lives."""
    freeze_what_lives_now()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = [(report.nodeid, value) for outcome in ("passed", "failed")
             for report in terminalreporter.stats.get(outcome, [])
             if report.when == "call" for name, value in report.user_properties if name == "report"]
    if lines:
        terminalreporter.section("measured figures")
        for nodeid, value in lines:
            terminalreporter.write_line(f"{nodeid}: {value}")
