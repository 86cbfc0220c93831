"""How much the control plane takes in: per message, per peer queue and per tick (LESSONS #18).

A prefill worker's ROUTER socket is open to anyone who can reach its port, so what it takes
in is bounded three ways, each before any work is spent on a frame:
* per message: a decode worker sends P peer-level messages (Register, Ping, ...), Abort and
  PrefillRequest, never extra frames. The largest is a PrefillRequest for the model's whole
  context (protocol/messages.py), so P's limit is that plus an allowance for the rest
  (`prefill_inbound_bytes`). ZMQ refuses a larger frame while reading its length, before it
  allocates, and drops that connection; `FrameAuth.check` refuses a larger message by its
  size, before any hashing. The limit follows the model's context, not P's own
  `max_model_len`, so that a decode worker with a longer one is answered `PrefillReject`,
  not cut off. D checks what it sends against the same limit (one model, one rule), so an
  oversized message fails loudly on D's side.
* per peer queue: ZMQ holds at most ROUTER_RCVHWM messages per connection, so a peer's
  backlog is at most ROUTER_RCVHWM x that limit (a few MB x 1000, not 256 MiB x 1000).
* per tick: the I/O thread reads at most RECV_BATCH messages or RECV_BYTES bytes (at least
  one message) from each socket per tick, then flushes the outbox and returns, so its
  heartbeat, its Pongs and the KV frames it sends keep going under any flood. Each ready
  socket gets the same share, so a flooded socket cannot starve the others.

Decode workers receive KV pages from P (tcp backend), so their sockets keep MAX_FRAME_BYTES;
only prefill workers bind, and only members' sockets connect to a decode worker.
"""

from __future__ import annotations

from pdserve.protocol.messages import PrefillRequest, encode
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.frame_auth import MAX_AUTH_BYTES

MAX_FRAME_BYTES = 256 * 2**20  # one frame P sends D: a message, or one KV page (tcp backend)

RECV_BATCH = 256  # messages read from one socket per tick
# Bytes read from one socket per tick (a message that crosses it is still read whole): a few
# KV chunks of a large model on D, many times the largest message P takes.
RECV_BYTES = 64 * 2**20
# The most KV a KVChunk carries (tcp backend): P splits a write into chunks of at most this many
# bytes (one page at least), so a chunk is read within one tick's budget, its page count fits the
# auth frame's 2-byte bulk count, and D stages it in one bounded step; D refuses a larger one.
MAX_CHUNK_BYTES = RECV_BYTES
MAX_CHUNK_PAGES = 0xFFFF  # the auth frame counts bulk frames in 2 bytes


def chunk_pages(page_bytes: int) -> int:
    """Pages a KVChunk may carry, for pages of `page_bytes` (always at least one)."""
    return max(1, min(MAX_CHUNK_PAGES, MAX_CHUNK_BYTES // page_bytes))


ROUTER_RCVHWM = 1000  # messages ZMQ queues per connected peer on P (ZMQ's default, made explicit)
# A connection must finish ZMQ's handshake this soon (ZMQ's default is 30 s): a half-open
# connection holds a descriptor on P until then.
HANDSHAKE_IVL_MS = 5000

# msgpack's widest integer (0xcf/0xd3 + 8 bytes): a token id, page id or room id takes at most this.
INT_BYTES = 9
INT64_MAX = 2**63 - 1
MAX_SENDER = 255  # frame_auth.MAX_IDENTITY: the envelope's `sender` is the same identity
# What a message other than a PrefillRequest's token and page lists may hold: the sampling
# params (their lists are capped: protocol/sampling.py, 1,024 stop ids and 300 biases, ~15 KB
# encoded), and Register's layout and NIXL agent metadata (one registered pool: kilobytes).
PEER_MESSAGE_ALLOWANCE = 2**20


def prefill_inbound_bytes(context_tokens: int) -> int:
    """The largest message, auth frame included, that a decode worker of a model with
    `context_tokens` positions may send a prefill worker: a PrefillRequest whose prompt
    fills the context, one destination page per token (the smallest page), every integer
    at its widest, plus PEER_MESSAGE_ALLOWANCE. Computed without building the lists (a
    context of millions of positions costs nothing); capped at MAX_FRAME_BYTES."""
    if context_tokens < 1:
        raise ValueError(f"a model's context is at least 1 token, got {context_tokens}")
    envelope = PrefillRequest(
        room=INT64_MAX,
        epoch=INT64_MAX,
        sender="d" * MAX_SENDER,
        prompt_ids=[],
        dst_pages=[],
        params=SamplingParams(),
        write_deadline=0.0,
    )
    # An array's header grows from 1 to 5 bytes with its length; count the widest, twice.
    lists = 2 * (5 + INT_BYTES * context_tokens)
    total = MAX_AUTH_BYTES + len(encode(envelope)) + lists + PEER_MESSAGE_ALLOWANCE
    return min(total, MAX_FRAME_BYTES)
