"""How a KV write fails, as the prefill role sees it (every backend raises these)."""

from __future__ import annotations


class WriteError(RuntimeError):
    """A KV write failed (the peer's memory is gone, the send queue refused it)."""


class PeerGone(WriteError):
    """The transfer layer says the peer disconnected: every write to it is lost, not just one."""
