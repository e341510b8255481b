"""Fixtures the model tests share: the real SmolLM2 file the Makefile installs."""

from __future__ import annotations

from pathlib import Path

import pytest

from exo_like.models.names.catalog import PACKAGED

SMOLLM2 = PACKAGED["smollm2-135m"]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    path = SMOLLM2.path()
    if path is None:
        pytest.fail(SMOLLM2.missing_message())  # the Makefile installs it: its absence is a broken set-up
    return path
