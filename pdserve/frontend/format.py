"""OpenAI response objects from a generation's deltas: a completion or a chat completion,
whole or as stream chunks, with usage and logprobs (echoed prompt tokens first, `text_offset`s
over the whole text)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pdserve.frontend.generation import Choice, Delta, Generation
from pdserve.frontend.protocol import GenerationSpec
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.outputs import TokenLogprob


class Formatter:
    """Turns deltas into OpenAI response objects (completion or chat, whole or chunked)."""

    def __init__(
        self,
        tok: Tokenizer,
        model_name: str,
        spec: GenerationSpec,
        gen: Generation,
        prompts: list[list[int]],
    ) -> None:
        self.tok, self.model_name, self.spec, self.gen = tok, model_name, spec, gen
        self.chat = spec.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + gen.id
        self.created = int(time.time())
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.texts = [""] * len(gen.choices)
        self.offsets = [0] * len(gen.choices)
        self.decode: Callable[[list[int]], str] = tok.decode
        if spec.echo:
            for c in gen.choices:
                self.texts[c.index] = self.decode(c.prompt_ids)
                self.offsets[c.index] = len(self.texts[c.index])  # a stream's offsets follow it

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }

    def usage(self) -> dict[str, int]:
        done = self.gen.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }

    def accumulate(self, d: Delta) -> None:
        self.texts[d.choice.index] += d.text

    def full_response(self) -> dict[str, Any]:
        choices = []
        for c in self.gen.choices:
            lp = None
            if self.spec.params.logprobs is not None:
                prompt, first = self._echoed(c)
                lp = self._logprobs(prompt + c.logprobs, 0, first)
            if self.chat:
                choices.append(
                    {
                        "index": c.index,
                        "finish_reason": c.finish_reason,
                        "logprobs": lp,
                        "message": {"role": "assistant", "content": self.texts[c.index]},
                    }
                )
            else:
                choices.append(
                    {
                        "index": c.index,
                        "finish_reason": c.finish_reason,
                        "logprobs": lp,
                        "text": self.texts[c.index],
                    }
                )
        return {**self._envelope(choices, chunk=False), "usage": self.usage()}

    def stream_start(self) -> list[dict[str, Any]]:
        if self.chat:
            return [
                self._envelope(
                    [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    chunk=True,
                )
                for c in self.gen.choices
            ]
        if self.spec.echo:
            return [
                self._envelope(
                    [
                        {
                            "index": c.index,
                            "text": self.texts[c.index],
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    chunk=True,
                )
                for c in self.gen.choices
            ]
        return []

    def stream_delta(self, d: Delta) -> dict[str, Any]:
        i = d.choice.index
        lp = None
        if self.spec.params.logprobs is not None and d.logprobs:
            lp = self._logprobs(list(d.logprobs), self.offsets[i])
        self.offsets[i] += len(d.text)
        body: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": d.finish_reason}
        if self.chat:
            body["delta"] = {"content": d.text} if d.text or d.finish_reason is None else {}
        else:
            body["text"] = d.text
        chunk = self._envelope([body], chunk=True)
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": self.usage()}

    def _echoed(self, c: Choice) -> tuple[list[TokenLogprob], int | None]:
        """With echo and prompt scores (a whole completion): the prompt's scored entries, and
        its first token, which vLLM shows with a null logprob (nothing came before it)."""
        if self.chat or not self.spec.echo or self.spec.params.prompt_logprobs is None:
            return [], None
        return list(c.prompt_logprobs), c.prompt_ids[0]

    def _logprobs(self, lps: list[Any], offset: int, first: int | None = None) -> dict[str, Any]:
        """`first`: a token shown before `lps` with null logprob and alternatives."""
        tok = self.tok
        if self.chat:

            def entry(tid: int, lp: float) -> dict[str, Any]:
                return {"token": self._key(tid), "logprob": lp, "bytes": list(tok.token_bytes(tid))}

            return {
                "content": [
                    {
                        **entry(x.token_id, x.logprob),
                        "top_logprobs": [entry(t, v) for t, v in x.top],
                    }
                    for x in lps
                ]
            }
        lead: list[TokenLogprob | None] = [None] if first is not None else []
        entries = lead + lps
        ids = ([first] if first is not None else []) + [x.token_id for x in lps]
        tokens = [tok.decode([t], skip_special_tokens=False) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [x.logprob if x is not None else None for x in entries],
            "top_logprobs": [
                {self._key(t): v for t, v in x.top} if x is not None else None for x in entries
            ],
            "text_offset": offsets,
        }

    def _key(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or, for a token holding part of a UTF-8
        character (its text is U+FFFD), `bytes:\\xNN...`, so that such tokens never collide."""
        text = self.tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.tok.token_bytes(token_id))
