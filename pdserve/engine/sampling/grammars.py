"""Structured output in the engine: the grammar vocabulary, compiled grammars, each request's
matcher and a step's token masks (the grammar engine is llguidance: protocol/constraint.py).

- **Vocabulary.** llguidance's token table (`LLTokenizer`), built once per engine on first
  use from the model's tokenizer (its `tokenizers` JSON, a GGUF file's included:
  model/tokenizer.py) with the end-of-sequence ids, sized to cover the model's logits: ids
  past the tokenizer's (a padded embedding) are tokens no grammar matches, so their bits are
  always 0 (and logits past the table, if the tokenizer is the wider one, are cut off).
- **Compiled grammars.** One pristine matcher per (kind, spec), compiled on the grammar thread
  (a GBNF grammar converted to Lark first, in the converter's child process:
  runtime/gbnf_converter.py) and kept in an LRU of `GRAMMAR_CACHE_SIZE`
  (engine/sampling/grammar_compiles.py); the engine thread never waits for a compile: `poll`
  starts it and says whether it is done, `sweep` settles those that ended, and
  engine/grammar_waits.py holds the request meanwhile. `compiled` waits, for callers outside
  the loop (tests, tools).
- **A request's matcher** is a deep copy of the pristine one (microseconds), given to it as
  its grammar is found compiled (`attach`), and has always consumed exactly the request's
  `output_ids`: `accept` advances it with each token the engine emits (Engine.emit_token),
  so D's matcher continues P's first token on adoption. A token it refuses is a bug (the
  mask allowed it): ValueError, which fails that request only.
- **The end.** A complete grammar allows only end-of-sequence tokens, so the model samples
  one next (as in vLLM) and the request stops on it, with finish_reason "stop" and the token
  hidden from the text like any stop token; `accept` says so even where the engine would not
  stop on it (ignore_eos, min_tokens), since the grammar decides when a constrained request
  ends. A grammar not complete at max_tokens ends by length.
- **Masks.** `mask(reqs, device)` computes every unfinished constrained row's bitmask on the
  host, in llguidance's thread pool, straight into one int32 buffer: G rows of W words, then
  the G row indices; one upload (pinned and non-blocking on CUDA), which
  sampling/grammar_mask.py applies to the logits. A row needs its matcher current: no token
  of it may be in flight (the stepper completes the step in flight first: engine/stepper.py).

Only the engine thread uses this; it holds no lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import llguidance
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling.grammar_compiles import GrammarCompiles
from pdserve.engine.sampling.grammar_mask import GrammarMask
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.constraint import Constraint, ToLark
from pdserve.runtime.gbnf_converter import GBNF_CONVERTER

GRAMMAR_CACHE_SIZE = 128  # compiled grammars kept, least recently used evicted


class Grammars:
    """The engine's grammars: `poll`/`sweep`/`attach` (compiles the loop never waits for),
    `matcher`, `accept` and `mask`, over a vocabulary built from `tokenizer()` on first use;
    `vocab_size` is the width of the model's logits; `to_lark` converts GBNF (by default in
    the process's converter child)."""

    def __init__(
        self,
        tokenizer: Callable[[], Tokenizer],
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = GRAMMAR_CACHE_SIZE,
        to_lark: ToLark = GBNF_CONVERTER.convert,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = eos_token_ids
        self._compiles = GrammarCompiles(self._build_vocab, cache_size, to_lark)
        self._executor: llguidance.LLExecutor | None = None

    def _build_vocab(self) -> llguidance.LLTokenizer:
        tok = self._tokenizer()
        eos = sorted(self._eos | tok.eos_token_ids)
        return llguidance.LLTokenizer(
            tok.to_json(), n_vocab=max(self.vocab_size, tok.vocab_size), eos_token=eos or None
        )

    @property
    def vocab(self) -> llguidance.LLTokenizer:
        return self._compiles.vocab

    @property
    def compiles(self) -> int:
        """Grammars compiled (cache misses)."""
        return self._compiles.compiles

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a grammar: the engine's and the tokenizer's end-of-sequence."""
        return frozenset(self.vocab.eos_tokens)

    @property
    def words(self) -> int:
        """int32 words in one row's bitmask."""
        return (self.vocab.vocab_size + 31) // 32

    def poll(self, c: Constraint) -> bool | str:
        """Without waiting: True once `c` is compiled, why not if it cannot be, False while
        it compiles (grammar_compiles.py)."""
        return self._compiles.poll(c)

    def sweep(self) -> None:
        """Settle the compiles that ended (once a tick)."""
        self._compiles.sweep()

    def compiled(self, c: Constraint) -> llguidance.LLMatcher:
        """The pristine matcher of `c`, waiting for its compile if it is not done (callers
        outside the loop); ValueError if it cannot compile against this vocabulary."""
        return self._compiles.compiled(c)

    def attach(self, req: Request) -> None:
        """Give `req` its matcher now, while its grammar is compiled (`poll` just said so):
        it never depends on the LRU again, so no later step compiles on the loop."""
        self.matcher(req)

    def matcher(self, req: Request) -> llguidance.LLMatcher:
        """`req`'s matcher, made on first use and caught up with its output so far."""
        if req.matcher is None:
            c = req.params.constraint
            if c is None:
                raise RuntimeError(f"request {req.request_id} has no constraint")
            m = self.compiled(c).deep_copy()
            if req.output_ids and not m.consume_tokens(req.output_ids):
                raise ValueError(
                    f"request {req.request_id}: its output so far does not match its "
                    f"{c.kind.value} constraint: {m.get_error()}"
                )
            req.matcher = m
        return req.matcher

    def accept(self, req: Request, tok: int) -> bool:
        """Advance `req`'s matcher by `tok`, a token being emitted; True when it ends the
        grammar (an end-of-sequence token the grammar allowed: the request stops).
        ValueError if the grammar refuses the token."""
        m = self.matcher(req)
        if not m.consume_token(tok):
            kind = req.params.constraint.kind.value if req.params.constraint else "?"
            raise ValueError(
                f"request {req.request_id}: token {tok} breaks its {kind} constraint: "
                f"{m.get_error()}"
            )
        return tok in self.eos_token_ids

    def mask(self, reqs: Sequence[Request], device: torch.device) -> GrammarMask | None:
        """The allowed tokens of each unfinished constrained row of `reqs`, on `device`; None
        if there is none. ValueError naming the request whose grammar cannot run."""
        rows = [i for i, r in enumerate(reqs) if r.constrained and not r.status.finished]
        if not rows:
            return None
        matchers: list[tuple[llguidance.LLMatcher, int]] = []
        for j, i in enumerate(rows):
            req = reqs[i]
            if req.pending:
                raise RuntimeError(
                    f"request {req.request_id}: a grammar mask with a token still in flight"
                )
            m = self.matcher(req)
            if m.is_error():
                raise ValueError(f"request {req.request_id}: its grammar failed: {m.get_error()}")
            matchers.append((m, j))
        g, words = len(rows), self.words
        # Pinned on CUDA: the copy must not wait for the step in flight (sampling/batch.py).
        flat = torch.empty(g * words + g, dtype=torch.int32, pin_memory=device.type == "cuda")
        flat[g * words :] = torch.tensor(rows, dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(matchers, flat.data_ptr(), words * 4, g)
        return GrammarMask.upload(flat, g, words, device)
