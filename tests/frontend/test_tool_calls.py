"""frontend/tool_calls/: each format parsed whole and streamed, split at every character.

The property every case checks: the deltas of any split of an output into pieces add up to
the whole-text parse (content, and each call's name and arguments, the arguments being the
model's own JSON text), and they come in OpenAI's order (a call's first delta, then its
argument fragments). Cases where the parse finds calls check them exactly; malformed calls are
content, never an exception.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable

import pytest

from pdserve.frontend.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    DeepSeekV3,
    Delta,
    Hermes,
    Llama3Json,
    Mistral,
    Parsed,
    StreamParser,
    ToolCall,
    assemble,
    new_call_id,
    openai_delta,
)

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"  # DeepSeek's
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
WEATHER = '{"city": "Paris", "units": ["C", "F"], "days": 3}'
TRICKY = '{"q": "a } ] \\" </tool_call> [TOOL_CALLS] ``` é😀", "n": [-2.5e-3, {"k": null}, true]}'


def ids() -> Callable[[], str]:
    """Call ids id0, id1, ... (one sequence per parser, so two runs can be compared)."""
    count = itertools.count()
    return lambda: f"id{next(count)}"


def calls(*pairs: tuple[str, str]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(f"id{i}", name, args) for i, (name, args) in enumerate(pairs))


def ds3(name: str, args: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


# (parser, output, content, calls): well-formed outputs, and malformed ones whose call never
# started (so that streaming, too, finds them to be content).
CASES: list[tuple[type[StreamParser], str, str, tuple[ToolCall, ...]]] = [
    # Hermes / Qwen
    (
        Hermes,
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
        "</tool_call>",
        "Let me check.\n",
        calls(("get_weather", WEATHER)),
    ),
    (
        Hermes,
        f'<tool_call>\n{{"name": "a", "arguments": {TRICKY}}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {}, "name": "b", "id": 7}\n</tool_call>\n',
        "",
        calls(("a", TRICKY), ("b", "{}")),
    ),
    (
        Hermes,  # SmolLM2's larger models: a list in one block
        '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "parameters": {}}]'
        "</tool_call>",
        "",
        calls(("a", '{"x": 1}'), ("b", "{}")),
    ),
    (
        Hermes,  # two envelopes in one block; a function without arguments
        '<tool_call>{"name": "now"}\n{"name": "b", "arguments": {"y": 2}}</tool_call>',
        "",
        calls(("now", "{}"), ("b", '{"y": 2}')),
    ),
    (
        Hermes,  # the output ends before the closing tag
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_',
        "",
        calls(("a", '{"x": 1}')),
    ),
    (
        Hermes,
        'A <tool_call>{"name": "a", "arguments": {}}</tool_call> B '
        '<tool_call>{"name": "b", "arguments": {}}</tool_call> C',
        "A  B  C",
        calls(("a", "{}"), ("b", "{}")),
    ),
    (Hermes, 'No call: <tool and </tool_call> and {"name": "x"}.', "", ()),
    (Hermes, "  \n", "  \n", ()),
    (Hermes, "<tool_call>not json</tool_call> after", "", ()),
    (Hermes, '<tool_call>{"name": 5, "arguments": {}}</tool_call>', "", ()),
    (Hermes, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", ()),
    (Hermes, '<tool_call>{"arguments": {"a": 1}}</tool_call>', "", ()),
    (Hermes, '<tool_call>{"name": "f", "name": "g"}</tool_call>', "", ()),
    (Hermes, "<tool_call>[]</tool_call>", "", ()),
    (
        Hermes,  # a malformed block is content; the next one is read again
        '<tool_call>{bad}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
        "<tool_call>{bad}</tool_call>\n",
        calls(("g", "{}")),
    ),
    # Llama 3
    (
        Llama3Json,
        f'{{"name": "get_weather", "parameters": {WEATHER}}}',
        "",
        calls(("get_weather", WEATHER)),
    ),
    (
        Llama3Json,
        f'<|python_tag|>{{"name": "a", "parameters": {TRICKY}}}; '
        '{"name": "b", "arguments": {"y": [1, 2]}}',
        "",
        calls(("a", TRICKY), ("b", '{"y": [1, 2]}')),
    ),
    (
        Llama3Json,
        ' \n[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"k": "v"}}] ',
        "",
        calls(("a", "{}"), ("b", '{"k": "v"}')),
    ),
    (
        Llama3Json,
        'Checking.<|python_tag|>{"name": "a", "parameters": {}}',
        "Checking.",
        calls(("a", "{}")),
    ),
    (
        Llama3Json,
        '{"type": "function", "name": "a", "parameters": {"x": 1}}\nDone.',
        "\nDone.",
        calls(("a", '{"x": 1}')),
    ),
    (Llama3Json, 'The answer is {"name": "x", "parameters": {}} maybe', "", ()),
    (Llama3Json, '{"city": "Paris", "temp": 21}', "", ()),  # JSON, but no call
    (Llama3Json, '<|python_tag|>brave_search.call(query="x")', "", ()),
    # Mistral
    (
        Mistral,
        f'Sure.[TOOL_CALLS][{{"name": "a", "arguments": {WEATHER}}}, '
        '{"name": "b", "arguments": {}}]',
        "Sure.",
        calls(("a", WEATHER), ("b", "{}")),
    ),
    (
        Mistral,
        f"[TOOL_CALLS]get_weather[ARGS]{TRICKY}[TOOL_CALLS]b[ARGS]{{}}",
        "",
        calls(("get_weather", TRICKY), ("b", "{}")),
    ),
    (
        Mistral,
        '[TOOL_CALLS]a{"x": "y"} [TOOL_CALLS] {"name": "b", "arguments": {"z": 0}}',
        "",
        calls(("a", '{"x": "y"}'), ("b", '{"z": 0}')),
    ),
    (Mistral, "Text [TOOL text [ARGS]", "", ()),
    (Mistral, "[TOOL_CALLS]not a call", "", ()),
    # DeepSeek-V3
    (
        DeepSeekV3,
        f"Hi{B}{ds3('get_weather', WEATHER)}\n{ds3('f2', '{}')}{E}",
        "Hi",
        calls(("get_weather", WEATHER), ("f2", "{}")),
    ),
    (
        DeepSeekV3,
        f"{B}{ds3('a', TRICKY)}{E} and after",
        " and after",
        calls(("a", TRICKY)),
    ),
    (
        DeepSeekV3,  # V3.1's form
        f'{B}{CB}get_weather{SEP}{WEATHER}{CE}{CB}b{SEP}{{"x": 1}}{CE}{E}',
        "",
        calls(("get_weather", WEATHER), ("b", '{"x": 1}')),
    ),
    (
        DeepSeekV3,  # the output ends before the block's end marker
        f"{B}{ds3('a', '{}')}\n<｜tool▁calls",
        "",
        calls(("a", "{}")),
    ),
    (DeepSeekV3, "No calls <｜tool here.", "", ()),
    (DeepSeekV3, f"{B}{CB}function{SEP}bad name\n```json\n{{}}\n```{CE}{E} x", "", ()),
    (DeepSeekV3, f"{B}{CB}function{SEP}a\n```python\n{{}}\n```{CE}{E}", "", ()),
    (DeepSeekV3, f"{B}{E}", "", ()),
]
for i, (_cls, _text, _content, _calls) in enumerate(CASES):
    if not _calls and not _content:  # no call: the whole output is content
        CASES[i] = (_cls, _text, _text, _calls)


def stream(cls: type[StreamParser], pieces: list[str]) -> list[Delta]:
    p = cls(ids())
    out: list[Delta] = []
    for piece in pieces:
        out += p.feed(piece)
    return out + p.finish()


def check_order(deltas: list[Delta]) -> None:
    """OpenAI's order: calls start as 0, 1, ...; a call's fragments follow its start, before
    the next one starts; no empty delta."""
    started = -1
    for d in deltas:
        if isinstance(d, CallStart):
            assert d.index == started + 1, deltas
            started = d.index
        elif isinstance(d, ArgumentsDelta):
            assert d.index == started and d.text, deltas
        else:
            assert d.text, deltas


def case_id(case: tuple[type[StreamParser], str, str, tuple[ToolCall, ...]]) -> str:
    return f"{case[0].name}:{case[1][:40]}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_whole_and_split_at_every_character(
    case: tuple[type[StreamParser], str, str, tuple[ToolCall, ...]],
) -> None:
    cls, text, content, expected = case
    whole = cls.parse(text, ids())
    assert whole == Parsed(content, expected)
    for call in whole.calls:
        assert isinstance(json.loads(call.arguments), dict)
    for i in range(len(text) + 1):
        deltas = stream(cls, [text[:i], text[i:]])
        check_order(deltas)
        assert assemble(deltas) == whole, i
    deltas = stream(cls, list(text))
    check_order(deltas)
    assert assemble(deltas) == whole
    rng = random.Random(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
        assert assemble(stream(cls, pieces)) == whole, pieces


@pytest.mark.parametrize(
    ("cls", "text"),
    [
        (Hermes, 'Hi <tool_call>{"name": "f", "arguments": {"a": }}</tool_call> there'),
        (Hermes, 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}'),  # cut short
        (Hermes, '<tool_call>{"name": "f", "arguments": {}} extra</tool_call>'),
        (Llama3Json, '{"name": "f", "parameters": {"a": 1,}}'),
        (Llama3Json, '{"name": "f", "parameters": {"a": 1}} {"name": 3}'),
        (Mistral, '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1}}]'),
        (Mistral, '[TOOL_CALLS]f[ARGS]{"a": "b"'),
        (Mistral, '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, 5]'),
        (Mistral, "[TOOL_CALLS]f[ARG"),
        (DeepSeekV3, f'x{B}{CB}function{SEP}f\n```json\n{{"a": tru}}\n```{CE}{E}'),
        (DeepSeekV3, f'{B}{ds3("f", "{}")}\n{CB}function{SEP}g\n```json\n{{"a":'),
    ],
)
def test_a_malformed_call_parsed_whole_is_content(cls: type[StreamParser], text: str) -> None:
    assert cls.parse(text) == Parsed(text, ())


def test_a_streamed_call_that_breaks_after_it_started_ends_where_it_stands() -> None:
    """stream.py: a call that has left cannot be taken back; the rest of its block is
    content."""
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": }}</tool_call> there'
    deltas = stream(Hermes, list(text))
    check_order(deltas)
    assert assemble(deltas) == Parsed("Hi }}</tool_call> there", (ToolCall("id0", "f", '{"a": '),))
    # The same failure within one piece never left: all of it is content.
    assert assemble(stream(Hermes, [text])) == Parsed(text, ())


def test_a_call_starts_once_its_name_is_known_and_its_arguments_begin() -> None:
    p = Hermes(ids())
    assert p.feed('Hi <tool_call>{"name": "get_weather"') == [ContentDelta("Hi ")]
    assert p.feed(', "arguments": ') == []
    assert p.feed('{"city"') == [
        CallStart(0, "id0", "get_weather"),
        ArgumentsDelta(0, '{"city"'),
    ]
    assert p.feed(': "Paris"}') == [ArgumentsDelta(0, ': "Paris"}')]
    assert p.feed("}\n</tool_call>") == []
    assert p.finish() == []


def test_what_might_begin_a_marker_is_held_until_it_cannot() -> None:
    p = Hermes(ids())
    assert p.feed("a <tool") == [ContentDelta("a ")]
    assert p.feed("s and <") == [ContentDelta("<tools and ")]
    assert p.finish() == [ContentDelta("<")]
    d = DeepSeekV3(ids())
    assert d.feed("x<｜tool▁calls") == [ContentDelta("x")]
    assert d.finish() == [ContentDelta("<｜tool▁calls")]


def test_whitespace_beside_a_call_is_held_then_dropped() -> None:
    p = Llama3Json(ids())
    assert p.feed("\n ") == []
    assert p.feed('{"name": "f", "parameters": {}}') == [
        CallStart(0, "id0", "f"),
        ArgumentsDelta(0, "{}"),
    ]
    assert p.feed(" \n") == []
    assert p.finish() == []
    q = Llama3Json(ids())
    assert q.feed("\n ") == []
    assert q.feed("Hello") == [ContentDelta("\n Hello")]


def test_ids() -> None:
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())
    (call,) = Hermes.parse('<tool_call>{"name": "f"}</tool_call>').calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    first, second = Mistral.parse("[TOOL_CALLS]f{}[TOOL_CALLS]g{}").calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}", first.id) and first.id != second.id


def test_openai_deltas() -> None:
    assert openai_delta(ContentDelta("hi")) == {"content": "hi"}
    assert openai_delta(CallStart(1, "call_x", "f")) == {
        "tool_calls": [
            {
                "index": 1,
                "id": "call_x",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ]
    }
    assert openai_delta(ArgumentsDelta(1, '{"a"')) == {
        "tool_calls": [{"index": 1, "function": {"arguments": '{"a"'}}]
    }


def test_a_parser_is_not_fed_after_the_end() -> None:
    p = Hermes()
    p.finish()
    with pytest.raises(RuntimeError, match="fed after the output ended"):
        p.feed("x")


def well_formed(cls: type[StreamParser], rng: random.Random) -> str:
    """An output of `cls`'s format: text, and calls in its forms, at random."""
    args = [WEATHER, TRICKY, "{}", '{"a": [1, {"b": "c"}]}', '{\n  "x": "y"\n}']
    names = ["get_weather", "f", "search.web", "a_b-c"]

    def call() -> tuple[str, str]:
        return rng.choice(names), rng.choice(args)

    prose = rng.choice(["", "Sure. ", "Let me look that up.\n", "  ", "é😀 < [ { "])
    n = rng.randrange(1, 4)
    if cls is Hermes:
        blocks = [f'<tool_call>\n{{"name": "{a}", "arguments": {b}}}\n</tool_call>' for a, b in
                  (call() for _ in range(n))]  # fmt: skip
        return prose + "\n".join(blocks)
    if cls is Llama3Json:
        objs = [f'{{"name": "{a}", "parameters": {b}}}' for a, b in (call() for _ in range(n))]
        tag = "<|python_tag|>" if prose.strip() else rng.choice(["", "<|python_tag|>"])
        return prose + tag + "; ".join(objs)
    if cls is Mistral:
        if rng.random() < 0.5:
            objs = [f'{{"name": "{a}", "arguments": {b}}}' for a, b in (call() for _ in range(n))]
            return prose + "[TOOL_CALLS][" + ", ".join(objs) + "]"
        return prose + "".join(f"[TOOL_CALLS]{a}[ARGS]{b}" for a, b in (call() for _ in range(n)))
    return prose + B + "\n".join(ds3(*call()) for _ in range(n)) + E


@pytest.mark.parametrize("cls", [Hermes, Llama3Json, Mistral, DeepSeekV3], ids=lambda c: c.name)
def test_random_outputs_stream_as_they_parse(cls: type[StreamParser]) -> None:
    rng = random.Random(cls.name)
    for _ in range(150):
        text = well_formed(cls, rng)
        whole = cls.parse(text, ids())
        assert whole.calls, text
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randrange(1, 12)))
        pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
        deltas = stream(cls, pieces)
        check_order(deltas)
        assert assemble(deltas) == whole, pieces


@pytest.mark.parametrize("cls", [Hermes, Llama3Json, Mistral, DeepSeekV3], ids=lambda c: c.name)
def test_garbage_never_raises_and_without_calls_is_all_content(cls: type[StreamParser]) -> None:
    rng = random.Random("garbage" + cls.name)
    alphabet = ['{"name": "f", ', '"arguments": ', "{", "}", "[", "]", '"', ":", ",", " ", "\n",
                "<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "f",
                B, E, CB, CE, SEP, "function", "```json\n", "```", "1", "x", ";"]  # fmt: skip
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(30)))
        whole = cls.parse(text)
        if not whole.calls:
            assert whole.content == text
        for call in whole.calls:
            assert isinstance(json.loads(call.arguments), dict)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 5)))
        pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
        check_order(stream(cls, pieces))
