"""Tokenizer: text <-> token ids, chat templates and streaming detokenization for one model dir.

Wraps an HF `tokenizer.json` (the `tokenizers` library does the work) plus the facts that live
in the other HF files: which ids end generation, which id is the BOS, the chat template; or the
same built from a GGUF file's metadata (model/gguf_tokenizer.py).
Chat templates are rendered the way HF transformers renders them (model/chat_template.py), so
a prompt built here tokenizes to the same ids as HF's.

Ids the tokenizer does not know (a model's embedding may be larger than its tokenizer) decode
to nothing, as in HF; `token_to_str` returns "" for them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from pdserve.model.byte_level import CHAR_TO_BYTE
from pdserve.model.chat_template import (
    NO_TEMPLATE_SUPPORT,
    continue_final,
    render_chat,
    template_support,
)
from pdserve.model.chat_template import ChatTemplateSupport as ChatTemplateSupport  # re-exported
from pdserve.model.gguf_file import find_gguf, open_gguf
from pdserve.model.gguf_tokenizer import gguf_tokenizer
from pdserve.model.packaged import packaged_chat_template

# Bytes of an unfinished UTF-8 character decode to this; it means "wait for more tokens".
REPLACEMENT_CHAR = "\ufffd"


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """Encode, decode and chat-format for one model; immutable after construction."""

    def __init__(
        self,
        backend: HFTokenizer,
        eos_token_ids: frozenset[int],
        bos_token_id: int | None,
        special_tokens: dict[str, str],
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: frozenset[int] = eos_token_ids
        self.bos_token_id: int | None = bos_token_id
        # Token strings by role ("bos_token", "eos_token", ...), as chat templates see them.
        self._special_tokens = dict(special_tokens)
        self._chat_template = chat_template
        # The most characters one token can stand for: a piece's length bounds its text (a
        # byte-level piece has a character per byte, a SentencePiece one a character per
        # character, a byte-fallback "<0xNN>" stands for one byte). So a text longer than
        # max_model_len x this cannot fit the context, unless the normalizer deletes
        # characters (frontend/api.py refuses it untokenized: LESSONS #19).
        self.max_token_chars: int = max(
            (len(piece) for piece in backend.get_vocab(with_added_tokens=True)), default=1
        )
        # The special tokens: what decode(skip_special_tokens=True) leaves out.
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Read tokenizer.json (required) and tokenizer_config.json, generation_config.json,
        config.json and chat_template.jinja (optional) from an HF model directory; or build the
        tokenizer a GGUF file describes (model/gguf_tokenizer.py), given the file or a
        directory holding it."""
        path = Path(path)
        gguf = find_gguf(path)
        if gguf is not None:
            parts = gguf_tokenizer(open_gguf(gguf))
            template = packaged_chat_template(gguf)  # a built-in's own (model/packaged.py)
            return cls(*parts._replace(chat_template=template or parts.chat_template))
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(
                f"{tokenizer_file} is missing: pdserve needs a fast (tokenizer.json) tokenizer"
            )
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise ValueError(f"{tokenizer_file} could not be loaded: {e}") from e
        tok_cfg = _read_json(path / "tokenizer_config.json")
        gen_cfg = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        special_tokens: dict[str, str] = {}
        for role in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(tok_cfg.get(role))
            if content is not None:
                special_tokens[role] = content

        def token_id(content: str, where: str) -> int:
            tid = backend.token_to_id(content)
            if tid is None:
                raise ValueError(f"{path}: {where} {content!r} is not in {tokenizer_file.name}")
            return tid

        eos_ids = _id_set(gen_cfg.get("eos_token_id"))
        if not eos_ids:
            eos_ids = _id_set(model_cfg.get("eos_token_id"))
        if not eos_ids and "eos_token" in special_tokens:
            eos_ids = frozenset(
                {token_id(special_tokens["eos_token"], "tokenizer_config eos_token")}
            )
        bos = special_tokens.get("bos_token")
        bos_id = token_id(bos, "tokenizer_config bos_token") if bos is not None else None
        return cls(backend, eos_ids, bos_id, special_tokens, _chat_template(path, tok_cfg))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the post-processor adds (a BOS).

        Through `encode_batch`, which releases the GIL while it works (`encode` holds it): the
        front ends tokenise on worker threads, and a huge prompt must not freeze the event
        loop (an 8 MB prompt held /health for 12.9 s through `encode`, 1.1 s through this)."""
        batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for: a byte-level BPE token's bytes, a `<0xNN>` byte
        token's byte, else its text in UTF-8. A token holding part of a multi-byte character
        decodes to U+FFFD; its bytes say which part."""
        text = self._backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self._backend.id_to_token(token_id) or ""
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        if piece and all(ch in CHAR_TO_BYTE for ch in piece):
            return bytes(CHAR_TO_BYTE[ch] for ch in piece)
        return text.encode()

    def to_json(self) -> str:
        """The tokenizers library's JSON form of the vocabulary and pipeline (what a grammar
        engine builds its token table from: engine/sampling/grammars.py)."""
        return self._backend.to_str()

    def token_to_str(self, token_id: int) -> str:
        """One token's text for display (logprobs); a partial UTF-8 character shows as U+FFFD."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        """The id of the one token spelled `text` (an added token's content, or a vocabulary
        piece), or None."""
        return self._backend.token_to_id(text)

    def token_piece(self, token_id: int) -> str:
        """One token as the vocabulary spells it ("Ġworld", "<0xE3>"): HF's
        convert_ids_to_tokens; "" for an id the tokenizer does not know."""
        return self._backend.id_to_token(token_id) or ""

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        """The model's chat template's source, if it has one."""
        return self._chat_template

    @property
    def template_variables(self) -> dict[str, Any]:
        """What every chat template sees besides the messages: the special tokens' strings,
        and no tools or documents."""
        return {"tools": None, "documents": None, **self._special_tokens}

    @property
    def chat_template_support(self) -> ChatTemplateSupport:
        """Whether the template renders tool messages, a tool list and tool calls (all False
        without a template). ValueError if the template does not parse."""
        if self._chat_template is None:
            return NO_TEMPLATE_SUPPORT
        return template_support(self._chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, like HF's
        apply_chat_template(..., tokenize=False); `continue_final_message` leaves the last
        message open (model/chat_template.py `continue_final`).

        Raises ValueError if the model has no template or the template rejects the input.
        """
        if self._chat_template is None:
            raise ValueError(
                "this model has no chat template; send a plain prompt instead of messages"
            )
        variables = {**self.template_variables, **kwargs}
        text = render_chat(self._chat_template, messages, add_generation_prompt, variables)
        return continue_final(text, messages) if continue_final_message else text

    def incremental(
        self, skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()
    ) -> IncrementalDetokenizer:
        """A streaming detokenizer; `keep`: special tokens shown even when skipping the others
        (a tool-call format's markers, which its parser must see)."""
        return IncrementalDetokenizer(self, skip_special_tokens, keep)


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time.

    Invariant: `text` + flush() equals tokenizer.decode(all pushed ids). `_ids` holds only a
    short window: `_ids[:_read]` are tokens already emitted, kept as context, and
    `_ids[_read:]` are pending. Each push decodes the window and emits what it adds to the
    context's text. The context matters because some decoders render a token differently at
    the start of a sequence (SentencePiece drops a leading space). Text ending in U+FFFD is an
    unfinished multi-byte character and is held back; the window therefore always starts on a
    character boundary: where an earlier push emitted.

    Fewer decodes: the context's text is the window's text of the last emit, kept, so the
    context grows with each emit until it passes WINDOW tokens; then it restarts at the last
    emit's tokens (a boundary), whose text costs one more decode. The router detokenises every
    streamed token (two decodes a token were a large share of its Python time), and a decode's
    cost grows with its length, so a short window costs less a token than either restarting at
    every emit or a long window (benchmarks/RESULTS.md, 2026-12-06, moved from code comments).
    """

    WINDOW = 4

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ) -> None:
        self._tokenizer = tokenizer
        # Skipping all special tokens but `keep`: the others are dropped as they come and the
        # rest decode with them kept, which is what the skip does (it drops them before the
        # decoder runs).
        self._drop = tokenizer.special_ids - keep if skip_special_tokens and keep else frozenset()
        self._skip_special = skip_special_tokens and not keep
        self._ids: list[int] = []
        self._read = 0
        self._context_text = ""  # decode(self._ids[: self._read])
        self._pieces: list[str] = []

    def push(self, token_id: int) -> str:
        """Append one generated token; return the text that became final (maybe "")."""
        if token_id in self._drop:
            return ""
        self._ids.append(token_id)
        window_text = self._decode(self._ids)
        context_text = self._context_text
        if len(window_text) <= len(context_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text[len(context_text) :], window_text)

    def flush(self) -> str:
        """Return whatever is still held back (an unfinished character decodes as U+FFFD)."""
        window_text = self._decode(self._ids)
        rest = window_text[len(self._context_text) :]
        return self._emit(rest, window_text) if rest else ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def _emit(self, new_text: str, window_text: str) -> str:
        if len(self._ids) <= self.WINDOW:  # the whole window becomes the context
            self._context_text = window_text
        else:  # restart at the tokens just emitted: a character boundary
            del self._ids[: self._read]
            self._context_text = self._decode(self._ids)
        self._read = len(self._ids)
        self._pieces.append(new_text)
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config writes a special token as a string or as {"content": ..., ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_set(value: Any) -> frozenset[int]:
    if isinstance(value, int):
        return frozenset({value})
    if isinstance(value, list):
        return frozenset(v for v in value if isinstance(v, int))
    return frozenset()


def _chat_template(path: Path, tok_cfg: dict[str, Any]) -> str | None:
    # Newer HF exports keep the template in its own file; it wins over the config entry.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        # A list of named templates: the one named "default" serves plain chat.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
