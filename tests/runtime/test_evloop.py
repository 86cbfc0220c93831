"""runtime/evloop.py: the setting picks the loop a process runs, and a bad one is refused
before anything starts."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.runtime import evloop

uvloop = pytest.importorskip("uvloop")


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.parametrize(
    ("setting", "module"),
    [(None, "uvloop"), ("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")],
)
def test_the_setting_picks_the_loop(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, module: str
) -> None:
    if setting is None:
        monkeypatch.delenv(evloop.ENV, raising=False)
    else:
        monkeypatch.setenv(evloop.ENV, setting)
    assert evloop.chosen() == module
    assert evloop.run(loop_module()).split(".")[0] == module


def test_a_bad_setting_is_refused_and_the_coroutine_never_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(evloop.ENV, "trio")
    started = []

    async def main() -> None:
        started.append(True)

    with pytest.raises(ValueError, match="expected one of auto, uvloop, asyncio"):
        evloop.run(main())
    assert started == []


def test_uvloop_demanded_but_missing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(evloop.ENV, "uvloop")
    monkeypatch.setattr(evloop.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="uvloop is not installed"):
        evloop.chosen()
    monkeypatch.setenv(evloop.ENV, "auto")  # where it is not installed, auto runs asyncio's
    assert evloop.chosen() == "asyncio"
