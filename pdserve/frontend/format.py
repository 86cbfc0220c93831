"""OpenAI response objects from a generation's deltas: a completion or a chat completion,
whole or as stream chunks, with usage and logprobs (echoed prompt tokens first, `text_offset`s
over the whole text).

Logprobs as vLLM shows them. A token is its decoded text (a token holding part of a UTF-8
character is U+FFFD; chat's `bytes` say which part), or "token_id:N" with
`return_tokens_as_token_ids`: one rendering for `tokens` and the `top_logprobs` keys alike.
Completions: each position's `top_logprobs` holds the N best tokens and the token actually
there (prompt or generated), under the key `tokens` shows and with its own logprob, so N or
N+1 entries (fewer where two tokens render alike; with `logprobs: 0`, the token alone). Chat:
`top_logprobs` is exactly the N best (OpenAI's meaning). A logprob of -inf (a token masked
out) is shown as -9999.0: JSON has no infinity. `prompt_logprobs` (vLLM's, not streamed): per
prompt token after the first, {token id: {logprob, rank, decoded_token}} for the token there
and the N best; a rank is known only among those N (the token there, outside them: null).

A streamed `echo` sends the prompt's text as each choice's first chunk. When the prompt is
scored too (`logprobs`), that chunk waits for the choice's first output, which carries the
prompt's scores, and holds them; the generated tokens' `text_offset`s continue after it. Chat's
`echo` (frontend/chat.py says when) starts each choice's content with the last message's:
streamed, as a chunk of its own after the role's. A chat whose output is read for tool calls
answers them as OpenAI does (frontend/tool_answer.py shapes the message and the chunks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from pdserve.frontend.generation import Choice, Delta, Generation
from pdserve.frontend.protocol import GenerationSpec
from pdserve.frontend.textstream import Detokenizer
from pdserve.frontend.tool_answer import ToolAnswer
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
        tools: ToolAnswer | None = None,
    ) -> None:
        """`tools`: a chat's tool calls, read from its choices' output (tool_answer.py)."""
        self.tok, self.model_name, self.spec, self.gen = tok, model_name, spec, gen
        self.tools = tools
        self.chat = spec.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + gen.id
        self.created = int(time.time())
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.texts = [spec.echo_text] * len(gen.choices)
        self.decode: Callable[[list[int]], str] = tok.decode
        # Choices whose streamed echo waits for the prompt's scores (on their first output).
        self.echo_pending: set[int] = set()
        if spec.echo and spec.stream and spec.params.logprobs is not None:
            self.echo_pending = {c.index for c in gen.choices}
        if spec.echo:
            for c in gen.choices:
                self.texts[c.index] = self.decode(c.prompt_ids)
        self.echoed = [len(t) for t in self.texts]  # characters of echoed prompt, per choice
        # A stream's generated tokens' text_offsets, per choice, after the echoed prompt if any:
        # built on the choice's first scored delta, so only a completions stream with logprobs
        # detokenises for them (`_stream_offsets`).
        self.offsets: dict[int, TextOffsets] = {}
        # A chunk's envelope is the same for the whole stream: its bytes up to the choice's
        # body, once (what `sse(self._envelope([body], chunk=True))` would write around it).
        envelope = encode_json(self._envelope([], chunk=True))
        assert envelope.endswith(b'"choices":[]}')
        self._sse_head = b"data: " + envelope[:-2]

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
            if self.spec.params.logprobs is not None and self.chat:
                lp = self._chat_logprobs(c.logprobs)
            elif self.spec.params.logprobs is not None:
                prompt, first = self._echoed(c)
                lp = self._completion_logprobs(c.logprobs, self._generated_offsets(c))
                if first is not None:  # echo: the prompt's entries first, offsets from 0
                    scored = self._completion_logprobs(prompt, self._prompt_offsets(), first)
                    lp = {k: scored[k] + lp[k] for k in lp}
            if self.chat:
                message, reason = self._message(c)
                choices.append(
                    {"index": c.index, "finish_reason": reason, "logprobs": lp, "message": message}
                )
            else:
                choices.append(
                    {
                        "index": c.index,
                        "finish_reason": c.finish_reason,
                        "logprobs": lp,
                        "text": self.texts[c.index],
                        **self._choice_prompt_logprobs(c),
                    }
                )
        if self.chat and self.spec.prompt_logprobs is not None:
            return {  # the prompt's, the same for every choice: the first's
                **self._envelope(choices, chunk=False),
                "usage": self.usage(),
                "prompt_logprobs": self._prompt_logprobs(self.gen.choices[0]),
            }
        return {**self._envelope(choices, chunk=False), "usage": self.usage()}

    def _message(self, c: Choice) -> tuple[dict[str, Any], str | None]:
        """A whole chat choice's message and finish_reason (its tool calls, if read)."""
        text = self.texts[c.index]
        if self.tools is None:
            return {"role": "assistant", "content": text}, c.finish_reason
        shown = self.echoed[c.index]
        return self.tools.message(text[:shown], text[shown:], c.finish_reason)

    def stream_start(self) -> list[dict[str, Any]]:
        if self.chat:
            deltas = [{"role": "assistant", "content": ""}]
            if self.spec.echo_text:
                deltas.append({"content": self.spec.echo_text})
            return [
                self._envelope(
                    [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None}],
                    chunk=True,
                )
                for d in deltas
                for c in self.gen.choices
            ]
        if self.spec.echo:
            waiting = self.echo_pending
            return [self._echo_chunk(c) for c in self.gen.choices if c.index not in waiting]
        return []

    def stream_events(self, d: Delta) -> list[bytes]:
        """`stream_chunks(d)` as SSE events; a delta's own chunk from the envelope's bytes."""
        if d.choice.index in self.echo_pending:
            return [sse(chunk) for chunk in self.stream_chunks(d)]
        body = self.delta_body(d)
        if self.tools is None:
            return [self._sse_head + encode_json(body) + b"]}\n\n"]
        # The text read for tool calls: maybe several chunks, or none.
        bodies = self.tools.stream(body, d.text, d.finish_reason)
        return [self._sse_head + encode_json(b) + b"]}\n\n" for b in bodies]

    def stream_chunks(self, d: Delta) -> list[dict[str, Any]]:
        """The chunks a delta becomes: its own, after the choice's echoed prompt if that waited
        for the prompt's scores."""
        if d.choice.index not in self.echo_pending:
            return [self.stream_delta(d)]
        self.echo_pending.discard(d.choice.index)
        return [self._echo_chunk(d.choice), self.stream_delta(d)]

    def _echo_chunk(self, c: Choice) -> dict[str, Any]:
        """A streamed echo: the prompt's text, with its scores when they were asked and came
        (a choice that failed before its first output has none)."""
        lp = None
        prompt, first = self._echoed(c)
        scored = self.spec.params.logprobs is not None and first is not None
        if scored and len(prompt) == len(c.prompt_ids) - 1:
            lp = self._completion_logprobs(prompt, self._prompt_offsets(), first)
        body = {
            "index": c.index,
            "text": self.texts[c.index],
            "logprobs": lp,
            "finish_reason": None,
        }
        return self._envelope([body], chunk=True)

    def stream_delta(self, d: Delta) -> dict[str, Any]:
        return self._envelope([self.delta_body(d)], chunk=True)

    def delta_body(self, d: Delta) -> dict[str, Any]:
        """A delta's choice in a stream chunk."""
        i = d.choice.index
        lp = None
        if self.spec.params.logprobs is not None and d.logprobs and self.chat:
            lp = self._chat_logprobs(list(d.logprobs))
        elif self.spec.params.logprobs is not None and d.logprobs:
            lp = self._completion_logprobs(list(d.logprobs), self._stream_offsets(d.choice))
        body: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": d.finish_reason}
        if self.chat:
            body["delta"] = {"content": d.text} if d.text or d.finish_reason is None else {}
        else:
            body["text"] = d.text
        return body

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": self.usage()}

    def _echoed(self, c: Choice) -> tuple[list[TokenLogprob], int | None]:
        """With echo and prompt scores (a whole completion): the prompt's scored entries, and
        its first token, which vLLM shows with a null logprob (nothing came before it)."""
        if self.chat or not self.spec.echo or self.spec.params.prompt_logprobs is None:
            return [], None
        return list(c.prompt_logprobs), c.prompt_ids[0]

    def _prompt_offsets(self) -> TextOffsets:
        return TextOffsets(self.tok.incremental(True), 0)  # the echoed text: decode()'s

    def _generated_offsets(self, c: Choice) -> TextOffsets:
        detok = self.tok.incremental(self.spec.skip_special_tokens)
        return TextOffsets(detok, self.echoed[c.index])

    def _stream_offsets(self, c: Choice) -> TextOffsets:
        """Choice `c`'s generated tokens' offsets across the whole stream, made at first use."""
        got = self.offsets.get(c.index)
        if got is None:
            got = self.offsets[c.index] = self._generated_offsets(c)
        return got

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        """Chat's logprobs: each token with its bytes and exactly the N best (no offsets)."""
        tok = self.tok

        def entry(tid: int, lp: float) -> dict[str, Any]:
            return {
                "token": self._key(tid),
                "logprob": _finite(lp),
                "bytes": list(tok.token_bytes(tid)),
            }

        n = self.spec.params.logprobs or 0
        return {
            "content": [
                {
                    **entry(x.token_id, x.logprob),
                    "top_logprobs": [entry(t, v) for t, v in x.top[:n]],
                }
                for x in lps
            ]
        }

    def _completion_logprobs(
        self, lps: list[TokenLogprob], offsets: TextOffsets, first: int | None = None
    ) -> dict[str, Any]:
        """`first`: a token shown before `lps` with null logprob and alternatives; `offsets`
        walks the text the tokens make."""
        lead: list[TokenLogprob | None] = [None] if first is not None else []
        entries = lead + lps
        ids = ([first] if first is not None else []) + [x.token_id for x in lps]
        return {
            "tokens": [self._key(t) for t in ids],
            "token_logprobs": [_finite(x.logprob) if x is not None else None for x in entries],
            "top_logprobs": [self._top(x) if x is not None else None for x in entries],
            "text_offset": offsets.of(ids),
        }

    def _top(self, x: TokenLogprob) -> dict[str, float]:
        """A completion position's alternatives: the N best, then the token that is there,
        whose own logprob its key always shows (vLLM's N or N+1)."""
        top = {self._key(t): _finite(v) for t, v in x.top[: self.spec.params.logprobs or 0]}
        top[self._key(x.token_id)] = _finite(x.logprob)
        return top

    def _key(self, token_id: int) -> str:
        """A token as logprobs show it: its text (U+FFFD for part of a UTF-8 character), or
        "token_id:N" with return_tokens_as_token_ids."""
        if self.spec.token_ids_as_text:
            return f"token_id:{token_id}"
        return self.tok.decode([token_id], skip_special_tokens=False)

    def _choice_prompt_logprobs(self, c: Choice) -> dict[str, Any]:
        """A completion choice's `prompt_logprobs` field, if the client asked for it."""
        if self.spec.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": self._prompt_logprobs(c)}

    def _prompt_logprobs(self, c: Choice) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs: None for the first prompt token (nothing came before it),
        then per token {id: {logprob, rank, decoded_token}}, the token there first."""
        n = self.spec.prompt_logprobs or 0
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for x in c.prompt_logprobs:
            best = x.top[:n]
            ranks = {t: r for r, (t, _) in enumerate(best, 1)}
            at = {str(x.token_id): self._scored(x.token_id, x.logprob, ranks.get(x.token_id))}
            for t, v in best:
                at.setdefault(str(t), self._scored(t, v, ranks[t]))
            out.append(at)
        return out

    def _scored(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": self._key(token_id)}


encode_json = msgspec.json.Encoder().encode  # UTF-8, compact, several times json.dumps' speed


def sse(obj: Any) -> bytes:
    """One SSE event of a JSON object."""
    return b"data: " + encode_json(obj) + b"\n\n"


# What vLLM shows for a logprob of -inf (JSON has no infinity; json.dumps would write -Infinity).
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class TextOffsets:
    """Where each token starts in the text of a choice: the characters released before it.
    A special token the text leaves out takes no room; the tokens holding the parts of one
    character all start where that character does. Walked once per choice, in token order,
    so a stream's offsets are the whole answer's."""

    def __init__(self, detok: Detokenizer, start: int) -> None:
        self.detok = detok
        self.at = start

    def of(self, ids: list[int]) -> list[int]:
        out = []
        for t in ids:
            out.append(self.at)
            self.at += len(self.detok.push(t))
        return out
