"""Tool calls out of generated text: one parser per format the served families write.

    parser = choose(args.tool_call_parser, tokenizer_template)()   # a fresh one per choice
    for piece in pieces:
        for delta in parser.feed(piece): ...      # ContentDelta | CallStart | ArgumentsDelta
    for delta in parser.finish(): ...
    Hermes.parse(text)  # -> Parsed(content, calls): the same machine, the whole text at once

call.py (the calls and deltas), json_scan.py (JSON checked a character at a time),
envelope.py ({"name", "arguments"} objects), stream.py (the machine every format shares),
one module per format, chooser.py (by name or from the chat template), grammar.py (the
grammar that forces calls in a format: tool_choice "required" or a named function).
"""

from pdserve.frontend.tool_calls.call import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Delta,
    Malformed,
    Parsed,
    ToolCall,
    assemble,
    new_call_id,
    openai_delta,
)
from pdserve.frontend.tool_calls.chooser import AUTO, PARSERS, choose, detect, parser_named
from pdserve.frontend.tool_calls.deepseek_v3 import DeepSeekV3
from pdserve.frontend.tool_calls.hermes import Hermes
from pdserve.frontend.tool_calls.llama3_json import Llama3Json
from pdserve.frontend.tool_calls.mistral import Mistral
from pdserve.frontend.tool_calls.stream import StreamParser

__all__ = [
    "AUTO",
    "PARSERS",
    "ArgumentsDelta",
    "CallStart",
    "ContentDelta",
    "DeepSeekV3",
    "Delta",
    "Hermes",
    "Llama3Json",
    "Malformed",
    "Mistral",
    "Parsed",
    "StreamParser",
    "ToolCall",
    "assemble",
    "choose",
    "detect",
    "new_call_id",
    "openai_delta",
    "parser_named",
]
