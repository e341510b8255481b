"""Node identity: persistent across restarts, distinct for nodes sharing a home folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from exo_like.cluster.identity import claim_identity


def test_restart_keeps_id_and_concurrent_nodes_differ(tmp_path: Path) -> None:
    first = claim_identity(tmp_path)
    second = claim_identity(tmp_path)  # same home, still running: must not collide
    assert first.node_id != second.node_id and (first.slot, second.slot) == (0, 1)
    first_id = first.node_id
    first.release()
    again = claim_identity(tmp_path)
    assert again.node_id == first_id
    second.release()
    again.release()


def test_lock_is_held_across_processes(tmp_path: Path) -> None:
    holder = claim_identity(tmp_path)
    code = ("from pathlib import Path; from exo_like.cluster.identity import claim_identity; "
            f"print(claim_identity(Path({str(tmp_path)!r})).node_id)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other and other != holder.node_id
    holder.release()
