"""frontend/tool_calls/json_scan.py and envelope.py: JSON checked a character at a time agrees
with json.loads, and envelopes tell their calls as soon as each part is known."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.frontend.tool_calls.call import Malformed
from pdserve.frontend.tool_calls.envelope import EnvelopeReader
from pdserve.frontend.tool_calls.json_scan import JsonError, JsonScanner, Kind

VALID = [
    "{}",
    "[]",
    ' { "a" : 1 } ',
    '{"a": [1, 2.5, -0.5e-3, 1E+10, 0, -0], "b": {"c": null}, "d": true, "e": false}',
    '[[], {}, [[]], "x", "", 0.0]',
    '{"s": "quote \\" slash \\\\ \\/ \\b\\f\\n\\r\\t \\u00e9\\uD83D\\uDE00 é 😀 } ] ,"}',
    '{"": ""}',
    '{"nested": {"deeper": {"deepest": [1, {"x": [true]}]}}}',
]
INVALID = [
    "",
    "{",
    "{]",
    "[}",
    '{"a"}',
    '{"a": }',
    '{"a": 1,}',
    "[1,]",
    "[1 2]",
    '{"a" 1}',
    "{a: 1}",
    "{'a': 1}",
    '{"a": 01}',
    '{"a": 1.}',
    '{"a": .5}',
    '{"a": -}',
    '{"a": 1e}',
    '{"a": +1}',
    '{"a": tru}',
    '{"a": True}',
    '{"a": nul}',
    '{"a": "\\x"}',
    '{"a": "\\u12G4"}',
    '{"a": "line\nbreak"}',
    '{"a": 1}}',
    '{"a": 1} x',
    "[1, 2] [3]",
    "{,}",
    '{"a": NaN}',
]


def scan(text: str) -> JsonScanner:
    """`text` fed a character at a time (JsonError where it stops being JSON)."""
    s = JsonScanner()
    for c in text:
        s.feed(c)
    return s


@pytest.mark.parametrize("text", VALID)
def test_valid_json_is_accepted_and_ends_on_its_last_bracket(text: str) -> None:
    body = text.strip()
    s = JsonScanner()
    for i, c in enumerate(body):
        assert not s.done
        s.feed(c)
        assert s.done == (i == len(body) - 1)
    assert json.loads(text) is not None


def strict_loads(text: str) -> object:
    """json.loads without Python's NaN and Infinity."""

    def refuse(name: str) -> object:
        raise ValueError(name)

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("text", INVALID)
def test_invalid_json_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        strict_loads(text)
    with pytest.raises(JsonError):  # a Malformed: the parsers catch it
        s = scan(text)
        if not s.done:
            raise JsonError("incomplete")


@pytest.mark.parametrize("text", ["1", '"s"', "null", " true"])
def test_a_scalar_at_the_top_is_json_but_no_call(text: str) -> None:
    strict_loads(text)
    with pytest.raises(JsonError, match="a tool call is an object or a list"):
        scan(text)


def test_it_agrees_with_json_loads_on_random_documents() -> None:
    rng = random.Random(7)

    def value(depth: int) -> object:
        kind = rng.randrange(7 if depth < 4 else 5)
        if kind == 0:
            return rng.choice([True, False, None])
        if kind == 1:
            return rng.choice([0, -1, 12345, 2.5, -1e-7, 1e300])
        if kind in (2, 3, 4):
            return "".join(rng.choice('ab"\\/\n\té😀 {}[],:') for _ in range(rng.randrange(6)))
        if kind == 5:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {str(value(depth + 1)): value(depth + 1) for _ in range(rng.randrange(4))}

    for _ in range(300):
        doc = {"k": value(0)} if rng.random() < 0.5 else [value(0)]
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        assert scan(text).done, text
        cut = rng.randrange(len(text))  # every proper prefix is incomplete, never refused
        assert not scan(text[:cut]).done


def accepts(text: str) -> bool:
    try:
        return scan(text).done
    except JsonError:
        return False


def test_it_agrees_with_json_loads_on_mutated_documents() -> None:
    rng = random.Random(11)
    base = [t.strip() for t in VALID]
    checked = 0
    for _ in range(3000):
        text = list(rng.choice(base))
        i = rng.randrange(len(text))
        op = rng.randrange(3)
        c = rng.choice('{}[]",:0123456789.eE+-tfnrul \\x\n')
        if op == 0:
            text.insert(i, c)
        elif op == 1:
            del text[i]
        else:
            text[i] = c
        doc = "".join(text)
        try:
            loaded = strict_loads(doc)
            expected = isinstance(loaded, (dict, list)) and doc == doc.strip()
        except ValueError:
            expected = False
        if doc != doc.strip():
            continue  # surrounding whitespace: the parsers skip it before the scanner
        assert accepts(doc) == expected, doc
        checked += 1
    assert checked > 2500


def test_each_character_has_its_kind_and_level() -> None:
    s = JsonScanner()
    got = [s.feed(c) for c in '{"a": [1, "x"]}']
    o, c, k, st, sc = Kind.OPEN, Kind.CLOSE, Kind.KEY, Kind.STRING, Kind.SCALAR
    assert got == [
        (o, 0), (k, 1), (k, 1), (k, 1), (Kind.COLON, 1), (Kind.SPACE, 1), (o, 1), (sc, 2),
        (Kind.COMMA, 2), (Kind.SPACE, 2), (st, 2), (st, 2), (st, 2), (c, 1), (c, 0),
    ]  # fmt: skip
    with pytest.raises(JsonError, match="the value is complete"):
        s.feed(" ")


def test_the_error_names_the_character() -> None:
    with pytest.raises(JsonError, match=r"invalid JSON at character 7 \('}'\): expected a value"):
        scan('{"a": }')


class Sink:
    """Records what a reader tells, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def begin_call(self) -> None:
        self.events.append(("begin",))

    def call_name(self, name: str) -> None:
        self.events.append(("name", name))

    def call_args(self, text: str) -> None:
        if self.events and self.events[-1][0] == "args":
            text = self.events.pop()[1] + text
        self.events.append(("args", text))

    def end_call(self) -> None:
        self.events.append(("end",))


def read(text: str) -> tuple[list[tuple[str, ...]], bool]:
    sink = Sink()
    r = EnvelopeReader(sink)
    for c in text:
        r.feed(c)
    return sink.events, r.done


def test_an_envelope_tells_its_parts_in_order() -> None:
    events, done = read('{"name": "f", "id": {"x": [1]}, "arguments": {"a": {"b": "}"}}}')
    assert done
    assert events == [("begin",), ("name", "f"), ("args", '{"a": {"b": "}"}}'), ("end",)]


def test_the_name_is_told_once_its_string_closes() -> None:
    sink = Sink()
    r = EnvelopeReader(sink)
    for c in '{"name": "ge\\u0074_weather':
        r.feed(c)
    assert sink.events == [("begin",)]
    r.feed('"')
    assert sink.events == [("begin",), ("name", "get_weather")]  # the escape decoded


def test_arguments_may_come_first_and_parameters_is_their_other_name() -> None:
    events, _ = read('{"parameters": {"a": 1}, "name": "f"}')
    assert events == [("begin",), ("args", '{"a": 1}'), ("name", "f"), ("end",)]


def test_a_list_of_envelopes() -> None:
    events, done = read('[{"name": "a", "arguments": {}}, {"name": "b"}]')
    assert done
    assert events == [
        ("begin",), ("name", "a"), ("args", "{}"), ("end",), ("begin",), ("name", "b"), ("end",),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"name": 5}', "name is not a string"),
        ('{"name": "f", "arguments": "{}"}', "arguments are not an object"),
        ('{"name": "f", "parameters": [1]}', "parameters are not an object"),
        ('{"name": "f", "name": "g"}', "two name"),
        ('{"arguments": {}, "parameters": {}}', "two arguments"),
        ("[]", "an empty list"),
        ('[{"name": "f"}, 5]', "holds only objects"),
        ('[{"name": "f"}, [{"name": "g"}]]', "holds only objects"),
        ('{"name": "f" "arguments": {}}', "invalid JSON"),
    ],
)
def test_what_is_not_a_call_is_malformed(text: str, why: str) -> None:
    with pytest.raises(Malformed, match=why):
        read(text)
