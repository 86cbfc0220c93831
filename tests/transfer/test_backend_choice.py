"""`--backend auto` and the data planes a worker's device rules out (no processes)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.launch import launch_backend
from pdserve.transfer import receiver
from pdserve.transfer.receiver import choose_backend, unavailable


def test_auto_is_shm_on_the_cpu_and_nixl_or_tcp_on_a_gpu(monkeypatch) -> None:
    assert choose_backend("auto", "cpu") == "shm"
    monkeypatch.setattr(receiver, "nixl_available", lambda: True)
    assert choose_backend("auto", "cuda") == "nixl"
    assert choose_backend("auto", "cuda:1") == "nixl"
    monkeypatch.setattr(receiver, "nixl_available", lambda: False)
    assert choose_backend("auto", "cuda") == "tcp"
    for named in ("shm", "tcp", "nixl"):  # a name the user gave is kept, checked elsewhere
        assert choose_backend(named, "cuda") == named


def test_shm_is_refused_for_a_gpu_pool_with_the_way_out(monkeypatch) -> None:
    why = unavailable("shm", "cuda:0")
    assert why is not None and "nixl" in why and "tcp" in why
    assert unavailable("shm", "cpu") is None
    assert unavailable("tcp", "cuda") is None
    monkeypatch.setattr(receiver, "nixl_available", lambda: False)
    assert "NIXL" in (unavailable("nixl", "cuda") or "")


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"prefill": 1, "backend": "auto", "device": "cpu", **kw})


def test_launch_resolves_auto_and_refuses_what_cannot_work(capsys, monkeypatch) -> None:
    assert launch_backend(_args()) == "shm"
    assert launch_backend(_args(backend="tcp")) == "tcp"
    assert launch_backend(_args(prefill=0)) == "shm"  # co-located: nothing moves
    monkeypatch.setattr(receiver, "nixl_available", lambda: False)
    assert launch_backend(_args(backend="nixl")) is None
    assert "needs NIXL" in capsys.readouterr().err


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_launch_on_a_gpu_never_picks_shm() -> None:
    assert launch_backend(_args(device="cuda")) in ("nixl", "tcp")
    assert launch_backend(_args(device="cuda", backend="shm")) is None
