"""Recent rates (tokens per second) for the dashboard: events counted over a short sliding window."""

from __future__ import annotations

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
