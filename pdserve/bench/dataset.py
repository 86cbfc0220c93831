"""The requests a run sends: random lengths, a ShareGPT file, or shared-prefix groups.

Prompt lengths are in the server's tokens. Token-id prompts (for /v1/completions) are exact:
the server counts what it is sent. Text prompts are only near their target: with a tokenizer
(`--tokenizer`) they are re-encoded and trimmed until the count matches (a merge across a
boundary can still move it by a token or two); without one, a prompt of N tokens is N common
English words, which many BPE vocabularies encode as about one token each. Every prompt is a
pure function of the seed, so two runs with one seed send the same requests.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.config import DatasetConfig

# Without a tokenizer, token ids are drawn from this range: inside every common vocabulary
# (pdserve's built-in models have 4096 ids) and past the low ids where specials usually sit.
DEFAULT_ID_RANGE = (100, 4000)
# ShareGPT filter (the usual one): drop tiny turns and over-long conversations.
SHAREGPT_MIN_LEN = 4
FIT_ROUNDS = 8  # text prompts: decode/encode rounds to hit the target length
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048
_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | tuple[int, ...]
    prompt_len: int  # the intended (ids, tokenizer) or estimated (words, chars/4) token count
    output_len: int
    group: int | None = None  # shared-prefix: which system prompt it shares


class PromptMaker:
    """Random prompts of a given token length, as ids or text."""

    def __init__(self, rng: np.random.Generator, fmt: str, tokenizer: Any | None) -> None:
        self.rng, self.fmt, self.tok = rng, fmt, tokenizer
        if tokenizer is not None:
            special = set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
            ids = [i for i in range(tokenizer.vocab_size) if i not in special]
            if fmt == "text":
                # Only ids that are whole characters: a lone byte of a multi-byte character
                # decodes to U+FFFD, which encodes back as several tokens.
                ids = [i for i in ids if _clean(tokenizer.decode([i]))]
            self.ids = np.array(ids)
        else:
            self.ids = np.arange(*DEFAULT_ID_RANGE)

    def random_ids(self, n: int) -> list[int]:
        return [int(i) for i in self.rng.choice(self.ids, size=n)]

    def make(self, n: int) -> str | tuple[int, ...]:
        if self.fmt == "ids":
            return tuple(self.random_ids(n))
        if self.tok is None:
            return " ".join(self.rng.choice(_WORDS, size=n))
        return self._fit_text(self.random_ids(n), n)

    def _fit_text(self, ids: list[int], n: int) -> str:
        assert self.tok is not None  # make() calls this only with a tokenizer
        # Decoding random ids and encoding the text again rarely gives back the same count
        # (new merges, split bytes). Each round restarts from the tokenizer's own reading of
        # the text, which is stable under decode/encode except at the cut, and trims or
        # extends it by the difference.
        text = self.tok.decode(ids)
        for _ in range(FIT_ROUNDS):
            got = len(self.tok.encode(text))
            if got == n:
                break
            ids = self.tok.encode(text, add_special_tokens=False)
            ids = ids[: max(1, len(ids) - (got - n))] if got > n else ids + self.random_ids(n - got)
            text = self.tok.decode(ids)
        return text

    def count(self, text: str) -> int:
        """Tokens in `text`: exact with a tokenizer, else the chars/4 rule of thumb."""
        return len(self.tok.encode(text)) if self.tok is not None else max(1, len(text) // 4)


def _clean(text: str) -> bool:
    return bool(text.strip()) and "\ufffd" not in text


def load_tokenizer(spec: str) -> Any:
    """builtin:NAME or a model directory -> pdserve's Tokenizer (imported only when asked)."""
    from pdserve.model.builtin import resolve_model
    from pdserve.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model(spec))


def make_requests(cfg: DatasetConfig, tokenizer: Any | None = None) -> list[BenchRequest]:
    rng = np.random.default_rng(cfg.seed)
    maker = PromptMaker(rng, cfg.prompt_format, tokenizer)
    if cfg.name == "random":
        return random_requests(cfg, maker)
    if cfg.name == "sharegpt":
        return sharegpt_requests(cfg, maker)
    return shared_prefix_requests(cfg, maker)


def _lengths(rng: np.random.Generator, target: int, ratio: float, n: int) -> list[int]:
    low, high = max(1, math.floor(target * (1 - ratio))), max(1, math.ceil(target * (1 + ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_requests(cfg: DatasetConfig, maker: PromptMaker) -> list[BenchRequest]:
    ins = _lengths(maker.rng, cfg.input_len, cfg.range_ratio, cfg.num_prompts)
    outs = _lengths(maker.rng, cfg.output_len, cfg.range_ratio, cfg.num_prompts)
    return [BenchRequest(maker.make(i), i, o) for i, o in zip(ins, outs, strict=True)]


def shared_prefix_requests(cfg: DatasetConfig, maker: PromptMaker) -> list[BenchRequest]:
    groups = math.ceil(cfg.num_prompts / cfg.sp_prompts_per_group)
    systems = [maker.make(cfg.sp_system_len) for _ in range(groups)]
    out = []
    for k in range(cfg.num_prompts):
        g = k % groups
        system, question = systems[g], maker.make(cfg.sp_question_len)
        prompt: str | tuple[int, ...]
        if isinstance(system, tuple) and isinstance(question, tuple):
            prompt = system + question
        else:
            prompt = f"{system}\n\n{question}"
        n = cfg.sp_system_len + cfg.sp_question_len
        out.append(BenchRequest(prompt, n, cfg.output_len, group=g))
    # Interleave the groups so that a prefix cache has to keep several prefixes alive.
    order = maker.rng.permutation(len(out))
    return [out[i] for i in order]


def sharegpt_requests(cfg: DatasetConfig, maker: PromptMaker) -> list[BenchRequest]:
    assert cfg.path is not None  # checked by DatasetConfig
    try:
        data = json.loads(Path(cfg.path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset-path {cfg.path}: cannot read a JSON file: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"{cfg.path}: a ShareGPT file is a JSON list of conversations")
    pairs = [p for p in (_first_exchange(entry) for entry in data) if p is not None]
    order = maker.rng.permutation(len(pairs))
    out: list[BenchRequest] = []
    for i in order:
        prompt, answer = pairs[i]
        n_in = maker.count(prompt)
        n_out = cfg.sharegpt_output_len or maker.count(answer)
        if n_in < SHAREGPT_MIN_LEN or n_out < SHAREGPT_MIN_LEN:
            continue
        if n_in > SHAREGPT_MAX_PROMPT or n_in + n_out > SHAREGPT_MAX_TOTAL:
            continue
        body: str | tuple[int, ...] = prompt
        if cfg.prompt_format == "ids":
            if maker.tok is None:
                raise ValueError(
                    "ShareGPT as token ids needs --tokenizer (or --prompt-format text)"
                )
            body = tuple(maker.tok.encode(prompt))
        out.append(BenchRequest(body, n_in, n_out))
        if len(out) == cfg.num_prompts:
            break
    if not out:
        raise ValueError(f"{cfg.path}: no conversation passed the length filter")
    # Fewer usable conversations than --num-prompts: go round them again.
    return [out[k % len(out)] for k in range(cfg.num_prompts)]


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    """The first (user turn, answer) of one ShareGPT conversation, or None if it has none."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations") or entry.get("conversation")
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return None
    for ask, answer in zip(turns, turns[1:], strict=False):
        prompt, reply = ask.get("value"), answer.get("value")
        is_ask = ask.get("from") in ("human", "user") and isinstance(prompt, str)
        if is_ask and prompt and isinstance(reply, str):
            return prompt, reply
    return None
