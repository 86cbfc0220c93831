"""Freezing the startup heap: a server's long-lived objects leave the cyclic collector's scans.

Python's cyclic garbage collector walks every tracked container object on each full (oldest
generation) collection. A serving process allocates a few objects per token (outputs, lists),
so full collections keep coming, and each one walks the whole heap: the model's modules and
tensors, the tokenizer's tables, the imported libraries: a full collection is then a stall of
a whole decode step or more in the ITL tail. After `gc.freeze()` following startup a full
collection has almost nothing to walk, and none ran in a measured decode
(benchmarks/RESULTS.md, 2026-12-01 second session). vLLM and SGLang freeze their startup heap the
same way. Frozen objects are still freed by reference counting; only cycles among them are no
longer collected, and startup makes none that die.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then move every surviving object out of the collector's scans (call
    when startup is over: model loaded, graphs captured, app built). Returns how many."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d startup objects out of the garbage collector's scans", frozen)
    return frozen
