"""`pdserve`'s command line: one parser, one subcommand per tool, and `main`.

Every parser here is a `Parser`: its --help ends each option's line with the default (unless
the line already says it, or the option is a switch), and a usage error is one line on stderr
and exit status 2, never a traceback. `--log-level` is accepted before and after the
subcommand; the later one wins.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, NoReturn

from pdserve.bench.cli import add_bench_command
from pdserve.chaos.cli import add_chaos_command
from pdserve.config import (
    BACKENDS,
    ServerConfig,
)
from pdserve.doctor.cli import add_doctor_command
from pdserve.engine_flags import add_engine_args, engine_config, use_engine_process
from pdserve.launch import add_launch_command
from pdserve.router.cli import (
    add_chat_args,
    add_front_end_args,
    add_http_args,
    add_router_command,
    add_unknown_fields_arg,
    frontend_config,
    http_limits,
)
from pdserve.runtime import evloop, logs

DESCRIPTION = """\
pdserve: an OpenAI-compatible LLM server, co-located or with prefill and decode on
separate workers (disaggregated), with the tools to measure and check it.

  pdserve serve --model builtin:tiny                           one co-located server
  pdserve launch --model builtin:tiny --prefill 1 --decode 1   a PD cluster on this machine
  pdserve bench --url http://127.0.0.1:8000                    load-test any OpenAI server
  pdserve doctor --url http://127.0.0.1:8000                   healthy? if not, why not

`pdserve COMMAND --help` lists a command's options with their defaults."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
STATES_DEFAULT = re.compile(r"\(default\b")  # a help line that says its default itself


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help line ends with its default, unless the line already states it,
    the option is a switch (off unless given) or it has no default (required, or None:
    then the line says what its absence means). A description's paragraphs are filled to
    the terminal; an indented one (examples) is kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for paragraph in text.split("\n\n"):
            if paragraph.startswith(" "):
                out.append(paragraph)
                continue
            words = " ".join(paragraph.split())
            out.append(textwrap.fill(words, width, initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            STATES_DEFAULT.search(text)
            or action.required
            or action.nargs == 0
            or action.default is None
            or action.default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """pdserve's parsers (subcommands inherit it): defaults in --help, one-line errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage first; for `serve` that is 20 lines above the
        # one that matters.
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def log_level(text: str) -> str:
    """A --log-level value: a level name in any case (WARN is WARNING)."""
    level = text.upper()
    level = "WARNING" if level == "WARN" else level
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a log level; use one of {', '.join(LOG_LEVELS)}"
        )
    return level


def add_log_level(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--log-level",
        type=log_level,
        default=default,
        metavar="LEVEL",
        help=f"{', '.join(LOG_LEVELS)}: for this process and every process it starts; "
        "accepted before or after the command (default: INFO)",
    )


def cmd_make_model(args: argparse.Namespace) -> int:
    from pdserve.model.builtin import make_model

    out = make_model(args.name, Path(args.out))
    print(f"wrote {args.name} to {out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.frontend.fields import reject_unknown_fields
    from pdserve.runtime.gpus import pin_to_device
    from pdserve.server.auth import load_api_key
    from pdserve.transfer.receiver import resolve_backend
    from pdserve.worker.server import run_server

    try:  # before CUDA starts here: the process sees only the GPU it was given
        args.device = pin_to_device(args.device, os.environ)
    except ValueError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    engine = engine_config(args)
    # The decode side picks the data plane (P follows its Register): only D is refused here.
    backend, why = resolve_backend(args.backend, engine.model.device, args.role != "colocated")
    if why is not None and args.role == "decode":
        print(f"pdserve serve: {why}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        role=args.role,
        control_port=args.control_port,
        backend=backend,
        debug_faults=args.debug_faults,
        cluster_key_file=args.cluster_key_file,
        api_key=load_api_key(args.api_key, args.api_key_file),
        protect_health=args.protect_health,
        max_queue=args.max_queue,
        http=http_limits(args),
        drain_timeout_s=args.drain_timeout,
        frontend=frontend_config(args),
        engine_process=use_engine_process(args.engine_process, engine.model.device),
    )
    from pdserve.transfer.nixl import BackendUnavailable

    reject_unknown_fields(args.reject_unknown_fields)
    try:
        return run_server(cfg)
    except BackendUnavailable as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2


def cmd_keygen(args: argparse.Namespace) -> int:
    from pdserve.runtime.cluster_key import ClusterKey, generate

    if args.token_of:  # for curl: -H "Authorization: Bearer $(pdserve keygen --token-of F)"
        print(ClusterKey.load(args.token_of).http_token)
        return 0
    try:
        generate(args.out)
    except FileExistsError:
        print(f"pdserve keygen: {args.out} exists; not overwriting a key", file=sys.stderr)
        return 2
    print(f"wrote a new cluster key to {args.out} (mode 600); give it to every worker and router")
    return 0


def add_key_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster-key-file",
        default=None,
        metavar="FILE",
        help="the cluster's shared secret (default: $PDSERVE_CLUSTER_KEY_FILE); "
        "prefill and decode workers need it",
    )


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pdserve", description=DESCRIPTION)
    add_log_level(p, "INFO")
    sub = p.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")

    mk = sub.add_parser(
        "make-model",
        help="write a built-in model as an HF directory",
        description="Write a built-in model (deterministic generated weights and tokenizer) "
        "as a Hugging Face model directory that transformers loads as it is.",
    )
    mk.add_argument(
        "name",
        help="tiny | qwen2-tiny | qwen3-tiny | qwen2-0.5b-shape | llama3.2-1b-shape | "
        "deepseek-v3-tiny | deepseek-v32-tiny | deepseek-v4-tiny | deepseek-v3-fp8-tiny",
    )
    mk.add_argument("--out", required=True, help="output directory")
    mk.set_defaults(func=cmd_make_model)

    kg = sub.add_parser(
        "keygen",
        help="write a new cluster key (for workers started by hand)",
        description="Write a new cluster key, or print the HTTP token of one. `pdserve "
        "launch` makes its own; workers started by hand share one made here.",
    )
    what = kg.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="the key file to create (mode 600)")
    what.add_argument(
        "--token-of", metavar="FILE", help="print the HTTP bearer token of an existing key file"
    )
    kg.set_defaults(func=cmd_keygen)

    sv = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        description="Serve a model over the OpenAI API (co-located), or run one prefill "
        "or decode worker of a disaggregated cluster behind `pdserve router` (--role).",
    )
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sv.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    sv.add_argument(
        "--role",
        default="colocated",
        choices=["colocated", "prefill", "decode"],
        help="colocated: the OpenAI API here; prefill/decode: a worker behind `pdserve router`",
    )
    sv.add_argument(
        "--control-port",
        type=int,
        default=0,
        help="prefill role: ZMQ control port (0 picks a free one)",
    )
    sv.add_argument(
        "--backend",
        default="auto",
        choices=("auto", *BACKENDS),
        help="KV transfer data plane for prefill/decode roles (auto: shm on CPU, nixl on a "
        "GPU, tcp without NIXL; nixl: pip install 'pdserve[nixl]')",
    )
    sv.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    sv.add_argument(
        "--debug-faults",
        action="store_true",
        help="let POST /debug/faults set fault points at run time (tests and chaos only)",
    )
    add_key_arg(sv)
    add_front_end_args(sv)
    add_unknown_fields_arg(sv)
    add_chat_args(sv)
    add_http_args(sv)
    add_engine_args(sv)
    sv.set_defaults(func=cmd_serve)
    add_router_command(sub)
    add_launch_command(sub)
    add_bench_command(sub)
    add_chaos_command(sub)
    add_doctor_command(sub)
    for command in sub.choices.values():  # SUPPRESS: absent after it, the one before stands
        add_log_level(command, argparse.SUPPRESS)
    return p


def raise_fd_limit(want: int = 65536) -> None:
    """Let a server hold many connections: the soft descriptor limit up to the hard one (a
    flood of connections then meets --max-queue and timeouts, not EMFILE in accept)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: router/pool.py's
    logs.setup(args.log_level)
    if args.command in ("serve", "router", "launch"):
        raise_fd_limit()
    try:
        evloop.chosen()  # a bad PDSERVE_EVENT_LOOP stops here, not after a model loads
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
