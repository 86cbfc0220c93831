"""A token's raw bytes, and logprob keys that tell apart tokens holding parts of a character."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.frontend.format import Formatter
from pdserve.model.tokenizer import Tokenizer


def partial_tokens(tok: Tokenizer) -> list[int]:
    return [i for i in range(tok.vocab_size) if "\ufffd" in tok.token_to_str(i)]


def test_a_texts_token_bytes_join_to_its_utf8(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    text = "héllo wörld ✓ 😀 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(i in set(partial_tokens(tok)) for i in ids)  # the emoji and CJK split mid-character
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_byte_tokens_get_distinct_bytes_keys(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    partial = partial_tokens(tok)
    assert len(partial) > 100
    fmt = SimpleNamespace(tok=tok)  # _key reads only the tokenizer
    keys = [Formatter._key(fmt, i) for i in partial]  # type: ignore[arg-type]
    assert len(set(keys)) == len(partial)  # they all decode to U+FFFD, yet no two keys collide
    assert all(k.startswith("bytes:\\x") for k in keys)
    a = tok.encode("a", add_special_tokens=False)[0]
    assert Formatter._key(fmt, a) == "a"  # type: ignore[arg-type]
