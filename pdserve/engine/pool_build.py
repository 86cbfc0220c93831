"""An engine's KV pool, sized from its budget, and at TP > 1 its ranks' (engine/engine.py builds
with it): the layout the model needs, as many pages as the budget holds beside the per-request
state slots, the followers told the same (SETUP), and for a PD role every rank's pool as the
whole model's pages (kvcache/rank_pages.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdserve.config import EngineConfig
from pdserve.engine.tp_leader import TpLeader
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPool, pages_for_budget
from pdserve.kvcache.rank_pages import RankPages
from pdserve.model.config import ModelArch
from pdserve.parallel.step_record import PoolPlan

log = logging.getLogger(__name__)


def build_pool(
    cfg: EngineConfig,
    arch: ModelArch,
    device: torch.device,
    shared: bool,
    tp: TpLeader | None,
    pd: bool,
) -> tuple[KVPool, RankPages | None]:
    """Rank 0's pool for `arch` (this rank's view of the model) on `device` (`shared`: in
    /dev/shm, for a decode worker on shm); with `tp`, the followers' pools of the same pages
    and, for a PD role (`pd`), every rank's pool as the whole model's pages (else None)."""
    c = cfg.cache
    # DeepSeek-V4's page ends serve only a resume from the prefix cache.
    layout = KVLayout.for_model(
        arch, cfg.model.dtype, c.page_size, c.index_k_dtype, c.kv_dtype, c.prefix_cache,
        tp_rank=0, tp_size=cfg.tp,
    )  # fmt: skip
    if layout.page_size != c.page_size:
        log.info("KV pages of %d tokens (the model's windows)", layout.page_size)
    slots = cfg.scheduler.max_running if layout.state else 0  # one per running request
    num_pages = pages_for_budget(layout, c.kv_budget_bytes, slots)
    dp = cfg.tp if cfg.dp_attention else 1  # the allocator hands out every rank's pages
    pool = KVPool(layout, num_pages, device, shared=shared, state_slots=slots, dp_ranks=dp)
    log.info(
        "KV pool: %d pages x %d tokens = %d tokens (%.1f MiB)%s",
        num_pages,
        layout.page_size,
        pool.capacity_tokens,
        pool.data.numel() / 2**20,
        f" on each of {dp} data-parallel ranks" if dp > 1 else "",
    )
    if tp is None:
        return pool, None
    tp.setup(PoolPlan(num_pages, layout.page_size, shared=pd))  # every rank's pool: these pages
    if not pd:
        return pool, None
    whole = KVLayout.for_model(
        ModelArch.from_dir(Path(cfg.model.path)), cfg.model.dtype, c.page_size,
        c.index_k_dtype, c.kv_dtype, c.prefix_cache,
    )  # fmt: skip
    return pool, tp.pages(whole, pool, dp=cfg.dp_attention)
