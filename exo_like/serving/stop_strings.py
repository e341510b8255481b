"""Stop strings, applied to generated text as it streams.

The returned text excludes the stop string and everything after it. While streaming, text that could be the
beginning of a stop string is held back, so nothing emitted ever has to be taken back.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringFilter:
    def __init__(self, stop: Sequence[str]):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped the text (Anthropic reports it)
        self._held = ""

    def feed(self, text: str) -> str:
        """Add generated text; return the part that is safe to emit. After a stop string, returns ""."""
        if self.stopped:
            return ""
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            cut, self.matched = match
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._partial_suffix_length(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of generation the held text cannot become a stop string any more."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """Where the earliest stop string in `buffer` begins, and which one it is."""
        found = [(i, s) for s in self.stop if (i := buffer.find(s)) >= 0]
        return min(found, key=lambda hit: hit[0]) if found else None

    def _partial_suffix_length(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is a proper beginning of some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buffer)), longest, -1):
                if buffer.endswith(s[:k]):
                    longest = k
                    break
        return longest
