"""GPT-2's byte-level alphabet: the printable character that stands for each byte in a
byte-level BPE vocabulary (`Ġ` for a space). The printable Latin-1 bytes stand for themselves,
the other 68 take the code points from 256 on, in byte order."""

from __future__ import annotations

_PRINTABLE = frozenset(
    [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
)


def _alphabet() -> tuple[str, ...]:
    chars, extra = [], 0
    for b in range(256):
        if b in _PRINTABLE:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return tuple(chars)


BYTE_TO_CHAR: tuple[str, ...] = _alphabet()  # index: the byte
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def spell(text: str) -> str:
    """`text`'s UTF-8 bytes in the alphabet: how a byte-level vocabulary writes it."""
    return "".join(BYTE_TO_CHAR[b] for b in text.encode("utf-8"))
