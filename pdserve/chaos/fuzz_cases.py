"""The fuzzer's cases: seeded, hostile and valid OpenAI requests, each with what it may get.

A case is one HTTP call (method, path, raw body bytes, headers) and an expectation:
* `VALID`: built only from values the API must accept (small max_tokens, short prompts, each
  parameter inside its documented range): it must answer 200 with a finished completion;
* `ANY`: a valid body with one field replaced by a hostile value, a field dropped or an
  unknown one added, a raw body that is not JSON or not UTF-8, deep nesting, a 5,000-digit
  number, a wrong method or path: it may be refused (4xx with an OpenAI-style JSON body) or,
  where the change happens to be harmless, served (200); never a 5xx, never a hang.
A case may also name the only statuses it may get (`statuses`: a bad gzip body 400, a deflate
bomb 413, a timeout of a millisecond 200 or 408), and how it is sent (`Send`): by aiohttp's
client; raw, with header bytes that client cannot write (an Authorization header that is not
UTF-8); or raw and then reset, with nothing to read back.
The same seed gives the same cases, so a failure can be replayed: `pdserve chaos --scenario
fuzz --seed S --requests N` (or tests/chaos/test_fuzz.py).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pdserve.chaos.fuzz_wire import AUTH_CALLS, ODD_AUTH, encodings, huge_word_body


class Expect(Enum):
    VALID = "valid"
    ANY = "any"  # 200 or 4xx; never 5xx


class Send(Enum):
    CLIENT = "client"  # aiohttp's client: header values go out as UTF-8
    RAW = "raw"  # http.client: header values go out as latin-1, so any byte can be sent
    RESET = "reset"  # written on a socket, then reset (RST) at once: no answer to check


@dataclass(frozen=True)
class Case:
    index: int
    kind: str  # what the generator did, for the report: "valid", "field:temperature", ...
    method: str
    path: str
    body: bytes
    expect: Expect
    stream: bool = False
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    statuses: frozenset[int] = frozenset()  # when given, the only statuses it may get
    send: Send = Send.CLIENT


WORDS = ["the", "cat", "def", "main", "(", ")", ":", "hello", "world", "é", "日本", "🙂", "\n"]

# Values that are wrong somewhere: types, ranges, sizes, the non-finite, the unprintable.
HOSTILE: list[Any] = [
    None,
    True,
    False,
    -1,
    0,
    1,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    1180591620717411303424,
    1e-40,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "x",
    "1",
    "🙂",
    "\ud800",  # a lone surrogate (json.dumps escapes it; the server must refuse it)
    "\x00",
    "a" * 5000,
    [],
    [1],
    [-1],
    [2**70],
    ["a", 1],
    [[]],
    {},
    {"a": 1},
    {"self": 1},
]

# A request's own timeout, seconds: it may beat them (200) or end by them (408), in any state
# of its life (waiting, prefilling on P, decoding); never a 5xx.
TINY_TIMEOUTS = [1e-9, 1e-6, 1e-4, 0.001, 0.003, 0.01, 0.03, 0.1]

FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "n",
    "logprobs",
    "top_logprobs",
    "echo",
    "stream",
    "stream_options",
    "timeout",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "chat_template_kwargs",
    "add_generation_prompt",
]

RAW_BODIES: list[bytes] = [
    b"",
    b"{",
    b"[",
    b"null",
    b"1e999999",
    b'"just a string"',
    b"[" * 5000 + b"]" * 5000,
    b'{"prompt": ' + b"[" * 200 + b"1" + b"]" * 200 + b"}",
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": "x", "max_tokens": NaN}',
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "\\ud800", "max_tokens": 2}',
    b'{"prompt": "\xff\xfe bad utf-8", "max_tokens": 2}',
    b'{"prompt": "x"' + b', "n": 16' * 50 + b"}",
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def valid_completion(rng: random.Random, model: str, vocab: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, 6)}
    if rng.random() < 0.7:
        body["prompt"] = _text(rng, rng.randint(1, 12))
    else:
        body["prompt"] = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
    _sampling(rng, body, vocab)
    if rng.random() < 0.2:
        body["echo"] = True
    if rng.random() < 0.2:
        body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.15:
        body["n"] = 2
    return body


def valid_chat(rng: random.Random, model: str, vocab: int) -> dict[str, Any]:
    turns = [{"role": "user", "content": _text(rng, rng.randint(1, 8))}]
    if rng.random() < 0.3:
        turns.insert(0, {"role": "system", "content": _text(rng, 4)})
    body: dict[str, Any] = {"model": model, "messages": turns, "max_tokens": rng.randint(1, 6)}
    _sampling(rng, body, vocab)
    if rng.random() < 0.2:
        body["logprobs"] = True
        body["top_logprobs"] = rng.randint(0, 3)
    return body


def _sampling(rng: random.Random, body: dict[str, Any], vocab: int) -> None:
    body["temperature"] = rng.choice([0, 0, 0.5, 1.0, 1.3])
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.5, 0.9, 1.0])
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([-1, 1, 5, 50])
    if rng.random() < 0.2:
        body["min_p"] = rng.choice([0.0, 0.05])
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.2:
        body["repetition_penalty"] = rng.choice([1.0, 1.1, 0.9])
    if rng.random() < 0.2:
        body["frequency_penalty"] = rng.choice([-0.5, 0.0, 0.5])
    if rng.random() < 0.2:
        body["stop"] = rng.choice(["\n", ["cat", "dog"], "the"])
    if rng.random() < 0.15:
        body["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.2:
        body["ignore_eos"] = rng.random() < 0.5
    if rng.random() < 0.2:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    # Every body bounds itself: a mutation that drops max_tokens from a chat asks, legally, for
    # the whole context; its own timeout then ends it (408), and the fuzz never waits on it.
    body["timeout"] = rng.choice([10, 20.0])


def _unstreamed(body: dict[str, Any]) -> dict[str, Any]:
    """The body answered in one piece, for a case whose answer is read whole."""
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


def _encode(body: Any) -> bytes:
    # allow_nan: NaN and Infinity literals are part of what a careless client sends.
    return json.dumps(body, allow_nan=True).encode()


def cases(seed: int, n: int, model: str, vocab: int) -> Iterator[Case]:
    """`n` cases for a server of `model` with `vocab` token ids; the same for the same seed."""
    rng = random.Random(seed)
    makers: list[tuple[float, Callable[[int], Case]]] = []

    def valid(i: int) -> Case:
        chat = rng.random() < 0.4
        body = valid_chat(rng, model, vocab) if chat else valid_completion(rng, model, vocab)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return Case(i, "valid", "POST", path, _encode(body), Expect.VALID, bool(body.get("stream")))

    def mutated(i: int) -> Case:
        chat = rng.random() < 0.4
        body = valid_chat(rng, model, vocab) if chat else valid_completion(rng, model, vocab)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        how = rng.random()
        if how < 0.75:
            name = rng.choice(FIELDS)
            body[name] = rng.choice(HOSTILE)
            kind = f"field:{name}"
        elif how < 0.85:
            name = rng.choice(sorted(body))
            del body[name]
            kind = f"drop:{name}"
        else:
            body[rng.choice(["foo", "__proto__", "best_of", "x" * 300])] = rng.choice(HOSTILE)
            kind = "unknown_field"
        return Case(i, kind, "POST", path, _encode(body), Expect.ANY, body.get("stream") is True)

    def raw(i: int) -> Case:
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        return Case(i, "raw_body", "POST", path, rng.choice(RAW_BODIES), Expect.ANY)

    def charset(i: int) -> Case:
        body = valid_completion(rng, model, vocab)
        headers = {"Content-Type": rng.choice(["application/json; charset=klingon", "text/plain"])}
        stream = bool(body.get("stream"))
        return Case(
            i, "content_type", "POST", "/v1/completions", _encode(body), Expect.ANY, stream, headers
        )

    def route(i: int) -> Case:
        method, path = rng.choice(
            [
                ("GET", "/v1/completions"),
                ("PUT", "/v1/chat/completions"),
                ("POST", "/v1/unknown"),
                ("GET", "/v1/models/" + "x" * 50),
                ("DELETE", "/v1/models"),
            ]
        )
        return Case(i, "route", method, path, b"", Expect.ANY)

    def encoded(i: int) -> Case:
        body = _unstreamed(valid_completion(rng, model, vocab))
        kind, coding, data, only = rng.choice(encodings(_encode(body)))
        headers = {"Content-Type": "application/json", "Content-Encoding": coding}
        expect = Expect.ANY if only else Expect.VALID
        path = "/v1/completions"
        return Case(i, f"encoding:{kind}", "POST", path, data, expect, False, headers, only)

    def auth(i: int) -> Case:
        method, path = rng.choice(AUTH_CALLS)
        body = _unstreamed(valid_completion(rng, model, vocab))
        data = _encode(body) if method == "POST" else b""
        headers = {"Content-Type": "application/json", "Authorization": rng.choice(ODD_AUTH)}
        only = frozenset({200, 401, 404})
        return Case(i, "auth", method, path, data, Expect.ANY, False, headers, only, Send.RAW)

    def tiny_timeout(i: int) -> Case:
        chat = rng.random() < 0.4
        body = valid_chat(rng, model, vocab) if chat else valid_completion(rng, model, vocab)
        body["timeout"] = rng.choice(TINY_TIMEOUTS)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        stream, only = bool(body.get("stream")), frozenset({200, 408})
        return Case(
            i, "tiny_timeout", "POST", path, _encode(body), Expect.ANY, stream, statuses=only
        )

    def huge_word(i: int) -> Case:
        body, only = huge_word_body(model), frozenset({400})
        return Case(i, "huge_word", "POST", "/v1/completions", body, Expect.ANY, statuses=only)

    def reset(i: int) -> Case:
        body = valid_completion(rng, model, vocab) | {"max_tokens": rng.choice([1, 50])}
        stream = bool(body.get("stream"))
        path = "/v1/completions"
        return Case(i, "reset", "POST", path, _encode(body), Expect.ANY, stream, send=Send.RESET)

    makers = [
        (0.27, valid),
        (0.45, mutated),
        (0.08, raw),
        (0.04, charset),
        (0.04, route),
        (0.04, encoded),
        (0.03, auth),
        (0.03, tiny_timeout),
        (0.004, huge_word),
        (0.02, reset),
    ]
    weights = [w for w, _ in makers]
    for i in range(n):
        (make,) = rng.choices([m for _, m in makers], weights)
        yield make(i)
