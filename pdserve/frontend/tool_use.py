"""How a chat request's tool calls are made: which parser reads them, the grammar that forces
them, and the special tokens the detokenizer must keep for the parser.

- **The parser** is `--tool-call-parser`'s (frontend/tool_calls/chooser.py), or with `auto`
  the one whose markers the chat template that renders the request holds (the client's own,
  else the model's). A request that asks for calls (tools, and tool_choice other than "none")
  with no parser known is a 400 naming the flag.
- **"required" and a named function** constrain the output (an AskedConstraint, built into
  SamplingParams.constraint off the event loop as any other: frontend/constraint_threads.py;
  a Lark grammar: frontend/tool_calls/grammar.py) to one or more calls (one for a name, or
  without `parallel_tool_calls`) to the allowed functions, in the parser's own format, each
  call's arguments valid against the function's `parameters` schema; the parser then reads it
  as any output. A request with an output constraint of its own besides is a 400, as is a
  schema the grammar engine cannot compile (naming `tools`).
- **Markers** the model writes as special tokens (Mistral's `[TOOL_CALLS]`, Llama 3's
  `<|python_tag|>`) are kept in the text the parser reads even when the client's
  `skip_special_tokens` drops the others: the parser consumes them, so the content shown
  holds none (but for a call that does not parse, whose text is content as written).

`ToolCalling` is the front end's (one per server, from its config); `plan` runs per request.
What the answer looks like is frontend/tool_answer.py's. Raises InvalidParams; I/O-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.frontend.structured import AskedConstraint
from pdserve.frontend.tool_calls import AUTO, PARSERS, StreamParser, detect, parser_named
from pdserve.frontend.tool_calls.grammar import Markers, calls_grammar
from pdserve.frontend.tools import ChoiceKind, ToolRequest
from pdserve.protocol.constraint import ConstraintKind
from pdserve.protocol.sampling import InvalidParams

FLAG = "--tool-call-parser"


@dataclass(frozen=True)
class ToolUse:
    """One request's tool calling: what reads its output, and what the detokenizer keeps."""

    request: ToolRequest
    parser: type[StreamParser]
    keep: frozenset[int]  # special tokens the parser reads (detokenized whatever the client skips)

    @property
    def parallel(self) -> bool:
        """More than one call per choice may be answered."""
        return self.request.parallel and self.request.choice is not ChoiceKind.NAMED


class ToolCalling:
    """The front end's tool calling: the configured parser (or auto) over one tokenizer."""

    def __init__(self, tokenizer: Any, parser: str = AUTO) -> None:
        """`parser`: a parser's name, or AUTO; ValueError for an unknown name."""
        self.tok = tokenizer
        self.configured = None if parser == AUTO else parser_named(parser)

    def plan(
        self, request: ToolRequest, template: str | None, constraint: AskedConstraint | None
    ) -> tuple[ToolUse | None, AskedConstraint | None]:
        """The request's tool use (None when nothing is parsed) and its output constraint:
        `constraint` (the request's own), or calls where the choice forces them. `template`:
        the client's chat template, None for the model's."""
        if not request.parses:
            return None, constraint
        parser = self.configured or detect(template or getattr(self.tok, "chat_template", None))
        if parser is None:
            known = ", ".join(sorted(PARSERS))
            raise InvalidParams(
                f"'{request.field}': no tool call parser is known for this model's chat "
                f"template (it shows no tool call format); start the server with {FLAG} NAME "
                f"({known}) to parse this model's tool calls",
                request.field,
            )
        markers = self._markers(parser)
        use = ToolUse(request, parser, frozenset(markers.special.values()))
        if request.forced:
            constraint = self._constraint(use, markers, constraint)
        return use, constraint

    def _markers(self, parser: type[StreamParser]) -> Markers:
        special: dict[str, int] = {}
        tokens: set[str] = set()
        for marker in parser.markers:
            token = self.tok.token_id(marker)
            if token is None:
                continue
            tokens.add(marker)
            if token in self.tok.special_ids:
                special[marker] = token
        return Markers(special, frozenset(tokens))

    def _constraint(
        self, use: ToolUse, markers: Markers, own: AskedConstraint | None
    ) -> AskedConstraint:
        request = use.request
        if own is not None:
            raise InvalidParams(
                f"'tool_choice' {_shown(request)} constrains the output to tool calls; the "
                "request's own output constraint (response_format, structured_outputs or "
                "guided_*) cannot apply besides",
                "tool_choice",
            )
        grammar = calls_grammar(use.parser, request.forced, use.parallel, markers)
        why = "the functions' parameters cannot constrain the calls: "
        return AskedConstraint("tools", ConstraintKind.GRAMMAR, grammar, why)


def _shown(request: ToolRequest) -> str:
    if request.choice is ChoiceKind.NAMED:
        return f"naming {request.named!r}"
    return repr(request.choice.value)
