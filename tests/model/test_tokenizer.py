"""Tokenizer: agrees with HF transformers on ids and chat prompts; streams text exactly."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdserve.model.builtin import make_model
from pdserve.model.tokenizer import REPLACEMENT_CHAR, Tokenizer

NAMES = ("tiny", "qwen2-tiny", "qwen3-tiny")
ENDOFTEXT, IM_START, IM_END = 4093, 4094, 4095
TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "def f(x: int) -> int:\n    return x * 2  # double\n",
    "Ünïcödé façade naïve — “quotes”",
    "今天天气很好，東京の天気は晴れです。안녕하세요",
    "emoji 🎉🚀👩‍💻❤️ and 𝄞 outside the BMP",
    "numbers 1234567890 3.14159 -42",
    "\n\n\t tabs\tand\r\nnewlines\n",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
MULTILINGUAL = "Grüße aus Köln! 你好，世界 🌍✨ Привет, мир. 👩‍💻 مرحبا 東京 𝄞 done."
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 🤔"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}],
        }
    ],
    [{"role": "assistant", "content": None}],
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {name: make_model(name, root / name) for name in NAMES}


@pytest.fixture(scope="module")
def hf_tokenizers(model_dirs: dict[str, Path]) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    return {
        name: transformers.AutoTokenizer.from_pretrained(path) for name, path in model_dirs.items()
    }


@pytest.fixture(scope="module")
def tiny(model_dirs: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_dir(model_dirs["tiny"])


def test_special_ids_and_sizes(model_dirs: dict[str, Path]) -> None:
    for name, path in model_dirs.items():
        tok = Tokenizer.from_dir(path)
        assert tok.vocab_size == 4096
        assert tok.eos_token_ids == frozenset({IM_END, ENDOFTEXT})
        assert tok.bos_token_id == (ENDOFTEXT if name == "tiny" else None)
        assert tok.encode("<|im_start|><|im_end|><|endoftext|>", add_special_tokens=False) == [
            IM_START, IM_END, ENDOFTEXT,
        ]  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_encode_and_decode_match_hf(
    model_dirs: dict[str, Path], hf_tokenizers: dict[str, Any], name: str
) -> None:
    ours, hf = Tokenizer.from_dir(model_dirs[name]), hf_tokenizers[name]
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == hf.encode(text, add_special_tokens=add_special), (text, add_special)
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(
            ids, skip_special_tokens=False
        )
        assert (
            ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False)
            == text
        )
    assert (ours.encode("x")[0] == ENDOFTEXT) == (name == "tiny")


@pytest.mark.parametrize("name", NAMES)
def test_chat_template_matches_hf(
    model_dirs: dict[str, Path], hf_tokenizers: dict[str, Any], name: str
) -> None:
    ours, hf = Tokenizer.from_dir(model_dirs[name]), hf_tokenizers[name]
    for messages in CONVERSATIONS:
        for add_gen in (True, False):
            expected = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_gen
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=add_gen) == expected


def test_chat_template_is_chatml(tiny: Tokenizer) -> None:
    prompt = tiny.apply_chat_template(CONVERSATIONS[1][:2])
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_custom_template_features_match_hf(
    model_dirs: dict[str, Path], hf_tokenizers: dict[str, Any], tmp_path: Path
) -> None:
    # tojson without HTML escaping or ASCII escaping, loop controls, namespace, extra kwargs,
    # bos/eos variables, and a chat_template.jinja file taking precedence over the config.
    template = (
        "{% set ns = namespace(n=0) %}{{ bos_token }}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ m | tojson }}|{{ m['content'] | tojson(indent=2) }}\n"
        "{% endfor %}{{ ns.n }} {{ eos_token }} {{ greeting }} {{ tools is none }}"
        "{% generation %}[{{ messages | length }}]{% endgeneration %}"
        "{% if add_generation_prompt %}GEN{% endif %}"
    )
    path = tmp_path / "m"
    shutil.copytree(model_dirs["tiny"], path)
    (path / "chat_template.jinja").write_text(template)
    messages = [
        {"role": "user", "content": "<b>&</b> ü 🎉"},
        {"role": "assistant", "content": "x"},
        {"role": "user"},
    ]
    ours = Tokenizer.from_dir(path).apply_chat_template(messages, greeting="hej")
    hf = hf_tokenizers["tiny"].apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, greeting="hej"
    )
    assert ours == hf
    assert '"<b>&</b> ü 🎉"' in ours and "2 <|im_end|> hej True[3]" in ours


def test_strftime_now_is_available(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "m"
    shutil.copytree(model_dirs["tiny"], path)
    (path / "chat_template.jinja").write_text("{{ strftime_now('%Y') }}")
    assert Tokenizer.from_dir(path).apply_chat_template([]).isdigit()


def test_template_errors_become_value_errors(
    tiny: Tokenizer, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match='unsupported message role "tool"'):
        tiny.apply_chat_template([{"role": "tool", "content": "42"}])
    with pytest.raises(ValueError, match="unsupported message role"):
        tiny.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="chat template failed"):
        tiny.apply_chat_template([{"role": "user", "content": 42}])
    path = tmp_path / "m"
    shutil.copytree(model_dirs["tiny"], path)
    (path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="does not parse"):
        Tokenizer.from_dir(path).apply_chat_template([])


def test_missing_chat_template(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "m"
    shutil.copytree(model_dirs["tiny"], path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(path)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json is missing"):
        Tokenizer.from_dir(tmp_path)


def test_eos_fallbacks(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "m"
    shutil.copytree(model_dirs["qwen2-tiny"], path)
    (path / "generation_config.json").unlink()
    assert Tokenizer.from_dir(path).eos_token_ids == frozenset({IM_END})  # from config.json
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = [ENDOFTEXT, IM_START]
    (path / "config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(path).eos_token_ids == frozenset({ENDOFTEXT, IM_START})
    (path / "config.json").unlink()
    assert Tokenizer.from_dir(path).eos_token_ids == frozenset(
        {IM_END}
    )  # tokenizer_config eos_token


def test_token_to_str(tiny: Tokenizer) -> None:
    assert tiny.token_to_str(IM_END) == "<|im_end|>"
    assert tiny.token_to_str(tiny.encode(" world", add_special_tokens=False)[0]) == " world"
    first_byte_of_cjk = tiny.encode("界", add_special_tokens=False)[0]
    assert tiny.token_to_str(first_byte_of_cjk) == REPLACEMENT_CHAR
    assert tiny.token_to_str(100_000) == ""  # beyond the tokenizer: the model's padded rows


@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_reproduces_decode(tiny: Tokenizer, skip_special: bool) -> None:
    first, second = MULTILINGUAL[:20], MULTILINGUAL[20:]
    ids = tiny.encode(first, add_special_tokens=False) + [IM_END]
    ids += tiny.encode(second, add_special_tokens=False) + [ENDOFTEXT]
    assert any(tiny.token_to_str(i) == REPLACEMENT_CHAR for i in ids)  # the test needs split chars
    detok = tiny.incremental(skip_special_tokens=skip_special)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    expected = tiny.decode(ids, skip_special_tokens=skip_special)
    assert "".join(pieces) == expected == detok.text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    assert "" in pieces  # something was held back


def test_incremental_flush_returns_an_unfinished_character(tiny: Tokenizer) -> None:
    ids = tiny.encode("ok 界", add_special_tokens=False)
    detok = tiny.incremental()
    emitted = "".join(detok.push(i) for i in ids[:-1])
    assert emitted == "ok "
    assert detok.flush() == REPLACEMENT_CHAR * (len(tiny.decode(ids[:-1])) - len(emitted))
    assert detok.flush() == ""


def test_incremental_on_random_ids_matches_decode(tiny: Tokenizer) -> None:
    # What a random-weights model emits: arbitrary byte tokens, invalid UTF-8, specials.
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(4096) for _ in range(rng.randrange(1, 60))]
        detok = tiny.incremental()
        text = "".join(detok.push(i) for i in ids) + detok.flush()
        assert text == tiny.decode(ids)


def test_incremental_keeps_sentencepiece_spaces(tmp_path: Path) -> None:
    # A Metaspace decoder drops the space before the first token of a sequence, so decoding
    # each token alone would lose every space; the context window must prevent that.
    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(["the cat sat on the mat", "a dog and a cat"] * 20, trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("the cat sat on a dog")
    detok = tok.incremental()
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == "the cat sat on a dog"
