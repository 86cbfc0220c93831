"""runtime/evloop.py: the setting picks the loop a process runs (`auto`: the process's own
default; a worker's is asyncio's, as a served worker shows), and a bad one is refused before
anything starts."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pdserve.runtime import evloop

uvloop = pytest.importorskip("uvloop")


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.parametrize(
    ("setting", "default", "module"),
    [
        (None, "uvloop", "uvloop"),
        ("auto", "uvloop", "uvloop"),
        (None, "asyncio", "asyncio"),
        ("auto", "asyncio", "asyncio"),
        ("uvloop", "asyncio", "uvloop"),
        ("uvloop", "uvloop", "uvloop"),
        ("asyncio", "uvloop", "asyncio"),
    ],
)
def test_the_setting_picks_the_loop(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, default: str, module: str
) -> None:
    if setting is None:
        monkeypatch.delenv(evloop.ENV, raising=False)
    else:
        monkeypatch.setenv(evloop.ENV, setting)
    assert evloop.chosen(default) == module
    assert evloop.run(loop_module(), default=default).split(".")[0] == module


def test_a_bad_setting_is_refused_and_the_coroutine_never_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(evloop.ENV, "trio")
    started = []

    async def main() -> None:
        started.append(True)

    with pytest.raises(ValueError, match="expected one of auto, uvloop, asyncio"):
        evloop.run(main())
    monkeypatch.delenv(evloop.ENV)
    with pytest.raises(ValueError, match="default must be uvloop or asyncio"):
        evloop.run(main(), default="auto")
    assert started == []


def test_uvloop_demanded_but_missing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(evloop.ENV, "uvloop")
    monkeypatch.setattr(evloop.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="uvloop is not installed"):
        evloop.chosen()
    monkeypatch.setenv(evloop.ENV, "auto")  # where it is not installed, auto runs asyncio's
    assert evloop.chosen() == "asyncio"


def test_a_uvloop_that_does_not_import_is_asyncio_unless_demanded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(evloop.importlib.util, "find_spec", lambda name: object())  # found
    monkeypatch.setitem(sys.modules, "uvloop", None)  # ... but `import uvloop` fails
    monkeypatch.setenv(evloop.ENV, "auto")
    assert evloop.loop_factory("uvloop") is None
    monkeypatch.setenv(evloop.ENV, "uvloop")
    with pytest.raises(ImportError):
        evloop.loop_factory("uvloop")
