"""One sampling rule for both modes (issue 14 part 2): a seeded request gets the same tokens
when a prefill worker samples its first token and the decode worker the rest as when the
decode worker does everything (its local path: the co-located engine). Real processes, shm."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.model.tokenizer import Tokenizer
from tests.pd.conftest import CHUNK, PD, tokens
from tests.procs import ServerProcess, http, worker_args

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

PROMPTS = [[(13 * i + 7 * j) % 3000 + 3 for j in range(5 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def shm_pd(tiny_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    logs = tmp_path_factory.mktemp("sampler-pd")
    common = worker_args(tiny_dir, "shm", CHUNK)
    with (
        ServerProcess(["serve", "--role", "prefill", *common], logs / "p.log") as p,
        ServerProcess(["serve", "--role", "decode", *common], logs / "d.log") as d,
    ):
        control = http("GET", p.url + "/info")[1]["control"]
        yield PD(p, d, control, "shm")


def both(pd: PD, rid: str, prompt: list[int], **params: Any) -> tuple[list[int], list[int]]:
    """(tokens with a prefill worker, tokens computed by the decode worker alone)."""
    split = tokens(pd.generate(f"{rid}-pd", prompt, **params))
    local = tokens(pd.generate(f"{rid}-local", prompt, prefill=False, **params))
    return split, local


SEEDED = [
    {"temperature": 1.0},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 40},
    {"temperature": 1.2, "min_p": 0.02, "logit_bias": [[5, 4.0], [17, -100]]},
    {"temperature": 0.9, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
    {"temperature": 1.0, "presence_penalty": 1.0, "logprobs": 2},
]


def test_seeded_sampling_is_the_same_with_and_without_a_prefill_worker(shm_pd: PD) -> None:
    differ = []
    for seed in range(20):
        params = SEEDED[seed % len(SEEDED)]
        prompt = PROMPTS[seed % len(PROMPTS)]
        split, local = both(shm_pd, f"s{seed}", prompt, seed=seed, max_tokens=8, **params)
        if split != local:
            differ.append((seed, split, local))
    assert not differ
    shm_pd.wait_quiet()


def test_logit_bias_applies_to_the_prefill_workers_token(shm_pd: PD) -> None:
    split, local = both(shm_pd, "bias", PROMPTS[1], max_tokens=3, logit_bias=[[42, 100]])
    assert split == local == [42, 42, 42]


def test_min_tokens_masks_the_stop_id_on_the_prefill_workers_token(shm_pd: PD) -> None:
    first = tokens(shm_pd.generate("greedy", PROMPTS[2], max_tokens=1, prefill=False))[0]
    split, local = both(
        shm_pd, "mint", PROMPTS[2], max_tokens=4, min_tokens=2, stop_token_ids=[first]
    )
    assert local[0] != first and split == local


def test_min_tokens_masks_eos_on_the_prefill_workers_token(shm_pd: PD, tiny_dir: Path) -> None:
    eos = min(Tokenizer.from_dir(tiny_dir).eos_token_ids)
    # The bias makes EOS the greedy pick at every position; min_tokens bans it from the first 2.
    params = {"max_tokens": 6, "min_tokens": 2, "ignore_eos": False, "logit_bias": [[eos, 100]]}
    split, local = both(shm_pd, "eos", PROMPTS[3], **params)
    assert eos not in local[:2] and local[2] == eos and split == local
