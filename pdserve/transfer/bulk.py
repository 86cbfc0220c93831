"""Bulk frames: the KV page bytes that follow a control message (tcp backend), hashed then MACed.

An HMAC over every KV byte put all of the hashing on the two control threads, one core each. So
a bulk frame is hashed where it is made and where it is used, and the control threads sign and
check only its digest:
* the sender computes each frame's SHA-256 (`Bulk.seal`: on P's data-plane thread with the frame
  workers, transfer/frame_workers.py);
* the auth frame carries the digests under its MAC (transfer/frame_auth.py), so signing a chunk
  of pages costs what signing a Ping does;
* the receiver checks each frame against its digest before anything reads it (`Bulk.checked`:
  on D's stager thread, transfer/stager.py), never on the control thread.
The digests are authenticated and SHA-256 is collision resistant, so a frame that matches its
digest is as authentic as one under the HMAC. A frame that does not is refused (`BulkRefused`)
and its chunk with it.

`Bulk` is loud on misuse: the frames of one that came off the wire cannot be read before they
were checked.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from pdserve.transfer.frame_workers import FrameWorkers

Frame = bytes | memoryview  # a frame's bytes: the sender's own buffer, or ZMQ's on receipt
DIGEST_LEN = 32


class BulkRefused(ValueError):
    """A bulk frame that does not match its authenticated digest (or the digests' count)."""


def digest(frame: Frame) -> bytes:
    return hashlib.sha256(frame).digest()


class Bulk:
    """A message's bulk frames and their SHA-256 digests, checked or not yet."""

    def __init__(self, frames: Sequence[Frame], digests: Sequence[bytes], checked: bool) -> None:
        if len(frames) != len(digests) or any(len(d) != DIGEST_LEN for d in digests):
            raise BulkRefused(f"{len(frames)} bulk frames for {len(digests)} digests")
        self._frames = tuple(frames)
        self.digests = tuple(digests)
        self._checked = [checked] * len(frames)

    @classmethod
    def seal(cls, frames: Sequence[Frame], workers: FrameWorkers | None = None) -> Bulk:
        """The sender's: `frames` with their digests, computed on the workers where given."""
        if workers is None:
            digests: Sequence[bytes] = [digest(f) for f in frames]
        else:
            digests = workers.map(lambda i: digest(frames[i]), len(frames))
        return cls(frames, digests, checked=True)

    @classmethod
    def received(cls, frames: Sequence[Frame], digests: Sequence[bytes]) -> Bulk:
        """The receiver's: frames whose digests came under a valid MAC, not checked yet."""
        return cls(frames, digests, checked=False)

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def sizes(self) -> list[int]:
        """Each frame's length (reading a length reads no byte of it)."""
        return [len(f) for f in self._frames]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def checked(self, i: int) -> Frame:
        """Frame `i`, once it matches its digest; raises BulkRefused if it does not."""
        frame = self._frames[i]
        if not self._checked[i]:
            if not hmac.compare_digest(digest(frame), self.digests[i]):
                raise BulkRefused(f"bulk frame {i} of {len(self)} does not match its digest")
            self._checked[i] = True
        return frame

    def frames(self, workers: FrameWorkers | None = None) -> tuple[Frame, ...]:
        """Every frame, each checked (on the workers where given); raises BulkRefused."""
        if workers is None:
            return tuple(self.checked(i) for i in range(len(self)))
        return tuple(workers.map(self.checked, len(self)))
