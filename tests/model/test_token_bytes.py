"""A token's raw bytes, and the key logprobs show a token by (frontend/format.py)."""

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


def test_logprob_keys_are_the_decoded_text_or_the_token_id(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    partial = partial_tokens(tok)
    assert len(partial) > 100
    fmt = SimpleNamespace(tok=tok, spec=SimpleNamespace(token_ids_as_text=False))
    keys = [Formatter._key(fmt, i) for i in partial]  # type: ignore[arg-type]
    # vLLM's: what the token decodes to, U+FFFD for the part of a character (chat's `bytes`
    # tell such tokens apart)
    assert keys == [tok.token_to_str(i) for i in partial] and all("\ufffd" in k for k in keys)
    assert len(set(keys)) < len(keys)
    a = tok.encode("a", add_special_tokens=False)[0]
    assert Formatter._key(fmt, a) == "a"  # type: ignore[arg-type]
    fmt.spec.token_ids_as_text = True  # return_tokens_as_token_ids
    assert Formatter._key(fmt, a) == f"token_id:{a}"  # type: ignore[arg-type]
