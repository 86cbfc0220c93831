"""The tokenizer a GGUF file describes (its `tokenizer.ggml.*` metadata), built for `tokenizers`.

A GGUF carries no tokenizer.json. llama.cpp stores the vocabulary (`tokens`, in id order), each
token's type (`token_type`: TokenType), the BPE `merges`, the special ids, whether to add a BOS
or EOS, the name of the pre-tokenizer the vocabulary was learned with (`pre`) and the chat
template (`tokenizer.chat_template`). From them we build the tokenizer llama.cpp runs for the
file, whose ids are HF transformers' for it (AutoTokenizer.from_pretrained(dir, gguf_file=...)):
  * byte-level BPE (`tokenizer.ggml.model` "gpt2": SmolLM, Qwen2, Llama 3): the file's vocabulary
    and merges; a token not written in the byte alphabet (an added token stored as raw text) is
    respelled in it, as HF does;
  * control tokens (<|im_start|>) are special added tokens: matched whole in the text, skipped
    by decode(skip_special_tokens=True); user-defined ones are plain added tokens;
  * text is split by llama.cpp's expressions for `pre` (PRE_TOKENIZERS), then byte-mapped.
Refused, naming what is unsupported: SentencePiece vocabularies (`tokenizer.ggml.model` "llama":
Llama 2, Mistral 7B v0.1, TinyLlama), other models, and `pre` names not in PRE_TOKENIZERS.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from pdserve.model.byte_level import CHAR_TO_BYTE, spell
from pdserve.model.corpus import QWEN2_SPLIT_PATTERN
from pdserve.model.errors import ModelConfigError
from pdserve.model.gguf_file import GGUFFile

# Llama 3's split ("llama-bpe"): Qwen2's, but numbers in runs of up to three digits.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenType(IntEnum):
    """llama.cpp's `tokenizer.ggml.token_type` values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def _gpt2() -> list[pre_tokenizers.PreTokenizer]:
    # ByteLevel's own expression is GPT-2's, the one llama.cpp runs for these names.
    return [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]


def _split(pattern: str) -> list[pre_tokenizers.PreTokenizer]:
    return [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]


# `tokenizer.ggml.pre` -> the pre-tokenizer llama.cpp runs for it (llama-vocab.cpp's regexes).
PRE_TOKENIZERS = {
    "gpt-2": _gpt2,
    "smollm": lambda: [pre_tokenizers.Digits(individual_digits=True), *_gpt2()],
    "qwen2": lambda: _split(QWEN2_SPLIT_PATTERN),
    "deepseek-r1-qwen": lambda: _split(QWEN2_SPLIT_PATTERN),
    "llama-bpe": lambda: _split(LLAMA3_SPLIT_PATTERN),
    "llama3": lambda: _split(LLAMA3_SPLIT_PATTERN),
    "llama-v3": lambda: _split(LLAMA3_SPLIT_PATTERN),
}
# Pre-tokenizers whose vocabularies take a word that is one token whole, merges or not
# (llama.cpp's ignore_merges; Llama 3's tokenizer.json says the same).
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3"}
# Ids that end generation besides the EOS: end of turn, end of message (Llama 3's <|eot_id|>).
_END_IDS = ("eos_token_id", "eot_token_id", "eom_token_id")


class TokenizerParts(NamedTuple):
    """What model/tokenizer.py's Tokenizer is made of (its constructor's arguments)."""

    backend: HFTokenizer
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    special_tokens: dict[str, str]  # "bos_token" -> "<|im_start|>", ... (for chat templates)
    chat_template: str | None


def gguf_tokenizer(file: GGUFFile) -> TokenizerParts:
    """The tokenizer `file` describes; ModelConfigError naming what is unsupported."""
    where = f"{file.path}: tokenizer.ggml"
    model = file.get("tokenizer.ggml.model")
    if model != "gpt2":
        what = "SentencePiece ('llama')" if model == "llama" else repr(model)
        raise ModelConfigError(
            f"{where}.model is {what}; pdserve builds byte-level BPE ('gpt2') tokenizers from "
            "GGUF files only (serve the model's HF directory instead)"
        )
    pre = file.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelConfigError(
            f"{where}.pre {pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = file.require("tokenizer.ggml.tokens")
    types: list[int] = file.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    merges: list[str] = file.require("tokenizer.ggml.merges")
    if len(types) != len(tokens):
        raise ModelConfigError(f"{where}: {len(tokens)} tokens but {len(types)} token types")

    in_alphabet = [all(c in CHAR_TO_BYTE for c in t) for t in tokens]
    vocab = {
        (t if ok else spell(t)): i
        for i, (t, ok) in enumerate(zip(tokens, in_alphabet, strict=True))
    }
    pairs = [_merge(m, where) for m in merges]
    bpe = models.BPE(vocab, pairs, byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES)
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[pre]())
    backend.decoder = decoders.ByteLevel()
    # Only tokens spelled in the alphabet: HF leaves a respelled one a plain vocabulary entry.
    whole = [(t, k) for t, k, ok in zip(tokens, types, in_alphabet, strict=True) if ok]
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in whole if k == TokenType.CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False) for t, k in whole if k == TokenType.USER_DEFINED]
    )

    keys = (*_END_IDS, "bos_token_id", "unknown_token_id", "padding_token_id")
    ids: dict[str, int] = {}  # the special ids the file names
    for key in keys:
        tid = file.get(f"tokenizer.ggml.{key}")
        if tid is None:
            continue
        if not 0 <= tid < len(tokens):
            raise ModelConfigError(f"{where}.{key} {tid} is not in the {len(tokens)}-token vocab")
        ids[key] = int(tid)
    bos, eos = ids.get("bos_token_id"), ids.get("eos_token_id")
    backend.post_processor = _post_processor(file, tokens, bos, eos)
    roles = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "unk_token": "unknown_token_id",
        "pad_token": "padding_token_id",
    }
    special = {role: tokens[ids[key]] for role, key in roles.items() if key in ids}
    template = file.get("tokenizer.chat_template")
    return TokenizerParts(
        backend,
        frozenset(ids[k] for k in _END_IDS if k in ids),
        bos,
        special,
        template if isinstance(template, str) else None,
    )


def _merge(line: str, where: str) -> tuple[str, str]:
    left, sep, right = line.partition(" ")
    if not sep or not left or not right or " " in right:
        raise ModelConfigError(f"{where}.merges: {line!r} is not two tokens")
    return left, right


def _post_processor(file: GGUFFile, tokens: list[str], bos: int | None, eos: int | None) -> Any:
    """A BOS and/or an EOS around each sequence where the file asks for them (llama.cpp's
    add_bos_token / add_eos_token). Absent, llama.cpp's defaults: a BOS for Llama 3's
    pre-tokenizers, nothing else for a byte-level vocabulary."""
    pre = file.get("tokenizer.ggml.pre", "")
    default = {"add_bos_token": pre in _IGNORE_MERGES, "add_eos_token": False}
    ends = [
        (tid, where)
        for tid, key, where in ((bos, "add_bos_token", "head"), (eos, "add_eos_token", "tail"))
        if tid is not None and file.get(f"tokenizer.ggml.{key}", default[key])
    ]
    if not ends:
        return processors.ByteLevel(trim_offsets=False)

    def around(seq: str, type_id: int) -> str:
        head = [f"{tokens[t]}:{type_id}" for t, where in ends if where == "head"]
        tail = [f"{tokens[t]}:{type_id}" for t, where in ends if where == "tail"]
        return " ".join([*head, f"${seq}:{type_id}", *tail])

    return processors.TemplateProcessing(
        single=around("A", 0),
        pair=f"{around('A', 0)} {around('B', 1)}",
        special_tokens=sorted({(tokens[t], t) for t, _ in ends}),
    )
