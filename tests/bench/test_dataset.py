"""Datasets: lengths, determinism by seed, shared prefixes, the ShareGPT reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.config import DatasetConfig
from pdserve.bench.dataset import load_tokenizer, make_requests


def test_random_ids_have_the_drawn_lengths_within_the_range() -> None:
    cfg = DatasetConfig(num_prompts=200, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    reqs = make_requests(cfg)
    assert len(reqs) == 200
    for r in reqs:
        assert isinstance(r.prompt, tuple) and len(r.prompt) == r.prompt_len
        assert 50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30
    assert len({r.prompt_len for r in reqs}) > 20  # the range is used, not one value
    assert make_requests(cfg) == reqs
    assert make_requests(DatasetConfig(**{**cfg.__dict__, "seed": 4})) != reqs


def test_zero_range_ratio_gives_fixed_lengths() -> None:
    reqs = make_requests(DatasetConfig(num_prompts=5, input_len=7, output_len=3))
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(7, 3)}


def test_text_prompts_fit_the_tokenizer(tiny_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_dir))
    cfg = DatasetConfig(num_prompts=20, input_len=64, prompt_format="text", range_ratio=0.5)
    reqs = make_requests(cfg, tok)
    off = [abs(len(tok.encode(r.prompt)) - r.prompt_len) for r in reqs if isinstance(r.prompt, str)]
    assert len(off) == 20
    assert max(off) <= 2, off


def test_shared_prefix_groups_share_their_system_prompt() -> None:
    cfg = DatasetConfig(
        name="shared-prefix",
        num_prompts=12,
        sp_prompts_per_group=4,
        sp_system_len=30,
        sp_question_len=5,
        output_len=9,
    )
    reqs = make_requests(cfg)
    groups: dict[int, set[tuple[int, ...]]] = {}
    for r in reqs:
        assert isinstance(r.prompt, tuple) and len(r.prompt) == 35 and r.output_len == 9
        assert r.group is not None
        groups.setdefault(r.group, set()).add(r.prompt[:30])
    assert sorted(groups) == [0, 1, 2]
    assert all(len(prefixes) == 1 for prefixes in groups.values())
    assert len({next(iter(p)) for p in groups.values()}) == 3


def sharegpt_file(tmp_path: Path) -> Path:
    long_answer = "word " * 400
    data = [
        {
            "conversations": [
                {"from": "human", "value": "q " * 40},
                {"from": "gpt", "value": long_answer},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a " * 40}]},
        {"conversations": [{"from": "gpt", "value": "no question first"}]},
        {
            "conversations": [
                {"from": "human", "value": "x" * 5000},
                {"from": "gpt", "value": "y" * 40},
            ]
        },
        {"id": "malformed"},
        "not even an object",
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_keeps_usable_first_exchanges(tmp_path: Path) -> None:
    cfg = DatasetConfig(
        name="sharegpt", path=str(sharegpt_file(tmp_path)), num_prompts=3, prompt_format="text"
    )
    reqs = make_requests(cfg)
    # Only the first conversation passes: "hi" is too short, 5000 chars too long (chars/4).
    assert [r.prompt for r in reqs] == ["q " * 40] * 3
    assert reqs[0].prompt_len == 20 and reqs[0].output_len == 500


def test_sharegpt_errors_say_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        make_requests(DatasetConfig(name="sharegpt", path=str(bad), prompt_format="text"))
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="no conversation"):
        make_requests(DatasetConfig(name="sharegpt", path=str(empty), prompt_format="text"))
    with pytest.raises(ValueError, match="--dataset-path"):
        DatasetConfig(name="sharegpt")
