"""The PD roles' timing config (runtime/timing.py `PdTiming`): its defaults are the module's
constants, and a bound that could never be met, or never pass, is refused."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pdserve.runtime import timing
from pdserve.runtime.timing import PD_TIMING, PdTiming


def test_the_defaults_are_the_module_constants():
    for f in dataclasses.fields(PdTiming):
        assert getattr(PD_TIMING, f.name) == getattr(timing, f.name.upper()), f.name


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(PdTiming)])
def test_a_bound_not_finite_and_positive_is_refused(name, bad):
    with pytest.raises(ValueError, match=f"PdTiming.{name} must be a finite number > 0"):
        PdTiming(**{name: bad})


def test_it_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PD_TIMING.peer_timeout_s = 1.0  # type: ignore[misc]
