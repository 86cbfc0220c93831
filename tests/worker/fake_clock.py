"""A clock that moves only when the test moves it (runtime/timing.py `Clock`).

The engines and roles of tests/worker/wire.py read time from one of these, so a deadline, a
ping or a peer's silence happens when the test advances the clock, never because the machine
is slow: a test that needs "5 s of silence" advances 5 s instead of sleeping.
"""

from __future__ import annotations


class FakeClock:
    def __init__(self, start: float = 1_000.0, wall_start: float = 1_700_000_000.0) -> None:
        self.now = start
        self._wall_minus_now = wall_start - start

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self._wall_minus_now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        self.now += seconds

    def ahead(self, seconds: float) -> AheadClock:
        """This clock as another host sees it: the same passing of time, its wall clock
        `seconds` ahead (negative: behind)."""
        return AheadClock(self, seconds)


class AheadClock:
    def __init__(self, base: FakeClock, seconds: float) -> None:
        self.base, self.seconds = base, seconds

    def monotonic(self) -> float:
        return self.base.monotonic()

    def wall(self) -> float:
        return self.base.wall() + self.seconds
