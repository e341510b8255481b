"""The replicated set of instances (exo_like/instances/wishes.py): nodes that have seen the same writes hold the same
registers, whatever order the writes arrived in; the newest write of a model wins; an old write never revives an
unloaded model."""

from __future__ import annotations

import itertools
import random

from exo_like.instances.wishes import Wish, Wishes


def test_nodes_that_saw_the_same_writes_in_any_order_agree() -> None:
    a, b, c = Wishes("a"), Wishes("b"), Wishes("c")
    writes = [a.load("m1"), b.load("m2"), a.load("m2", ("a",)), c.load("m1")]
    b.merge(writes[:1])  # b has seen a's write of m1, so it can unload m1
    writes += [b.unload("m1"), c.load("m3")]
    assert None not in writes
    for order in itertools.islice(itertools.permutations(writes), 0, 720, 37):
        node = Wishes("z")
        for wish in order:
            node.merge([wish])
        assert node.all() == sorted({w.model: max((x for x in writes if x.model == w.model),
                                                  key=lambda x: x.clock) for w in writes}.values(),
                                    key=lambda w: w.clock)


def test_a_write_after_seeing_another_wins_over_it_and_an_older_one_cannot_revive_a_model() -> None:
    a, b = Wishes("a"), Wishes("b")
    first = a.load("m")
    b.merge([first])
    gone = b.unload("m")
    assert gone is not None and gone.clock > first.clock
    a.merge([gone])
    a.merge([first])  # the old write again, late
    assert a.get("m") == gone and a.loaded() == []
    again = a.load("m")
    b.merge([again])
    assert [w.model for w in b.loaded()] == ["m"] and b.get("m") == again


def test_loaded_models_come_oldest_first_and_repeats_write_nothing() -> None:
    node = Wishes("n")
    node.load("x")
    node.load("y")
    assert node.load("x") is None and node.unload("zzz") is None
    assert [w.model for w in node.loaded()] == ["x", "y"]
    node.merge([Wish("w", (0, "q"), True)])
    assert [w.model for w in node.loaded()] == ["w", "x", "y"]


def test_wishes_survive_the_wire() -> None:
    rng = random.Random(1)
    node = Wishes("n")
    for i in range(20):
        node.load(f"m{rng.randrange(5)}", tuple(rng.sample("abc", rng.randrange(3)))) if rng.random() < 0.7 \
            else node.unload(f"m{rng.randrange(5)}")
    assert [Wish.from_wire(w.to_wire()) for w in node.all()] == node.all()
