"""Every command's --help: a line of help and the default for every option.

The parser walk checks each option of each subcommand (so a new flag without help or without
a stated default fails here); the subprocess runs check what a user actually sees.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.cli import DESCRIPTION, build_parser

COMMANDS = ("make-model", "keygen", "serve", "router", "launch", "bench", "chaos", "doctor")


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    assert tuple(sub.choices) == COMMANDS  # a new command is added to COMMANDS too
    return [("pdserve", top), *((f"pdserve {n}", p) for n, p in sub.choices.items())]


def one_of_a_required_group(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    return any(g.required and action in g._group_actions for g in parser._mutually_exclusive_groups)


def test_every_option_has_help_and_states_its_default() -> None:
    missing: list[str] = []
    for name, parser in parsers():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            line = formatter._get_help_string(action) or ""
            if not action.help:
                missing.append(f"{flag}: no help")
            needs_default = not (
                action.required or action.nargs == 0 or one_of_a_required_group(parser, action)
            )
            if needs_default and "(default" not in line:
                missing.append(f"{flag}: no default in {line!r}")
    assert not missing, "\n".join(missing)


def test_log_level_is_accepted_after_every_command() -> None:
    top = build_parser()
    args = top.parse_args(["doctor", "--file", "x.json", "--log-level", "debug"])
    assert args.log_level == "DEBUG"
    args = top.parse_args(["--log-level", "error", "doctor", "--file", "x.json"])
    assert args.log_level == "ERROR"  # not overwritten by the command's own (absent) flag
    args = top.parse_args(["--log-level", "error", "doctor", "--file", "x", "--log-level", "warn"])
    assert args.log_level == "WARNING"  # the later one wins; WARN is WARNING
    assert top.parse_args(["doctor", "--file", "x.json"]).log_level == "INFO"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=60
    )


@pytest.mark.process
def test_top_level_help_is_current() -> None:
    done = run("--help")
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # argparse fills paragraphs to the terminal's width
    assert " ".join(DESCRIPTION.split("\n\n")[0].split()) in out
    assert "arrive with" not in done.stdout
    for command in COMMANDS:
        assert f"\n    {command} " in done.stdout, command
    assert "--log-level LEVEL" in done.stdout and "(default: INFO)" in done.stdout


@pytest.mark.process
@pytest.mark.parametrize(
    "command, shown",
    [
        ("serve", ("--host HOST           address to listen on (default: 127.0.0.1)",)),
        ("bench", ("(default: 0.0)", "--max-failure-rate")),
        ("doctor", ("exit status", "(default: 15.0)")),
        ("router", ("(default: least-outstanding)",)),
    ],
)
def test_command_help_shows_defaults(command: str, shown: tuple[str, ...]) -> None:
    done = run(command, "--help")
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # argparse fills lines to the terminal's width
    for text in shown:
        assert " ".join(text.split()) in out, (text, done.stdout)
    assert "--log-level LEVEL" in done.stdout
