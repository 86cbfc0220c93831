"""The fuzzer's hostile requests below the JSON: content codings, Authorization bytes, sizes.

Each is a value or a body that chaos/fuzz_cases.py puts into a case, with the statuses a
server may answer it with: the codings a server inflates are served as the plain body would
be; a broken compressed stream is a 400, a bomb (a small body that inflates past any body
limit) a 413, a coding the server does not take a 415; an Authorization header that is not
UTF-8 is merely wrong (401 where a key is configured, ignored where none is); a prompt of
one word of megabytes is refused for its length (400).
"""

from __future__ import annotations

import functools
import gzip
import json
import zlib

# Authorization values a client can send, each wrong for any key: bytes that are not UTF-8
# (sent as latin-1 by Send.RAW), text that is, no token, another scheme, an odd shape.
ODD_AUTH = [
    "Bearer \xff\xfe",
    "Bearer \x80abc",
    "Bearer caf\xe9",  # a lone 0xE9: not UTF-8
    "Bearer caf\xc3\xa9",  # "café" in UTF-8
    "Bearer \xed\xa0\x80",  # an encoded surrogate: not UTF-8 either
    "Bearer",
    "Bearer ",
    "bearer sk-0123456789",
    "Basic Zm9vOmJhcg==",
    "Bearer a b c",
    "Bearer " + "k" * 4000,
]
AUTH_CALLS = [  # where an Authorization header is checked, with or without a key configured
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/debug/cluster"),
    ("GET", "/debug/state"),
    ("GET", "/info"),
    ("GET", "/health"),
]
HUGE_WORD_BYTES = 3 * 2**20  # one "word" of a prompt: refused for its length (400)
BOMB_BYTES = 80 * 2**20  # what a bomb inflates to: past any server's body limit


@functools.cache
def bomb(coding: str) -> bytes:
    """A body of ~80 KB that inflates to BOMB_BYTES of valid JSON (so only a bound refuses it);
    built once per process."""
    plain = b'{"prompt": "' + b"a" * BOMB_BYTES + b'", "max_tokens": 1}'
    return gzip.compress(plain, 9, mtime=0) if coding == "gzip" else zlib.compress(plain, 9)


@functools.cache
def huge_word_body(model: str) -> bytes:
    """A completion whose prompt is one word of HUGE_WORD_BYTES; built once per process."""
    return json.dumps({"model": model, "prompt": "a" * HUGE_WORD_BYTES, "max_tokens": 1}).encode()


def encodings(plain: bytes) -> list[tuple[str, str, bytes, frozenset[int]]]:
    """(kind, Content-Encoding, body, statuses) for a valid JSON body `plain`: the codings a
    server inflates (served as the plain body would be: empty statuses), and bodies it must
    refuse: broken streams 400, bombs 413, codings it does not take 415."""
    gz, zl = gzip.compress(plain, mtime=0), zlib.compress(plain)
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw_deflated = raw_deflate.compress(plain) + raw_deflate.flush()
    bad, too_big, unsupported = frozenset({400}), frozenset({413}), frozenset({415})
    return [
        ("gzip", "gzip", gz, frozenset()),
        (
            "gzip_two_members",
            "gzip",
            gzip.compress(plain[:5], mtime=0) + gzip.compress(plain[5:], mtime=0),
            frozenset(),
        ),
        ("deflate", "deflate", zl, frozenset()),
        ("raw_deflate", "deflate", raw_deflated, frozenset()),
        ("identity", "identity", plain, frozenset()),
        ("bad_gzip", "gzip", b"\x1f\x8b\x08\x00" + b"garbage" * 4, bad),
        ("not_gzip", "gzip", plain, bad),
        ("cut_gzip", "gzip", gz[: len(gz) // 2], bad),
        ("gzip_then_junk", "gzip", gz + b"junk", bad),
        ("deflate_then_junk", "deflate", zl + b"junk", bad),
        ("empty_gzip", "gzip", b"", bad),
        ("gzip_bomb", "gzip", bomb("gzip"), too_big),
        ("deflate_bomb", "deflate", bomb("deflate"), too_big),
        ("br", "br", plain, unsupported),
        ("zstd", "zstd", plain, unsupported),
        ("gzip_twice", "gzip, gzip", gzip.compress(gz, mtime=0), unsupported),
    ]
