"""Requests held while their grammar compiles: the engine thread never waits on a compile.

A constrained request (structured output) needs its grammar's matcher before any step samples
for it, and a compile takes milliseconds for a usual schema but up to COMPILE_TIMEOUT_S for a
hostile one (protocol/grammar_thread.py). Waiting for it on the engine thread would stall
every other request's decode for that long (and P's control plane behind it), so, as vLLM's
scheduler does with requests waiting for their FSM, the engine holds such a request instead:

- **Held.** A request the engine takes in (a submission, P's prompt to compute, D's adopted
  prompt) whose grammar `Grammars.poll` does not yet report compiled is held: `req.grammar_wait`
  is set and the scheduler passes it over (a waiting one is not admitted; D's adopted one has
  nothing to compute until its first token is taken). D's first token, sampled by P, waits
  here with it and is emitted once the grammar can take it.
- **Settled.** Every tick the engine asks `settle()` which held grammars are done: a compiled
  one's requests get their matcher at once (so no later step compiles, whatever the LRU
  evicts) and go on, their first token emitted on D; a refused one's fail, each alone, naming
  why, through the role (P tells D). A request that ended while held (aborted, expired) is
  dropped; its compile still ends at its deadline (engine/sampling/grammar_compiles.py).

Engine-thread only; holds no lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.sampling.grammars import Grammars

GRAMMAR_POLL_S = 0.002  # the loop's wait while every request it has is held


@dataclass
class Held:
    req: Request
    # D's first token (sampled by P), with its logprob and when it arrived: emitted once the
    # grammar is compiled, so the matcher takes it as it takes every other.
    first: tuple[int, TokenLogprob | None, float] | None = None


class GrammarWaits:
    """The requests held for their grammar, by request id."""

    def __init__(self, grammars: Grammars) -> None:
        self._grammars = grammars
        self._held: dict[str, Held] = {}

    def __len__(self) -> int:
        """Held requests still unfinished (one that ended is dropped at the next `settle`)."""
        return sum(not h.req.status.finished for h in self._held.values())

    def hold(
        self, req: Request, first: tuple[int, TokenLogprob | None, float] | None = None
    ) -> bool:
        """Hold `req` if its grammar is not compiled yet (starting the compile); False if it
        may go on now (no constraint, or compiled). A refused grammar is held too: the next
        `settle` fails it, so the request ends where every other does."""
        c = req.params.constraint
        if c is None:
            return False
        if self._grammars.poll(c) is True:
            self._grammars.attach(req)  # its matcher now: no later step waits on a compile
            return False
        if req.request_id in self._held:
            raise RuntimeError(f"request {req.request_id} held twice for its grammar")
        req.grammar_wait = True
        self._held[req.request_id] = Held(req, first)
        return True

    def settle(self) -> Iterator[tuple[Held, str | None]]:
        """The held requests whose grammar is done, released: (held, None) if it compiled
        (its matcher made), (held, why not) if it did not. Requests that ended meanwhile are
        dropped. Every compile that ended is settled first, polled or not."""
        self._grammars.sweep()
        for rid, held in list(self._held.items()):
            req = held.req
            if req.status.finished:
                del self._held[rid]
                continue
            c = req.params.constraint
            state = self._grammars.poll(c) if c is not None else True
            if state is False:
                continue
            del self._held[rid]
            req.grammar_wait = False
            if state is True:
                try:
                    self._grammars.attach(req)
                except ValueError as e:  # D's output so far does not match: a bug, its alone
                    state = str(e)
            yield held, None if state is True else state
