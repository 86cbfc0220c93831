"""A worker's KV pages as the whole model's layout, over its tensor-parallel ranks' pools.

At `--tp N` every rank keeps a pool of the same pages. A Llama-family rank holds k and v of the
KV heads its shard reads (`kv_heads_of`: KV heads split over the ranks, or one shared head per
rank when there are fewer heads than ranks); a DeepSeek rank (expert parallel: attention whole
on every rank, model/moe.py) holds all of its latent and index-K, the same on every rank. What
crosses between workers is always the whole model's page (the layout at TP 1), whatever either
side's TP: P reads its pages assembled from its ranks' pools (or rank 0's, all alike), D's
pages are written by splitting the whole page over its ranks' (or whole into each). So the
Register handshake compares whole layouts as at TP 1, the data planes move whole pages as at
TP 1, and P at TP a serves D at TP b for any a and b.

The leader reaches its followers' pools as shared memory (each follower places its pool in
/dev/shm and gives its `ShmRef` in one all-gather over the group after SETUP; the leader maps
it with `pool.map_shared`, which accepts only a pdserve pool of the right size, owned by that
follower); a peer P maps a D's rank pools the same way from its Register. Pools on a GPU are
not shared this way: PD at TP > 1 runs on the CPU (config.py refuses it on CUDA).

With data-parallel attention (`--dp`, `dp`) the ranks' pools hold different pages: a worker's
pages are numbered over its ranks' pools, rank r's following rank r - 1's (its allocator's parts,
kvcache/allocator.py), each page whole (MLA) in the one pool that holds it; `read` and `write`
go to that pool, and a D's Register says `dp` so that its P numbers them alike.

At TP 1 `RankPages` is the one pool: `read` gives the pool's pages and `write` copies per page,
as the data planes did before ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool, ShmRef
from pdserve.runtime.gpu_wait import wait_event

REF_WORDS = 4  # a pool reference as int64 words: pid, fd, and the token's 16 bytes


def kv_heads_of(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads (of the whole model's `num_kv_heads`) rank `rank` of `tp_size` holds: an
    equal share when they split, else (fewer heads than ranks) the one head its share of the
    query heads reads. The rule of parallel/layers.py `Part.rows` for k and v."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not one of {tp_size} tensor-parallel ranks")
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    if tp_size % num_kv_heads == 0:
        head = rank * num_kv_heads // tp_size
        return range(head, head + 1)
    raise ValueError(f"{num_kv_heads} KV heads neither split nor replicate over {tp_size} ranks")


def ref_words(ref: ShmRef | None) -> torch.Tensor:
    """A rank's pool reference as REF_WORDS int64 (zeros: none), for the ranks' all-gather."""
    if ref is None:
        return torch.zeros(1, REF_WORDS, dtype=torch.int64)
    token = bytes.fromhex(ref.token)
    words = [ref.pid, ref.fd, *(int.from_bytes(token[i : i + 8], "little", signed=True)
                                for i in (0, 8))]  # fmt: skip
    return torch.tensor([words], dtype=torch.int64)


def ref_of(words: list[int]) -> ShmRef:
    """`ref_words`' reference (`map_shared` checks what it names)."""
    if len(words) != REF_WORDS or words[0] <= 0:
        raise ValueError("a rank published no shared pool")
    token = b"".join(w.to_bytes(8, "little", signed=True) for w in words[2:])
    return ShmRef(words[0], words[1], token.hex())


def split_by_head(layout: KVLayout) -> bool:
    """Whether ranks split this KV by head (k and v); else every rank holds all of it (MLA's
    latent and index-K: attention is whole on every expert-parallel rank)."""
    return {b.name for b in layout.buffers} == {"k", "v"}


def rank_layout(whole: KVLayout, tp_size: int, rank: int) -> KVLayout:
    """Rank `rank`'s layout when the whole model's KV is `whole` and it runs at `tp_size`."""
    if whole.tp_size != 1:
        raise ValueError(
            f"rank_layout takes the whole model's layout, not a rank's of {whole.tp_size}"
        )
    if tp_size == 1:
        return whole
    if whole.state:
        raise ValueError("per-request state (DeepSeek-V4) runs at tensor parallelism 1 only")
    if not split_by_head(whole):
        return replace(whole, tp_rank=rank, tp_size=tp_size)
    heads = kv_heads_of(whole.num_kv_heads, tp_size, rank)
    return KVLayout.llama(
        whole.buffer("k").dtype, whole.page_size, whole.num_layers, len(heads), whole.head_dim,
        rank, tp_size,
    )  # fmt: skip


class RankPages:
    """The pages of `pools` (each rank's bytes [rows, its page_bytes], rank 0's first) as the
    whole model's `layout`. Pages are numbered as in every rank's pool (the same pages), or with
    `dp` over the pools in turn (each rank's own pages)."""

    def __init__(
        self,
        whole: KVLayout,
        pools: Sequence[torch.Tensor],
        refs: Sequence[ShmRef | None] = (),
        dp: bool = False,
    ) -> None:
        """`refs`: each pool's shared-memory reference where it has one (what a D's Register
        offers its P for backend shm), rank 0's first. `dp`: data-parallel attention's pools,
        page g being page g % rows of rank g // rows's pool."""
        self.refs = list(refs) or [None] * len(pools)
        if len(self.refs) != len(pools):
            raise ValueError(f"{len(self.refs)} shm references for {len(pools)} pools")
        if whole.tp_size != 1:
            raise ValueError("RankPages takes the whole model's layout (TP 1)")
        self.layout = whole
        self.pools = list(pools)
        self.tp = len(self.pools)
        if self.tp < 1:
            raise ValueError("RankPages needs at least one pool")
        self.rank_layouts = [rank_layout(whole, self.tp, r) for r in range(self.tp)]
        rows = {p.shape[0] for p in self.pools}
        for r, (data, lay) in enumerate(zip(self.pools, self.rank_layouts, strict=True)):
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != lay.page_bytes:
                raise ValueError(
                    f"rank {r}'s pool is {tuple(data.shape)} {data.dtype}, not [rows, "
                    f"{lay.page_bytes}] uint8"
                )
        if len(rows) != 1:
            raise ValueError(f"the ranks' pools differ in pages: {sorted(rows)}")
        self.num_rows = rows.pop()
        self._copy_stream: torch.cuda.Stream | None = None  # copy_out's, made on first use
        self.dp = dp and self.tp > 1
        if self.dp and (split_by_head(whole) or whole.state):
            raise ValueError("data-parallel attention's pages are whole, without state (MLA)")
        self.by_head = self.tp > 1 and not self.dp and split_by_head(whole)
        if self.by_head:
            self._heads = [kv_heads_of(whole.num_kv_heads, self.tp, r) for r in range(self.tp)]
            # each whole head read from the first rank that holds it
            self._reader = {h: r for r in reversed(range(self.tp)) for h in self._heads[r]}

    @classmethod
    def of(cls, pool: KVPool) -> RankPages:
        """One pool's pages (TP 1)."""
        return cls(pool.layout, [pool.data], [pool.shm])

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    @property
    def num_pages(self) -> int:
        """Pages by this numbering: every rank's with `dp`, else one pool's rows."""
        return self.num_rows * self.tp if self.dp else self.num_rows

    def _owner(self, page: int) -> tuple[torch.Tensor, int]:
        """With `dp`: the pool that holds `page`, and its row there."""
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is not one of {self.num_pages}")
        rank, row = divmod(page, self.num_rows)
        return self.pools[rank], row

    def read(self, pages: Sequence[int]) -> list[torch.Tensor]:
        """The whole model's bytes of each of `pages` (uint8 [page_bytes]) on the CPU: at TP 1
        on the CPU views of the pool; from a CUDA pool one gather and one copy to the host."""
        if self.dp:
            return [pool[row].cpu() for pool, row in map(self._owner, pages)]
        first = self.pools[0]  # (without heads to split, every rank's pages are the same)
        if not self.by_head and not first.is_cuda:
            return [first[p] for p in pages]
        idx = torch.tensor(list(pages), dtype=torch.long, device=first.device)
        if not self.by_head:
            return list(first.index_select(0, idx).cpu())
        out = torch.empty(len(idx), self.page_bytes, dtype=torch.uint8)
        rows = [p.index_select(0, idx.to(p.device)).cpu() for p in self.pools]
        for region in self.layout.regions:
            whole = self._typed(out, self.layout, region.layer, region.spec.name)
            for r, lay in enumerate(self.rank_layouts):
                mine = self._typed(rows[r], lay, region.layer, region.spec.name)
                for j, h in enumerate(self._heads[r]):
                    if self._reader[h] == r:
                        whole[:, :, h] = mine[:, :, j]
        return list(out)

    def copy_out(self, pages: Sequence[int]) -> torch.Tensor:
        """A copy of `pages`' whole-model bytes on the host, [len(pages), page_bytes] uint8, that
        no later step touches: from a CUDA pool a DMA per page into pinned memory, on the CPU
        one gather. The caller has waited for the step that computed the pages (a write's
        `ready`): on a GPU the copies run on a stream of their own, so they wait for nothing the
        engine queued since, and return once they are done."""
        first = self.pools[0]
        if self.dp or self.by_head:  # assembled from several pools: already a copy
            return torch.stack(self.read(pages)) if pages else self._empty(0, pin=False)
        if not first.is_cuda:
            return first.index_select(0, torch.tensor(list(pages), dtype=torch.long))
        out = self._empty(len(pages), pin=True)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(first.device)
        with torch.cuda.stream(self._copy_stream):
            for row, page in zip(out, pages, strict=True):
                row.copy_(first[page], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        wait_event(done, "copy of a room's pages out of the GPU pool")
        return out

    def _empty(self, n: int, pin: bool) -> torch.Tensor:
        return torch.empty(n, self.page_bytes, dtype=torch.uint8, pin_memory=pin)

    def write(self, pages: Sequence[int], data: Sequence[torch.Tensor]) -> None:
        """Write the whole model's bytes `data` (one uint8 [page_bytes] per page, any device)
        into `pages` of every rank's pool, each rank taking its heads."""
        if len(data) != len(pages) or any(d.shape != (self.page_bytes,) for d in data):
            raise ValueError(f"{len(data)} rows for {len(pages)} pages of {self.page_bytes} bytes")
        if not pages:
            return
        if self.dp:  # each page whole in the one pool that holds it
            for page, row in zip(pages, data, strict=True):
                pool, at = self._owner(page)
                pool[at].copy_(row)
            return
        if not self.by_head:  # each rank's pages whole
            for dst in self.pools:
                for page, row in zip(pages, data, strict=True):
                    dst[page].copy_(row)  # one contiguous run a page (faster than index_copy_)
            return
        whole_rows = torch.stack([d.cpu() for d in data])  # [n, page_bytes]
        for r, (dst, lay) in enumerate(zip(self.pools, self.rank_layouts, strict=True)):
            part = torch.empty(len(pages), lay.page_bytes, dtype=torch.uint8)
            heads = torch.tensor(list(self._heads[r]), dtype=torch.long)
            for region in self.layout.regions:
                whole = self._typed(whole_rows, self.layout, region.layer, region.spec.name)
                mine = self._typed(part, lay, region.layer, region.spec.name)
                mine.copy_(whole.index_select(2, heads))
            rows = part.to(dst.device)
            for page, row in zip(pages, rows, strict=True):
                dst[page].copy_(row)

    @staticmethod
    def _typed(rows: torch.Tensor, layout: KVLayout, layer: int, name: str) -> torch.Tensor:
        """Buffer `name` of `layer` in `rows` (uint8 [n, page_bytes]): [n, page_size, *shape]."""
        r = layout.region(layer, name)
        typed = rows[:, r.offset : r.offset + r.nbytes].view(r.spec.torch_dtype)
        return typed.view(rows.shape[0], r.spec.rows_per_page(layout.page_size), *r.spec.shape)
