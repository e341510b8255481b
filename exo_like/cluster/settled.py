"""Which membership a plan may be made over: one that every member sees.

Links form one at a time. A node that joins through one member (a bootstrap address in --peers, or the first
answer on mDNS) is linked with that member alone until peer exchange (peers.py) links it with the rest. A plan
made over each node's own view in that window would differ from node to node (the bootstrap member would plan
with the newcomer, the others without it, the newcomer without them), and they would never agree.

So each node announces the peers it is linked with (PlanState.linked), and a node makes a new plan only over a
settled membership: itself and its linked peers, where every one of those peers announced being linked with
exactly the others. Until then it keeps the plan it has while that plan's stages are still linked with each other
(a ring that serves goes on while a newcomer links with everyone), and has no plan otherwise. Once the mesh is
complete every node sees the same members and all plan alike.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

Announced = Mapping[str, Collection[str] | None]  # peer -> the peers it announced being linked with (None: not yet)


def unsettled(me: str, linked: Collection[str], announced: Announced) -> str | None:
    """Why this node's view (`me` and its `linked` peers) is not yet one every member sees; None when it is."""
    view = {me, *linked}
    for peer in sorted(linked):
        theirs = announced.get(peer)
        if theirs is None:
            return f"node {peer} has not announced its links yet"
        theirs_view = {peer, *theirs}
        missing = sorted(view - theirs_view)
        if missing:
            return f"node {peer} is not linked with {', '.join(missing)} yet"
        extra = sorted(theirs_view - view)
        if extra:
            return f"node {peer} is linked with {', '.join(extra)}, which this node is not linked with yet"
    return None


def meshed(nodes: Collection[str], me: str, linked: Collection[str], announced: Announced) -> bool:
    """Whether every two of `nodes` are linked, as far as this node knows: it is linked with each of them, and
    each announced being linked with the others."""
    others = set(nodes) - {me}
    if not others <= set(linked):
        return False
    for node in others:
        theirs = announced.get(node)
        if theirs is None or not set(nodes) - {node} <= set(theirs):
            return False
    return True
