"""Recent numbers for the dashboard: rates (events counted over a short sliding window) and step times."""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable

RATE_WINDOW_SECONDS = 2.0  # long enough to smooth single tokens, short enough that a stop shows within 2 s


class RateMeter:
    """Events per second over the last `window` seconds (0 once nothing happened for a whole window)."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.window = window
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._count = 0  # sum of the counts in _events

    def add(self, count: int = 1) -> None:
        self._events.append((self._clock(), count))
        self._count += count
        self._expire()

    def rate(self) -> float:
        self._expire()
        return self._count / self.window

    def _expire(self) -> None:
        horizon = self._clock() - self.window
        while self._events and self._events[0][0] <= horizon:
            self._count -= self._events.popleft()[1]


class RecentMedian:
    """The median of the last `size` values added (None before the first): robust to the odd slow step."""

    def __init__(self, size: int = 32):
        self._values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._values.append(value)

    def median(self) -> float | None:
        # tuple() copies in one C call under the GIL, so a value added meanwhile by another thread cannot
        # disturb it.
        values = tuple(self._values)
        return statistics.median(values) if values else None
