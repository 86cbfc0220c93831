"""No log line repeats without bound (issue 17 part 6: floods must not become log floods)."""

from __future__ import annotations

import logging

from pdserve.runtime import logs


def record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("pdserve.x", logging.WARNING, __file__, 1, msg, args, None)


def test_a_repeated_line_is_cut_after_a_burst_and_counted(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    f = logs.RepeatFilter(burst=3, window_s=10.0)
    passed = [f.filter(record("dropped a frame from %s", i)) for i in range(10)]
    assert passed == [True] * 3 + [False] * 7
    assert f.filter(record("another line")) is True  # other templates are not affected
    now[0] += 11.0
    r = record("dropped a frame from %s", 99)
    assert f.filter(r) is True
    assert "[7 more like this were not logged]" in r.getMessage()
