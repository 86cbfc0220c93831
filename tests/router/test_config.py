"""RouterConfig refuses a timeout that could never end or never start."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.router.config import RouterConfig

TIMEOUTS = [f.name for f in dataclasses.fields(RouterConfig) if f.name.endswith("timeout_s")]
TIMEOUTS += ["health_interval_s", "pair_retry_s"]


def test_every_timeout_must_be_positive_and_finite() -> None:
    good = RouterConfig(("http://d",), (), model_path="m")
    assert len(TIMEOUTS) == 10  # every timeout field is checked here
    for name in TIMEOUTS:
        for bad in (float("inf"), float("nan"), -1.0) + (
            (0.0,) if name != "drain_timeout_s" else ()
        ):
            with pytest.raises(ValueError, match="positive and finite"):
                dataclasses.replace(good, **{name: bad})
        dataclasses.replace(good, **{name: 0.5})
