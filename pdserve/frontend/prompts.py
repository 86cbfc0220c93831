"""A request's prompt ids: text and token prompts, chats rendered by a template, truncation, and
the bounds a prompt is held to before and after tokenizing.

Tokenizing a prompt and rendering a chat template run on a small thread pool, never on the
event loop: a 40 MB prompt once froze a router for 34 s. (That helps only as far as the
tokenizer releases the GIL while it works.) Before that, a text is bounded by its cheapest
measure (LESSONS #19): one longer than `max_prompt_chars` (the context times the most
characters one token can stand for) cannot fit and is refused untokenized. The tokenizing
has a deadline (TOKENIZE_TIMEOUT_S), and a client that leaves takes its queued tokenizing
with it; the threads are daemons, so a server told to stop does not wait at exit for a
tokenization in flight (frontend/tokenizer_pool.py).

A chat renders with the model's template on those threads, or, with the client's own
`chat_template`, in the template jail's helper processes (frontend/template_jail.py), called
from threads of its own; a client's template is refused (400) unless the server was started
with --trust-request-chat-template (off by default, as vLLM's since its advisories
GHSA-6fvq-23cw-5628 and GHSA-4hw3-g54f-xfrj). `truncate_prompt_tokens` keeps a prompt's last
k tokens (a BOS the tokenizer put first stays first, as HF's left truncation keeps it); such
a prompt is not bounded by its characters, only by the body's size and the tokenizing
deadline, and neither is a text /tokenize counts. A prompt whose tokens and max_tokens pass
the context is refused in vLLM's words ("This model's maximum context length is N tokens.
However, you requested M tokens ..."), code `context_length_exceeded`, which clients
(litellm) map to their context-window error; the character bound's refusal starts with the
same sentence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pdserve.frontend.chat import ChatPrompt
from pdserve.frontend.template_jail import HELPERS, JailDown, TemplateJail, TemplateRefused
from pdserve.frontend.tokenizer_pool import TokenizerPool
from pdserve.frontend.tools import check_template
from pdserve.model.chat_template import continue_final
from pdserve.protocol.sampling import InvalidParams
from pdserve.server.api_error import ApiError, bad

TOKENIZER_THREADS = 4  # prompts tokenized at once, per front end; the rest wait their turn
TOKENIZE_TIMEOUT_S = 30.0  # one call's tokenizing (its queue wait included)
T = TypeVar("T")
A = TypeVar("A")


class Prompts:
    """Builds prompt ids for one front end; owns its tokenizer threads and template jail."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        max_prompt_chars: int | None,
        trust_request_template: bool = False,
    ) -> None:
        """`max_prompt_chars`: the longest text prompt (or rendered chat) tokenized; None, no
        bound (tests' fake tokenizers). `trust_request_template`: render a request's own chat
        template (else it is refused)."""
        self.tok = tokenizer
        self.trust_request_template = trust_request_template
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars
        self.pool = TokenizerPool(TOKENIZER_THREADS)
        self.jail = TemplateJail()
        self._jail_pool = TokenizerPool(HELPERS, name="template")

    # -- prompts ----------------------------------------------------------------------------
    async def completion_ids(
        self, prompts: Sequence[str | Sequence[int]], keep: int | None
    ) -> list[list[int]]:
        """A completion's prompts as ids; `keep`: truncate each to its last `keep` tokens."""
        if any(isinstance(p, str) for p in prompts):
            for p in prompts:
                if isinstance(p, str) and keep is None:
                    self.check_chars(len(p), "prompt")
            ids = await self.off_loop(self._encode_prompts, prompts)
        else:  # token ids already: no tokenizer, so no hop to its threads and back
            ids = self._encode_prompts(prompts)
        if keep is None:
            return ids
        return [
            self.truncate(i, keep, isinstance(p, str)) for i, p in zip(ids, prompts, strict=True)
        ]

    async def chat_ids(
        self,
        chat: ChatPrompt,
        keep: int | None = None,
        bounded: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """A chat's prompt ids, rendered with the model's template on a tokenizer thread, or
        with the client's in the template jail, if the server trusts clients' templates.
        `keep`: truncate to the last `keep` tokens; `bounded`: refuse a chat whose characters
        cannot fit the context, untokenized (off with `keep`, and for /tokenize, which
        counts)."""
        if chat.template is not None and not self.trust_request_template:
            raise bad(
                "'chat_template': this server does not render a request's own chat template; "
                "its operator may allow it with --trust-request-chat-template",
                "chat_template",
            )
        bounded = bounded and keep is None
        if bounded:
            self.check_chars(text_chars(chat.messages), "messages")  # a template adds to it
        if chat.template is None:
            text = await self.off_loop(self._render, chat)
        else:
            text = await self._render_in_jail(chat)
        if bounded:
            self.check_chars(len(text), "messages")
        ids = await self.off_loop(self._encode_rendered, (text, add_special_tokens))
        return ids if keep is None else self.truncate(ids, keep, False)

    async def text_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s ids, unbounded by the context (/tokenize counts any text)."""
        return await self.off_loop(self._encode_rendered, (text, add_special_tokens))

    async def decode(self, ids: list[int]) -> str:
        """`ids` as text, special tokens kept (/detokenize)."""
        return await self.off_loop(self._decode, ids)

    # -- bounds -----------------------------------------------------------------------------
    def check_chars(self, chars: int, param: str) -> None:
        """400 for a text too long for the context whatever its tokens (before tokenizing)."""
        limit = self.max_prompt_chars
        if limit is not None and chars > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"the {param} is {chars} characters: more than that context can hold (at most "
                f"{limit} characters)",
                param=param,
                code="context_length_exceeded",
            )

    def check_context(self, prompt_tokens: int, max_tokens: int, kind: str) -> None:
        """400 in vLLM's words for a prompt and completion longer than the context (a prompt
        must leave room for one generated token, or for none with max_tokens 0)."""
        n = self.max_model_len
        if prompt_tokens < n and prompt_tokens + max_tokens <= n:
            return
        where = "messages" if kind == "chat" else "prompt"
        raise ApiError(
            400,
            f"This model's maximum context length is {n} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} "
            f"in the completion). Please reduce the length of the {where} or completion.",
            param="prompt" if prompt_tokens >= n else "max_tokens",
            code="context_length_exceeded",
        )

    def kept_tokens(self, truncate: int | None) -> int | None:
        """How many prompt tokens truncate_prompt_tokens keeps (-1: the context's length);
        more than the context is a 400, as in vLLM."""
        if truncate is None:
            return None
        if truncate > self.max_model_len:
            raise bad(
                f"'truncate_prompt_tokens' ({truncate}) is greater than this model's context "
                f"({self.max_model_len} tokens)",
                "truncate_prompt_tokens",
            )
        return self.max_model_len if truncate == -1 else truncate

    def truncate(self, ids: list[int], keep: int, encoded: bool) -> list[int]:
        """The last `keep` of `ids`; for a text the tokenizer encoded, a BOS it put first
        stays first (the rest is the last keep - 1)."""
        if len(ids) <= keep:
            return ids
        bos = getattr(self.tok, "bos_token_id", None)
        if encoded and bos is not None and ids[0] == bos and keep > 1:
            return [bos, *ids[len(ids) - keep + 1 :]]
        return ids[len(ids) - keep :]

    # -- on the tokenizer threads -----------------------------------------------------------
    async def off_loop(self, fn: Callable[[A], T], arg: A, pool: TokenizerPool | None = None) -> T:
        """`fn(arg)` on a tokenizer thread (or `pool`'s), within TOKENIZE_TIMEOUT_S (413 past
        it). If the handler is cancelled first (its client left), a call still queued never
        runs."""
        try:
            async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
                return await (pool or self.pool).run(fn, arg)
        except TimeoutError:
            raise ApiError(
                413,
                f"the prompt was not tokenized within {TOKENIZE_TIMEOUT_S:.0f}s: send a "
                "shorter one",
                code="prompt_too_large",
            ) from None

    def _encode_prompts(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        return [self.tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    def _encode_rendered(self, text_and_special: tuple[str, bool]) -> list[int]:
        text, add_special_tokens = text_and_special
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def _decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    def _render(self, chat: ChatPrompt) -> str:
        """The chat rendered with the model's template."""
        try:
            tools = chat.kwargs.get("tools", ())
            check_template(chat.messages, tools, lambda: self.tok.chat_template_support)
        except InvalidParams as e:
            raise bad(str(e), e.param) from e
        except ValueError as e:  # the template does not parse
            raise bad(f"chat template: {e}", "messages") from e
        try:
            return str(self.tok.apply_chat_template(list(chat.messages), **chat.kwargs))
        except (ValueError, TypeError) as e:
            # The tokenizer reports whatever the template raised as ValueError; a TypeError
            # is a keyword clash at the call, which parse_chat should already have refused.
            raise bad(f"chat template: {e}", "messages") from e

    async def _render_in_jail(self, chat: ChatPrompt) -> str:
        """The chat rendered with the client's own template, in the template jail (it renders
        what the template says: no check of what it can render)."""
        template = chat.template
        assert template is not None
        variables = {**getattr(self.tok, "template_variables", {}), **chat.variables}
        limit, messages, gen_prompt = (
            self.max_prompt_chars,
            chat.messages,
            chat.add_generation_prompt,
        )

        def render(_: None) -> str:
            return self.jail.render(template, messages, gen_prompt, variables, limit)

        try:
            text = await self.off_loop(render, None, self._jail_pool)
        except TemplateRefused as e:
            raise bad(f"chat_template: {e}", "chat_template") from e
        except JailDown as e:
            raise ApiError(503, str(e), type_="server_error", param="chat_template") from e
        if not chat.continue_final_message:
            return text
        try:
            return continue_final(text, messages)
        except ValueError as e:
            raise bad(f"chat template: {e}", "messages") from e

    def close(self) -> None:
        """Stop the tokenizer threads (what is running finishes; what waits is dropped) and
        the template jail's helpers."""
        self.pool.close()
        self._jail_pool.close()
        self.jail.close()


def prompt_char_bound(max_token_chars: int, max_model_len: int) -> int:
    """The longest text that could still fit a context of `max_model_len` tokens when no
    token stands for more than `max_token_chars` characters (Tokenizer.max_token_chars)."""
    return max(max_token_chars, 1) * max_model_len


def text_chars(value: Any) -> int:
    """Characters in every string value of a parsed JSON value: the messages' contents, which
    a chat template renders (plus its own text)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(text_chars(v) for v in value)
    return 0
