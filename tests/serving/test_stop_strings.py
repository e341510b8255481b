"""Stop strings on streamed text: exact cut, hold-back of possible beginnings, any chunking."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from exo_like.serving.stop_strings import StopStringFilter


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    stop_filter = StopStringFilter(stops)
    out = [stop_filter.feed(piece) for piece in pieces]
    out.append(stop_filter.flush())
    return out, stop_filter.stopped


def expected(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """Generation stops at the first piece after which the text holds a stop string, and the text is cut at the
    earliest one then present. (A longer stop string that started earlier but would complete later never gets
    the chance: generation has stopped.)"""
    text = ""
    for piece in pieces:
        text += piece
        cuts = [i for s in stops if (i := text.find(s)) >= 0]
        if cuts:
            return text[: min(cuts)], True
    return text, False


def test_cut_excludes_the_stop_string_and_what_follows() -> None:
    out, stopped = run(["END"], ["Hello E", "N", "D and more", "ignored"])
    assert "".join(out) == "Hello "
    assert stopped


def test_a_possible_beginning_is_held_back_then_released() -> None:
    stop_filter = StopStringFilter(["Hello"])
    assert stop_filter.feed("say Hel") == "say "
    assert stop_filter.feed("p") == "Help"
    assert stop_filter.feed(" He") == " "
    assert stop_filter.flush() == "He"
    assert not stop_filter.stopped


def test_text_that_cannot_start_a_stop_string_is_not_delayed() -> None:
    stop_filter = StopStringFilter(["xyz", "\n\n"])
    assert stop_filter.feed("abc") == "abc"
    assert stop_filter.feed("def\n") == "def"


def test_earliest_of_several_stop_strings_wins() -> None:
    out, _ = run(["world", "lo w"], ["hel", "lo wor", "ld"])
    assert "".join(out) == "hel"


def test_the_first_stop_string_to_complete_ends_generation() -> None:
    out, stopped = run(["c", "aca"], ["ac", "a"])
    assert "".join(out) == "a" and stopped


def test_nothing_after_stopping() -> None:
    stop_filter = StopStringFilter(["."])
    assert stop_filter.feed("a.b") == "a"
    assert stop_filter.feed("more") == ""
    assert stop_filter.flush() == ""


def test_no_stop_strings_passes_everything() -> None:
    out, stopped = run([], ["a", "b\n"])
    assert out == ["a", "b\n", ""]
    assert not stopped


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="abc\ufffd", min_size=1, max_size=4), max_size=4),
    text=st.text(alphabet="abcd\ufffd", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
@example(stops=["c", "aca"], text="aca", cuts=[2])  # "c" completes first, inside the later "aca"
def test_any_chunking_gives_the_text_up_to_the_first_stop(stops: list[str], text: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, stopped = run(stops, pieces)
    want, want_stopped = expected(stops, pieces)
    assert "".join(out) == want
    assert stopped == want_stopped
