"""The engine's limits that the user left to us, from the model and the device (issue 38 item 5).

`serve` leaves `--kv-budget-mb`, `--max-model-len`, `--max-running` and `--max-batched-tokens`
unset unless given; `EngineConfig.auto` names those left unset, and `Engine.build` resolves them
here once the model's weights are on the device, then logs one line saying what it chose and why.

The rules, written once (docs/architecture.md §Sizing; the figures behind them in
benchmarks/RESULTS.md):

* **KV budget.** On CUDA, vLLM's rule: this worker may hold `gpu_memory_utilization` of the
  card's memory (`pdserve launch` divides it among the workers that share a card); what its
  weights hold already and an activation reserve for the largest step are taken off, and the
  rest is the KV pool. A share larger than the memory still free is refused, naming the flags
  (another process holds part of it). On a CPU, CPU_KV_BUDGET.
* **Context** (`max_model_len`): the model's own (`max_position_embeddings`); the engine then
  caps it by what the pool holds, so one request always fits.
* **Requests in flight** (`max_running`): on CUDA, CUDA_MAX_RUNNING, the largest decode batch
  the CUDA graphs replay by default, where a batch of 1B-class decodes is still bound by memory
  bandwidth; on a CPU, CPU_MAX_RUNNING.
* **Step budget** (`max_batched_tokens`): on CUDA, room for every request in flight to decode
  plus a prompt chunk of CUDA_PROMPT_CHUNK tokens (`max_running + CUDA_PROMPT_CHUNK`), so the
  share of a step left for prompts does not shrink as the decode batch grows: with a fixed
  1024-token step, 512 decode rows left prompts 512 tokens a step, and admitting 512 new
  256-token prompts took hundreds of steps (TTFT p99 1.4 s on an H100,
  benchmarks/RESULTS.md). A 1024-token chunk was measured best at concurrency 128 (14% more
  than a 4096-token step, with a third of the TTFT); a step stays within the CUDA graphs'
  `cuda_graph_max_tokens` up to 1024 requests in flight. On a CPU, CPU_MAX_BATCHED_TOKENS.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.model.config import ModelArch

log = logging.getLogger(__name__)

CPU_KV_BUDGET = 256 * 2**20
CPU_MAX_RUNNING = 64
CPU_MAX_BATCHED_TOKENS = 512
CUDA_MAX_RUNNING = 256
CUDA_PROMPT_CHUNK = 1024  # a step's tokens for prompts, beside one per request in flight
# Memory a step needs beyond the weights and the KV pool, besides what scales with the step:
# the CUDA graphs' pools, cuBLAS workspaces, the allocator's slack.
FIXED_RESERVE = 1 << 30
MIN_KV_BUDGET = 64 * 2**20  # below this a card is too full to serve: say so, do not start


@dataclass(frozen=True)
class DeviceMemory:
    """What the card has, read once the weights are loaded (all in bytes)."""

    total: int
    free: int  # free on the card now (other processes' use taken off)
    held: int  # what this process holds already (its weights, torch's reserve)


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The card's memory as this process sees it now; None for a CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, free=free, held=torch.cuda.memory_reserved(device))


def activation_reserve(arch: ModelArch, max_batched_tokens: int, max_running: int) -> int:
    """Bytes the largest step may need besides weights and KV: a step's hidden states and MLP
    activations (a few live at once, 2-byte), the logits of a full decode batch in float32
    with the sampler's copies, and FIXED_RESERVE."""
    hidden = max_batched_tokens * (8 * arch.hidden_size + 3 * arch.intermediate_size) * 2
    logits = max_running * arch.vocab_size * 4 * 3
    return hidden + logits + FIXED_RESERVE


def resolve(
    cfg: EngineConfig, arch: ModelArch, memory: DeviceMemory | None
) -> tuple[EngineConfig, str]:
    """`cfg` with its `auto` limits chosen (`memory`: None on a CPU), and one line saying what
    each limit is and where it came from."""
    sched, cache = cfg.scheduler, cfg.cache
    auto = cfg.auto
    cuda = memory is not None
    said: list[str] = []

    def pick(name: str, given: int, cpu: int, gpu: int) -> int:
        if name not in auto:
            said.append(f"{name}={given} (given)")
            return given
        value = gpu if cuda else cpu
        said.append(f"{name}={value} ({'the card' if cuda else 'a CPU'}'s default)")
        return value

    max_running = pick("max_running", sched.max_running, CPU_MAX_RUNNING, CUDA_MAX_RUNNING)
    if "max_batched_tokens" not in auto:
        max_batched = sched.max_batched_tokens
        said.append(f"max_batched_tokens={max_batched} (given)")
    elif cuda:
        max_batched = max_running + CUDA_PROMPT_CHUNK
        said.append(
            f"max_batched_tokens={max_batched} (a decode per request in flight and a "
            f"{CUDA_PROMPT_CHUNK}-token prompt chunk)"
        )
    else:
        max_batched = CPU_MAX_BATCHED_TOKENS
        said.append(f"max_batched_tokens={max_batched} (a CPU's default)")
    if "max_model_len" in auto:
        max_model_len = arch.max_position_embeddings
        said.append(f"max_model_len={max_model_len} (the model's context)")
    else:
        max_model_len = sched.max_model_len
        said.append(f"max_model_len={max_model_len} (given)")
    budget = cache.kv_budget_bytes
    if "kv_budget" not in auto:
        said.append(f"kv_budget={budget / 2**20:.0f} MiB (given)")
    elif memory is None:
        budget = CPU_KV_BUDGET
        said.append(f"kv_budget={budget / 2**20:.0f} MiB (a CPU's default)")
    else:
        budget, why = _cuda_budget(cfg, arch, memory, max_batched, max_running)
        said.append(f"kv_budget={budget / 2**20:.0f} MiB ({why})")
    out = dataclasses.replace(
        cfg,
        cache=dataclasses.replace(cache, kv_budget_bytes=budget),
        scheduler=dataclasses.replace(
            sched,
            max_running=max_running,
            max_batched_tokens=max_batched,
            max_model_len=max_model_len,
        ),
        auto=frozenset(),
    )
    return out, ", ".join(said)


def _cuda_budget(
    cfg: EngineConfig, arch: ModelArch, memory: DeviceMemory, max_batched: int, max_running: int
) -> tuple[int, str]:
    share = cfg.cache.gpu_memory_utilization
    reserve = activation_reserve(arch, max_batched, max_running)
    budget = int(share * memory.total) - memory.held - reserve
    why = (
        f"{share:.2f} of {memory.total / 2**30:.1f} GiB, less {memory.held / 2**30:.1f} GiB "
        f"held and a {reserve / 2**30:.1f} GiB activation reserve"
    )
    if budget + reserve > memory.free:
        # Another process holds part of our share: taking what is free would count its own
        # reserve, not yet allocated, as ours, and the card would overflow at both peaks.
        raise ValueError(
            f"this worker's share of the card ({why}) is more than the "
            f"{memory.free / 2**30:.1f} GiB free (another process, or this one's CUDA context, "
            "holds the rest); lower "
            "--gpu-memory-utilization (pdserve launch divides it among its workers) or give "
            "--kv-budget-mb"
        )
    if budget < MIN_KV_BUDGET:
        raise ValueError(
            f"no room for a KV pool on this card: {why} leaves {budget / 2**20:.0f} MiB; "
            "lower --max-batched-tokens or --max-running, raise --gpu-memory-utilization, "
            "or give --kv-budget-mb"
        )
    return budget, why
