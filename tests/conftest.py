"""Suite-wide hooks: figures a test measures (as `record_property("report", line)`) are printed at the end of the
run, passed or failed, so `make test` shows them without -s (the int4 quality test's perplexities, for one)."""

from __future__ import annotations

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = [(report.nodeid, value) for outcome in ("passed", "failed")
             for report in terminalreporter.stats.get(outcome, [])
             if report.when == "call" for name, value in report.user_properties if name == "report"]
    if lines:
        terminalreporter.section("measured figures")
        for nodeid, value in lines:
            terminalreporter.write_line(f"{nodeid}: {value}")
