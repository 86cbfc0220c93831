"""One rank's place in a tensor-parallel group, and the collectives its model layers call.

A worker with `--tp N` runs N ranks; each holds a shard of every layer's weights and they
combine partial results with two collectives: a sum (a row-parallel product, the vocab-parallel
embedding) and a gather along the last dim (the vocab-parallel LM head's logits); data-parallel
attention adds a gather of rows and a reduce-scatter of rows (parallel/dp_tokens.py). `RankGroup`
is those verbs over a `torch.distributed` process group, and nothing else: which step runs
is the leader's decision, broadcast to the others, never made here (LESSONS #12).

At TP 1 (`RankGroup.single()`) there is no process group at all and both verbs return their
input: a TP-1 model never touches torch.distributed.

Every collective is bounded by the group's timeout (`timeout_s`, passed to
`init_process_group`; runtime/timing.py `TP_COLLECTIVE_TIMEOUT_S` is pdserve's): on gloo a
collective that a peer has not joined within it raises `CollectiveError` on the ranks that
did; on NCCL the process group's watchdog aborts the communicator and ends the process after it
(TORCH_NCCL_ASYNC_ERROR_HANDLING's default), so a rank that died or skipped a step never
leaves the others waiting forever (LESSONS #21).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class CollectiveError(RuntimeError):
    """A collective failed on this rank: on gloo, most often it did not complete within the
    group's timeout because a peer rank died, hangs, or did not join it (it took another
    branch: a bug in the plan's broadcast). The message names this rank, the collective and
    the bound, then the backend's own error."""


class RankGroup:
    """This rank (`rank` of `world_size`) and the collectives over its process group.

    Collectives are called by every rank of the group in the same order with tensors of the
    same shape; a rank that skips one leaves the others in it until the timeout."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        timeout_s: float | None = None,
        store: dist.Store | None = None,
    ) -> None:
        """`group`: the process group of these ranks (None only at world 1); `timeout_s`: the
        bound it was made with (named in errors); `store`: the group's key-value store (for
        waits longer than a collective may take: `mark`, `wait_mark`)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of a group of {world_size}")
        if (group is None) != (world_size == 1):
            raise ValueError(
                f"a group of {world_size} ranks needs a process group"
                if group is None
                else "a group of 1 rank runs without a process group (RankGroup.single())"
            )
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.timeout_s = timeout_s
        self.store = store

    @classmethod
    def single(cls) -> RankGroup:
        """TP 1: rank 0 of 1, no torch.distributed; every collective returns its input."""
        return cls(0, 1, None)

    @classmethod
    def init(
        cls,
        rank: int,
        world_size: int,
        *,
        host: str,
        port: int,
        backend: str,
        timeout_s: float,
        join_timeout_s: float | None = None,
    ) -> RankGroup:
        """Join (rank 0: create) the process group whose store rank 0 serves on host:port (an
        IPv4 address), as torch.distributed's default group; blocks until all `world_size`
        ranks joined, at most `join_timeout_s` (default `timeout_s`: ranks that start as
        processes first import torch, slower than a collective is allowed to be), then
        `timeout_s` bounds every collective. World 1 is `single()`.

        Rank 0 binds the store's socket to `host` itself (TCPStore would listen on every
        interface). Gloo's own connections use the interface GLOO_SOCKET_IFNAME names (`lo`
        for ranks on one host), else the host name's address."""
        if backend not in BACKENDS:
            raise ValueError(f"tensor-parallel backend must be one of {BACKENDS}, not {backend!r}")
        if world_size == 1:
            return cls.single()
        timeout = timedelta(seconds=timeout_s)
        join = timedelta(seconds=timeout_s if join_timeout_s is None else join_timeout_s)
        fd: int | None = None
        if rank == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
                fd = s.detach()  # the store owns it from here: its server closes it
        try:
            store = dist.TCPStore(
                host, port, world_size, is_master=rank == 0, timeout=join, master_listen_fd=fd
            )
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        return cls(rank, world_size, dist.group.WORLD, timeout_s, store)

    def mark(self, key: str) -> None:
        """Set `key` in the group's store: what `wait_mark` waits for on the other ranks."""
        if self.store is None:
            raise RuntimeError("a group without a store (world 1) marks nothing")
        self.store.set(key, "1")

    def wait_mark(self, key: str, timeout_s: float) -> None:
        """Wait until some rank `mark`ed `key`, at most `timeout_s` (a wait longer than any
        collective may take: a follower waiting for the leader's load); CollectiveError past it."""
        if self.store is None:
            raise RuntimeError("a group without a store (world 1) waits for nothing")
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistStoreError) as e:
            raise CollectiveError(
                f"rank {self.rank}: {key!r} was not marked within {timeout_s:g}s: {e}"
            ) from e

    def close(self) -> None:
        """Leave the process group (every rank closes its own); world 1: nothing to do."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    # -- the collectives the model's layers call ---------------------------------------------
    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x must be contiguous); returns x."""
        if self.world_size == 1:
            return x
        self._bounded("all_reduce_sum", x, lambda: dist.all_reduce(x, group=self.group))
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] on each rank -> [..., world_size * d], rank 0's columns first."""
        return self._all_gather(x, -1, "all_gather_last_dim")

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] on each rank (the same n) -> [world_size * n, ...], rank 0's rows first."""
        return self._all_gather(x, 0, "all_gather_rows")

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[world_size * n, ...] on each rank -> rows [rank * n, (rank + 1) * n) summed over
        the ranks, [n, ...] (x must be contiguous)."""
        if self.world_size == 1:
            return x
        if x.shape[0] % self.world_size:
            raise ValueError(f"{x.shape[0]} rows do not split over {self.world_size} ranks")
        out = x.new_empty(x.shape[0] // self.world_size, *x.shape[1:])
        # (reduce_scatter_tensor's newer name, where this torch has it)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._bounded("reduce_scatter_rows", x, lambda: scatter(out, x, group=self.group))
        return out

    def _all_gather(self, x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._bounded(what, x, lambda: dist.all_gather(parts, x, group=self.group))
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x of rank `src` on every rank, in place (the others' x: a buffer of the same shape
        and dtype); returns x. The leader's step records travel this way (parallel/lockstep.py)."""
        if self.world_size == 1:
            return x
        self._bounded("broadcast", x, lambda: dist.broadcast(x, src, group=self.group))
        return x

    def _bounded(self, what: str, x: torch.Tensor, call: Callable[[], object]) -> None:
        """Run one collective; the backend's error (gloo raises a RuntimeError at the timeout)
        becomes CollectiveError, naming this rank and the collective."""
        try:
            call()
        except RuntimeError as e:
            raise CollectiveError(
                f"rank {self.rank} of {self.world_size}: {what} of {tuple(x.shape)} failed "
                f"(bound {self.timeout_s} s; a peer rank died, hangs, or skipped it): {e}"
            ) from e

    def __repr__(self) -> str:
        return f"RankGroup(rank={self.rank}, world_size={self.world_size})"
