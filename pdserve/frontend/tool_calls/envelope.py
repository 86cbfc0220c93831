"""Tool calls written as JSON envelopes, read a character at a time.

Hermes/Qwen, Llama 3 and Mistral (before its v11 tokenizer) write each call as an object
`{"name": NAME, "arguments": {...}}` (Llama says "parameters"), alone or in a list of them.
`EnvelopeReader` takes the characters of one such object or list and tells a `CallSink`
what it finds, as soon as it can: a call begins at its `{`, its name once the string has
closed, its arguments character by character from their `{` to their `}` (the model's text,
never re-serialised), its end at the envelope's `}`. Other keys are read and ignored, and may
come in any order (the sink holds arguments that arrive before the name).

Anything else raises `Malformed`: invalid JSON (json_scan.py), a name that is not a string,
arguments that are not an object, a name or arguments given twice, a list holding anything
but objects, an empty list.
"""

from __future__ import annotations

import json
from typing import Protocol

from pdserve.frontend.tool_calls.call import Malformed
from pdserve.frontend.tool_calls.json_scan import JsonScanner, Kind

ARGUMENT_KEYS = frozenset({"arguments", "parameters"})
_VALUE_STARTS = frozenset({Kind.STRING, Kind.OPEN, Kind.SCALAR})


class CallSink(Protocol):
    """Who hears of the calls a reader finds (the stream parser, stream.py)."""

    def begin_call(self) -> None: ...

    def call_name(self, name: str) -> None: ...

    def call_args(self, text: str) -> None: ...

    def end_call(self) -> None: ...


class EnvelopeReader:
    def __init__(self, sink: CallSink) -> None:
        self._sink = sink
        self._json = JsonScanner()
        self._base: int | None = None  # the envelopes' level: 0 alone, 1 inside a list
        self._calls = 0
        self._key_raw: list[str] = []  # the key being read, as written
        self._key: str | None = None  # the key whose value comes next
        self._seen: set[str] = set()  # "name" and "arguments" once each per envelope
        self._name_raw: list[str] | None = None  # the name's string being read
        self._in_args = False

    @property
    def done(self) -> bool:
        """The object, or the list, is complete."""
        return self._json.done

    def feed(self, c: str) -> None:
        """One character; Malformed when it cannot be part of the calls."""
        kind, level = self._json.feed(c)
        if self._base is None:
            if kind is Kind.OPEN:  # the scanner takes nothing else at the top
                self._base = 0 if c == "{" else 1
                if self._base == 0:
                    self._begin()
            return
        inner = self._base + 1  # the level of an envelope's keys and values
        if self._in_args:
            self._sink.call_args(c)
            self._in_args = not (kind is Kind.CLOSE and level == inner)
        elif self._name_raw is not None:
            self._name_raw.append(c)
            if not self._json.in_string:
                self._sink.call_name(json.loads("".join(self._name_raw)))
                self._name_raw = None
        elif kind is Kind.KEY and level == inner:
            self._key_raw.append(c)
            if not self._json.in_string:
                self._key = json.loads("".join(self._key_raw))
                self._key_raw = []
        elif kind in _VALUE_STARTS and level == inner and self._key is not None:
            self._value_starts(c, kind)
        elif level == self._base and kind is Kind.CLOSE:
            self._sink.end_call()
            self._calls += 1
        elif level == 1 and self._base == 1 and kind in _VALUE_STARTS:
            if c != "{":
                raise Malformed("a list of tool calls holds only objects")
            self._begin()
        elif level == 0 and kind is Kind.CLOSE and self._calls == 0:
            raise Malformed("an empty list of tool calls")

    def _begin(self) -> None:
        self._seen.clear()
        self._key = None
        self._sink.begin_call()

    def _value_starts(self, c: str, kind: Kind) -> None:
        key, self._key = self._key, None
        role = "name" if key == "name" else "arguments" if key in ARGUMENT_KEYS else None
        if role is None:
            return  # another key's value: read, and ignored
        if role in self._seen:
            raise Malformed(f"a tool call with two {role}")
        self._seen.add(role)
        if role == "name":
            if kind is not Kind.STRING:
                raise Malformed("a tool call's name is not a string")
            self._name_raw = [c]
        else:
            if c != "{":
                raise Malformed(f"a tool call's {key} are not an object")
            self._in_args = True
            self._sink.call_args(c)
