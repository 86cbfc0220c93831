"""`--engine-process` resolved per device, and the argv chaos and the benchmarks pass on."""

from __future__ import annotations

from pdserve.cli import build_parser
from pdserve.engine_flags import engine_process_argv, use_engine_process


def test_the_engine_process_is_on_for_cuda_unless_asked_otherwise() -> None:
    assert [use_engine_process(None, d) for d in ("cuda", "cuda:1", "cpu")] == [True, True, False]
    assert use_engine_process(False, "cuda") is False
    assert use_engine_process(True, "cpu") is True


def test_the_argv_for_each_choice_parses_back_to_it() -> None:
    for flag in (None, True, False):
        argv = ["serve", *engine_process_argv(flag)]
        assert build_parser().parse_args(argv).engine_process is flag
