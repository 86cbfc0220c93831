"""The multi-turn chat workload of benchmarks/serving/prefix.py: its prompts, and driving it.

One shared system prompt; conversations of turns, all open at once, at most --concurrency
requests in flight. Each conversation's turns go in order, so conversations interleave as
users' do; every turn's prompt is the conversation so far (the system prompt, each earlier
"User: ..." message and the model's answer) plus a new user message. Requests stream through
/v1/completions; each turn records its client TTFT, latency, token counts and any error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

REQUEST_TIMEOUT_S = 600.0
VOCABULARY = (  # the words of the generated prompts
    "the cache page token model answer system prompt request worker router decode prefill "
    "memory layout buffer stream latency batch schedule evict host device policy shared turn "
    "question careful explain reason step result check value table index chain hash"
)
WORDS = VOCABULARY.split()


def text_of(tokenizer: Any, rng: random.Random, tokens: int, lead: str) -> str:
    """`lead` plus random words until the text is about `tokens` tokens long."""
    words = [lead]
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += [rng.choice(WORDS) for _ in range(8)] + ["."]
    return " ".join(words)


@dataclass
class Workload:
    system: str
    users: list[list[str]]  # per conversation, per turn


def make_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    rng = random.Random(args.seed)
    system = text_of(tokenizer, rng, args.system_tokens, "System: you are a careful assistant.")
    users = [
        [
            text_of(tokenizer, rng, args.user_tokens, f"Conversation {c}, question {t}:")
            for t in range(args.turns)
        ]
        for c in range(args.conversations)
    ]
    return Workload(system, users)


@dataclass
class Turn:
    ttft: float | None = None
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


@dataclass
class RunResult:
    turns: list[Turn] = field(default_factory=list)
    duration_s: float = 0.0
    cache: dict[str, float] = field(default_factory=dict)  # counter deltas over the run


async def one_turn(
    session: aiohttp.ClientSession, url: str, prompt: str, args: argparse.Namespace
) -> tuple[Turn, str]:
    body = {
        "prompt": prompt,
        "max_tokens": args.output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    turn, text = Turn(), []
    sent = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                turn.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return turn, ""
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                if "error" in obj:
                    turn.error = json.dumps(obj["error"])[:200]
                for choice in obj.get("choices") or []:
                    if choice.get("text") and turn.ttft is None:
                        turn.ttft = time.perf_counter() - sent
                    text.append(choice.get("text") or "")
                    if choice.get("finish_reason") not in (None, "stop", "length"):
                        turn.error = f"finish_reason {choice['finish_reason']}"
                usage = obj.get("usage") or {}
                turn.prompt_tokens = usage.get("prompt_tokens", turn.prompt_tokens)
                turn.output_tokens = usage.get("completion_tokens", turn.output_tokens)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        turn.error = f"{type(e).__name__}: {e}"
    turn.latency = time.perf_counter() - sent
    return turn, "".join(text)


async def drive(url: str, work: Workload, args: argparse.Namespace) -> RunResult:
    result = RunResult()
    slots = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def conversation(session: aiohttp.ClientSession, users: list[str]) -> None:
        history = work.system
        for msg in users:
            prompt = f"{history}\nUser: {msg}\nAssistant:"
            async with slots:  # a slot per request: every conversation stays open throughout
                turn, answer = await one_turn(session, url, prompt, args)
            result.turns.append(turn)
            if turn.error is not None:
                return  # the rest of this conversation would not be the same workload
            history = prompt + answer

    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(session, u) for u in work.users))
        result.duration_s = time.perf_counter() - t0
    return result


async def warm_up(url: str, args: argparse.Namespace) -> None:
    """Two requests on a prompt no conversation shares, the second continuing the first."""
    base = "Warm-up. " + " ".join(f"w{i}" for i in range(max(8, args.system_tokens // 2)))
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for prompt in (base, f"{base} Again."):
            turn, _ = await one_turn(session, url, prompt, args)
            if turn.error is not None:
                raise RuntimeError(f"the warm-up request failed: {turn.error}")
