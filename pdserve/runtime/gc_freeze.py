"""Freezing the startup heap: a server's long-lived objects leave the cyclic collector's scans.

Python's cyclic garbage collector walks every tracked container object on each full (oldest
generation) collection. A serving process allocates a few objects per token (outputs, lists),
so full collections keep coming, and each one walks the whole heap: the model's modules and
tensors, the tokenizer's tables, the imported libraries. Measured on the 2-core VM: with
transformers imported (as a benchmark process has it), 337,000 tracked objects and one full
collection of 186 ms in the middle of a batch-256 decode; after `gc.freeze()` following
startup, 266 tracked objects and no full collection in 200 steps (`tick` 3.4 -> 2.1 ms on
average, and no 186 ms stall in the ITL tail). vLLM and SGLang freeze their startup heap the
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
