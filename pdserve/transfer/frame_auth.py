"""Authenticated control frames: an HMAC over every message, with replay protection.

A control message on the wire is `[auth, body, *bulk frames]` (bulk frames: KV page bytes on
the tcp backend, transfer/bulk.py). The auth frame is:

    magic "PDA2" (4) | session (16) | seq (8, big-endian) | time (8, float64 unix)
    | bulk count n (2, big-endian) | mac (32) | n SHA-256 digests (32 each)
    | sender identity (the rest, at most 255 bytes)

`session` is random per sending process and `seq` counts that process's frames (one I/O thread
sends them all, so it only grows). `mac` = HMAC-SHA256(control sub-key, sender identity |
session | seq | time | n | every frame but the last n, with its length | the n digests): the
last n frames are covered by their digests (hash, then MAC), which the receiver checks before
it reads them (`Bulk.checked`), off this thread; every other frame is covered whole. The body
is never bulk. The receiver checks, in this order and before anything parses the body
(LESSONS #15: a stranger's frame is never read):
0. where the receiver sets an `InboundLimit` (a prefill worker: docs in
   transfer/control_limits.py), the message has at most that many frames and bytes; this
   costs nothing, so an oversized frame is refused before a byte of it is hashed (LESSONS #18);
1. the auth frame has the right size and magic for its n (the body and at least one frame
   before the bulk ones), the sender it names is the ZMQ routing identity where there is one
   (P's ROUTER socket), and the MAC matches (constant time);
2. the frame is recent: |time - now| <= MAX_SKEW_S (so a captured frame is useless later);
3. `seq` is above the last one seen from that (sender, session) (so it is useless now too).
The receiver remembers at most MAX_SESSIONS senders' sessions; one not heard from for longer
than the skew window is forgotten (its frames would fail check 2 anyway).

Clock assumption: the hosts' clocks agree within MAX_SKEW_S (the fence margin of
worker/decode/role.py asks for much less: docs/architecture.md §Clocks).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.timing import MAX_SKEW_S
from pdserve.transfer.bulk import DIGEST_LEN, Frame

MAGIC = b"PDA2"
_HEAD = struct.Struct(">4s16sQdH")  # magic, session, seq, time, bulk count
MAC_LEN = 32
MAX_IDENTITY = 255
MAX_SESSIONS = 4096
MAX_AUTH_BYTES = _HEAD.size + MAC_LEN + MAX_IDENTITY  # the longest auth frame without bulk


@dataclass(frozen=True)
class InboundLimit:
    """The most frames (auth included) and bytes (all frames) a message may have."""

    max_frames: int
    max_bytes: int


class Refusal(Enum):
    """Why a frame was dropped unread (counted per kind in the control stats)."""

    TOO_LARGE = "auth_too_large"  # more frames or bytes than the receiver's InboundLimit
    MISSING = "auth_missing"  # no frame at all, or the auth frame has the wrong size or magic
    WRONG_SENDER = "auth_wrong_sender"  # it names another sender than its routing identity
    BAD_MAC = "auth_bad_mac"  # not signed with this cluster's key (or altered)
    STALE = "auth_stale"  # outside the clock window
    REPLAY = "auth_replay"  # a sequence number already seen from that sender
    SESSIONS_FULL = "auth_sessions_full"  # too many live senders to remember another


class FrameAuth:
    """Signs outgoing frames and checks incoming ones; used by the control I/O thread only."""

    def __init__(self, key: ClusterKey, identity: str) -> None:
        self._mac_key = key.derive("control")
        self._identity = identity.encode()
        if len(self._identity) > MAX_IDENTITY:
            raise ValueError(f"a control identity is at most {MAX_IDENTITY} bytes")
        self._session = secrets.token_bytes(16)
        self._seq = 0
        # (sender, session) -> (last seq, last time heard), least recently heard first.
        self._seen: OrderedDict[tuple[bytes, bytes], tuple[int, float]] = OrderedDict()

    def _mac(self, sender: bytes, head: bytes, frames: Sequence[Frame], digests: bytes) -> bytes:
        h = hmac.new(self._mac_key, digestmod=hashlib.sha256)
        h.update(struct.pack(">H", len(sender)) + sender + head)
        for f in frames:
            h.update(struct.pack(">Q", len(f)))
            h.update(f)
        h.update(digests)
        return h.digest()

    def sign(self, frames: Sequence[bytes], digests: Sequence[bytes] = ()) -> list[bytes]:
        """`[auth, *frames]` for sending as one multipart message, with the bulk frames whose
        SHA-256 `digests` are given sent after them (transfer/bulk.py)."""
        if digests and not frames:
            raise ValueError("bulk frames follow a body")
        self._seq += 1
        head = _HEAD.pack(MAGIC, self._session, self._seq, time.time(), len(digests))
        tail = b"".join(digests)
        mac = self._mac(self._identity, head, frames, tail)
        return [head + mac + tail + self._identity, *frames]

    def check(
        self, routing_id: str | None, parts: Sequence[Frame], limit: InboundLimit | None = None
    ) -> Refusal | None:
        """None if `parts` ([auth, *frames, *bulk frames]) is a fresh frame signed by a member
        of this cluster; its bulk frames are covered by their digests (`digests`), which
        whoever reads them checks first.

        `routing_id`: the sender's ZMQ identity where the socket reports one (a ROUTER); the
        frame must name the same sender. `limit`: refuse a larger message before hashing it."""
        if limit is not None and (
            len(parts) > limit.max_frames or sum(map(len, parts)) > limit.max_bytes
        ):
            return Refusal.TOO_LARGE
        fixed = _HEAD.size + MAC_LEN
        if not parts or len(parts[0]) < fixed:
            return Refusal.MISSING
        auth = bytes(parts[0])
        head = auth[: _HEAD.size]
        magic, session, seq, sent_at, n = _HEAD.unpack(head)
        tail_end = fixed + DIGEST_LEN * n
        if magic != MAGIC or not tail_end <= len(auth) <= tail_end + MAX_IDENTITY:
            return Refusal.MISSING
        if n and n > len(parts) - 2:  # the body and any frame before the bulk are MACed whole
            return Refusal.MISSING
        mac, tail = auth[_HEAD.size : fixed], auth[fixed:tail_end]
        sender = auth[tail_end:]
        if routing_id is not None and sender != routing_id.encode():
            return Refusal.WRONG_SENDER
        whole = parts[1 : len(parts) - n]
        if not hmac.compare_digest(mac, self._mac(sender, head, whole, tail)):
            return Refusal.BAD_MAC
        now = time.time()
        if not abs(now - sent_at) <= MAX_SKEW_S:  # `not <=` also refuses NaN
            return Refusal.STALE
        key = (sender, session)
        last = self._seen.get(key)
        if last is not None and seq <= last[0]:
            return Refusal.REPLAY
        if last is None and not self._make_room(now):
            return Refusal.SESSIONS_FULL
        self._seen[key] = (seq, now)
        self._seen.move_to_end(key)
        return None

    @staticmethod
    def digests(auth: bytes) -> tuple[bytes, ...]:
        """The bulk frames' digests an auth frame carries (one `check` passed)."""
        n = _HEAD.unpack(auth[: _HEAD.size])[-1]
        at = _HEAD.size + MAC_LEN
        return tuple(auth[at + DIGEST_LEN * i : at + DIGEST_LEN * (i + 1)] for i in range(n))

    def _make_room(self, now: float) -> bool:
        """Forget sessions silent for longer than the skew window; False if still full."""
        while self._seen:
            _, (_, heard) = next(iter(self._seen.items()))
            if now - heard <= 2 * MAX_SKEW_S:
                break
            self._seen.popitem(last=False)
        return len(self._seen) < MAX_SESSIONS
