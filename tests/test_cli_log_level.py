"""`--log-level` as a user types it: before or after the command, any case, and a bad level
is one line on stderr with exit status 2 (no traceback, nothing started)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

LEVELS = "DEBUG, INFO, WARNING, ERROR, CRITICAL"
NO_MODEL_WARNING = "WARNING pdserve.bench.runner: no model name"


def pdserve(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=60
    )


def bench_nowhere(*level: str, after: bool) -> str:
    """stderr of a one-request bench against a port where nothing listens: its runner logs
    a WARNING that it got no model name; `level` goes before or after `bench`."""
    with socket.socket() as s:  # bound, not listening: refused, and nobody else takes it
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        argv = ["bench", "--url", url, "--num-prompts", "1", "--warmup", "0", "--no-progress"]
        argv += ["--max-failure-rate", "1"]
        done = pdserve(*argv, *level) if after else pdserve(*level, *argv)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_log_level_takes_effect_before_and_after_the_command() -> None:
    assert NO_MODEL_WARNING in bench_nowhere(after=True)  # the default, INFO, shows it
    assert NO_MODEL_WARNING not in bench_nowhere("--log-level", "error", after=True)
    assert NO_MODEL_WARNING not in bench_nowhere("--log-level", "ERROR", after=False)


@pytest.mark.process
@pytest.mark.parametrize(
    "argv, prog",
    [
        (["serve", "--log-level", "loud"], "pdserve serve"),
        (["--log-level", "loud", "serve"], "pdserve"),
        (["doctor", "--file", "x.json", "--log-level", "loud"], "pdserve doctor"),
    ],
)
def test_a_bad_level_is_one_line_and_exit_2(argv: list[str], prog: str) -> None:
    done = pdserve(*argv)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"{prog}: error: argument --log-level: 'loud' is not a log level; use one of {LEVELS} "
        f"(see: {prog} --help)"
    ]
