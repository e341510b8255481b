"""Static peer parsing, mDNS discovery between real network namespaces (real multicast), and which found peers
the finder dials."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import discovery.finder as finder_module
from discovery import PeerAddress, PeerFinder, parse_peers
from discovery.finder import FORGET_AFTER_SECONDS, MAX_EXCHANGED
from tests.netns import requires_netns, netns_hosts

REPO = Path(__file__).resolve().parents[2]


def test_parse_peers() -> None:
    assert parse_peers("a:1, b ,[::1]:3,10.0.0.2:52416", default_port=9) == [
        PeerAddress("a", 1), PeerAddress("b", 9), PeerAddress("::1", 3), PeerAddress("10.0.0.2", 52416)
    ]
    assert parse_peers(None) == [] and parse_peers("") == []


@pytest.mark.parametrize("bad", ["a:b", "a:0", "a:70000", ":5"])
def test_parse_peers_rejects_bad_entries(bad: str) -> None:
    with pytest.raises(ValueError, match="bad peer"):
        parse_peers(bad)


PROBE = textwrap.dedent("""
    import asyncio, sys, logging
    from discovery.mdns import MdnsDiscovery
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    async def main():
        node_id, key, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
        d = MdnsDiscovery(node_id, 52415, key, "0", lambda p: print("FOUND", p.node_id, p.host, flush=True))
        await d.start()
        await asyncio.sleep(seconds)
        await d.stop()
    asyncio.run(main())
""")


@requires_netns
@pytest.mark.netns
def test_mdns_finds_same_cluster_and_refuses_other_cluster(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    keys = ["digest-a", "digest-a", "digest-b"]
    with netns_hosts(3) as hosts:
        procs = [subprocess.Popen(h.command(sys.executable, str(script), f"n{i}", keys[i], "4"), cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i, h in enumerate(hosts)]
        outputs = [p.communicate(timeout=30)[0] for p in procs]
    assert f"FOUND n1 {hosts[1].address}" in outputs[0], outputs[0]
    assert f"FOUND n0 {hosts[0].address}" in outputs[1], outputs[1]
    assert "FOUND" not in outputs[2], outputs[2]
    assert "refusing peer n2" in outputs[0] and "different cluster key" in outputs[0]
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(h.namespace not in leftover for h in hosts)


async def test_a_node_of_another_cluster_is_reported_not_dialed_until_it_advertises_our_key() -> None:
    dialed: list[tuple[str, int]] = []
    reports: list[tuple[str | None, str]] = []

    async def dial(host: str, port: int) -> str | None:
        dialed.append((host, port))
        return None

    finder = PeerFinder("me", dial, lambda node_id: False, [], None,
                        lambda peer, code, reason: reports.append((peer.node_id, code)))
    finder.found_other_cluster(PeerAddress("10.0.0.7", 52415, "other"))
    await finder._dial_unlinked()  # one round of the redial loop
    assert dialed == [] and reports == [("other", "other_cluster")] * 2  # when found, and again each round
    finder.found_on_mdns(PeerAddress("10.0.0.7", 52415, "other"))  # restarted with this cluster's key
    reports.clear()
    await finder._dial_unlinked()
    assert dialed == [("10.0.0.7", 52415)] and reports == []
    finder.found_other_cluster(PeerAddress("10.0.0.7", 52415, "other"))  # and back to another key
    finder.gone_from_mdns("other")  # then it left the network
    dialed.clear()
    reports.clear()
    await finder._dial_unlinked()
    assert dialed == [] and reports == []


async def test_peers_learned_from_peers_are_dialed_until_linked_and_forgotten_when_unreachable(monkeypatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(finder_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    dialed: list[tuple[str, int]] = []
    linked: set[str] = set()

    async def dial(host: str, port: int) -> str | None:
        dialed.append((host, port))
        return None

    finder = PeerFinder("me", dial, lambda node_id: node_id in linked, [], None)
    finder.found_by_peer(PeerAddress("10.0.0.9", 52415, "me"))  # this node, as a peer knows it: never dialed
    finder.found_by_peer(PeerAddress("10.0.0.7", 52415, "b"))
    await finder._dial_unlinked()
    assert dialed == [("10.0.0.7", 52415)]
    linked.add("b")
    await finder._dial_unlinked()
    assert dialed == [("10.0.0.7", 52415)]  # linked: not dialed again
    linked.clear()  # lost; still dialed for a while, like a static peer
    now[0] += FORGET_AFTER_SECONDS
    await finder._dial_unlinked()
    assert dialed == [("10.0.0.7", 52415)] * 2
    now[0] += 1  # unreachable for longer than that: forgotten until a peer reports it anew
    await finder._dial_unlinked()
    await finder._dial_unlinked()
    assert dialed == [("10.0.0.7", 52415)] * 2
    finder.found_by_peer(PeerAddress("10.0.0.7", 52415, "b"))
    await finder._dial_unlinked()
    assert dialed == [("10.0.0.7", 52415)] * 3


async def test_a_node_remembers_a_bounded_number_of_peers_learned_from_peers() -> None:
    dialed: list[tuple[str, int]] = []

    async def dial(host: str, port: int) -> str | None:
        dialed.append((host, port))
        return None

    finder = PeerFinder("me", dial, lambda node_id: False, [], None)
    for i in range(MAX_EXCHANGED + 5):
        finder.found_by_peer(PeerAddress("127.0.0.1", 1000 + i, f"n{i}"))
    await finder._dial_unlinked()
    assert sorted(dialed) == [("127.0.0.1", 1000 + i) for i in range(MAX_EXCHANGED)]
