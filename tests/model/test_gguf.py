"""GGUF checkpoints: generated files (tests/model/gguf_export.py, laid out as llama.cpp's converter
lays them out) load, tokenize and generate as HF transformers' GGUF loading does them, and as the
HF model they were written from; what pdserve cannot serve is refused, naming it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize
from tokenizers import Tokenizer as HFTokenizer

from pdserve.model.builtin import CHATML_TEMPLATE, _tokenizer_json, resolve_model
from pdserve.model.config import ModelArch, ModelConfigError
from pdserve.model.corpus import ENDOFTEXT, IM_END
from pdserve.model.gguf_file import find_gguf, open_gguf
from pdserve.model.loader import load_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import SamplingParams
from tests.helpers import make_engine, run
from tests.model.gguf_export import gguf_name, permute_rope_rows, write_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers loads a GGUF only with it

Q = GGMLQuantizationType
SHAPE: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=256,  # K-quant blocks are 256 wide
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
)
# Every storage type pdserve is asked to read, in one file (first match wins).
MIXED = {
    r"token_embd\.weight": Q.Q8_0,
    r"output\.weight": Q.Q6_K,
    r"blk\.0\.attn_q\.weight": Q.Q4_K,
    r"blk\.1\.attn_q\.weight": Q.Q4_0,
    r".*attn_k\.weight": Q.Q4_1,
    r".*attn_v\.weight": Q.Q5_K,
    r".*attn_output\.weight": Q.BF16,
    r"blk\.0\.ffn_gate\.weight": Q.Q8_0,
    r"blk\.1\.ffn_gate\.weight": Q.Q5_0,
    r".*ffn_up\.weight": Q.F16,
    r".*ffn_down\.weight": Q.Q6_K,
}
TEXTS = [
    "Hello world, it's 2024!",
    "Ünïcödé façade naïve — “quotes”",
    "今天天气很好，東京の天気は晴れです。",
    "emoji 🎉🚀👩‍💻❤️ 𝄞",
    "  spaces\n\n\ttabs\r\n",
    "<|im_start|>user\nhi<|im_end|>",
]
CHAT = [{"role": "user", "content": "Hi there, what is 2+2? 🤔"}]


def random_hf(cls_name: str, **extra: Any) -> Any:
    cfg = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))(**SHAPE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() == 2 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()


def write(dir_: Path, model: Any, **kw: Any) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    return write_gguf(
        dir_ / "model.gguf",
        model,
        _tokenizer_json(False),
        chat_template=CHATML_TEMPLATE,
        bos=ENDOFTEXT,
        eos=IM_END,
        **kw,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("gguf")
    llama = random_hf("LlamaForCausalLM", tie_word_embeddings=False)
    qwen2 = random_hf("Qwen2ForCausalLM", tie_word_embeddings=True)
    llama3 = random_hf(
        "LlamaForCausalLM",
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    )  # fmt: skip
    return {
        "llama": (write(root / "llama", llama, types=MIXED, add_bos=True, file_type=15), llama),
        "qwen2": (write(root / "qwen2", qwen2, types={r".*\.weight": Q.Q8_0}, file_type=7), qwen2),
        "llama3": (write(root / "llama3", llama3), llama3),
    }


def prompts(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(t) for t in (*TEXTS[:4], tok.apply_chat_template(CHAT))]


def pdserve_greedy(path: Path, ps: list[list[int]], n: int) -> list[list[int]]:
    engine = make_engine(path, page_size=8, chunk=16, max_model_len=256)
    return run(engine, ps, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


def hf_greedy(model: Any, ps: list[list[int]], n: int) -> list[list[int]]:
    """HF's float32 greedy generate of each prompt alone, EOS off (an explicit attention mask:
    generate would otherwise take a prompt token equal to pad_token_id for padding)."""
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p])
            mask = torch.ones_like(ids)
            gen = model.generate(
                ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def hf_from_gguf(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_matches_transformers_on_the_same_file(files, name):
    path, _ = files[name]
    ps = prompts(Tokenizer.from_dir(path))
    ours = pdserve_greedy(path, ps, 12)
    assert ours == hf_greedy(hf_from_gguf(path), ps, 12)
    assert len({tuple(o) for o in ours}) > 1  # the prompts steer it: not one fixed answer


def test_a_float_file_generates_as_the_model_it_was_written_from(files):
    # Llama 3 rope scaling: stored as rope_freqs.weight divisors (transformers' GGUF loading
    # ignores them, so the oracle is the HF model the file was written from).
    path, hf = files["llama3"]
    ps = prompts(Tokenizer.from_dir(path))
    assert pdserve_greedy(path, ps, 12) == hf_greedy(hf, ps, 12)
    file = open_gguf(path)
    for name, want in hf.state_dict().items():
        if name != "lm_head.weight":  # tied: not stored
            assert torch.equal(torch.from_numpy(file.read(name)), want), name  # q/k un-permuted
    assert "lm_head.weight" not in file.shapes()


def test_each_storage_type_reads_as_gguf_dequantises_the_stored_bytes(files):
    path, _ = files["llama"]
    file = open_gguf(path)
    seen = set()
    for t in GGUFReader(path).tensors:
        want = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        hf = next(n for n in file.shapes() if gguf_name(n) == t.name)
        got = torch.from_numpy(file.read(hf))
        if ".attn_q." in t.name or ".attn_k." in t.name:  # read() un-permutes them
            heads = SHAPE["num_attention_heads" if ".attn_q." in t.name else "num_key_value_heads"]
            got = permute_rope_rows(got, heads)
        assert got.dtype == torch.float32 and torch.equal(got, want.reshape(got.shape)), t.name
        seen.add(t.tensor_type)
    assert seen >= {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    assert file.stored_types()["Q6_K"] == 3  # output + two ffn_down


def test_config_comes_from_the_metadata(files):
    arch = ModelArch.from_dir(files["llama"][0])
    assert (arch.architecture, arch.vocab_size, arch.hidden_size, arch.num_layers) == (
        "LlamaForCausalLM", 4096, 256, 2,
    )  # fmt: skip
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size) == (
        4, 2, 64, 512,
    )  # fmt: skip
    assert not arch.tie_word_embeddings and arch.max_position_embeddings == 512
    assert arch.torch_dtype == "float32" and arch.rope_theta == 10000.0
    qwen2 = ModelArch.from_dir(files["qwen2"][0])
    assert qwen2.architecture == "Qwen2ForCausalLM" and qwen2.qkv_bias
    assert qwen2.tie_word_embeddings


def test_tokenizer_matches_transformers_and_the_source_tokenizer(files):
    path, _ = files["qwen2"]
    ours = Tokenizer.from_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    source = HFTokenizer.from_str(_tokenizer_json(False))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text) == source.encode(text).ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    prompt = ours.apply_chat_template(CHAT)
    assert prompt == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.encode(prompt) == hf.encode(prompt)
    assert ours.eos_token_ids == {4095} and ours.bos_token_id == 4093
    assert ours.decode(ours.encode(prompt)) == "user\nHi there, what is 2+2? 🤔\nassistant\n"


def test_add_bos_token_puts_the_bos_first(files):
    path, _ = files["llama"]
    ours = Tokenizer.from_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text)[0] == 4093 and ours.encode(text) == hf.encode(text)
    assert ours.encode("hi", add_special_tokens=False) == hf.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("pre, bos_first", [("llama-bpe", True), ("qwen2", False)])
def test_without_add_bos_token_llama3_files_take_a_bos_and_others_none(
    files, tmp_path, pre, bos_first
):
    _, model = files["llama"]
    path = write(tmp_path, model, add_bos=None, pre=pre)
    ids = Tokenizer.from_dir(path).encode("hi")
    assert (ids[0] == 4093) is bos_first, ids  # llama.cpp's default for the file's pre-tokenizer


@pytest.mark.process
def test_a_gguf_tokenizer_and_config_load_no_torch(files):
    # The router builds the tokenizer and loads no torch (tests/router/test_no_torch.py).
    code = (
        "import json, sys\n"
        "from pdserve.model.config import ModelArch\n"
        "from pdserve.model.tokenizer import Tokenizer\n"
        "Tokenizer.from_dir(sys.argv[1]).encode('hi'); ModelArch.from_dir(sys.argv[1])\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(files["qwen2"][0])],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) == []


def test_a_directory_holding_one_gguf_serves_it(files, tmp_path):
    path, _ = files["qwen2"]
    assert find_gguf(path.parent) == path and find_gguf(path) == path
    assert resolve_model(str(path)) == path and resolve_model(str(path.parent)) == path.parent
    assert ModelArch.from_dir(path.parent) == ModelArch.from_dir(path)
    assert Tokenizer.from_dir(path.parent).encode("hi") == Tokenizer.from_dir(path).encode("hi")
    (tmp_path / "config.json").write_text("{}")
    shutil.copy(path, tmp_path / "model.gguf")
    assert find_gguf(tmp_path) is None  # an HF directory stays one


# ---------------------------------------------------------------- refusals


def edited(
    src: Path,
    dst: Path,
    arch: str | None = None,
    added: dict[str, tuple[Any, GGUFValueType]] | None = None,
    **meta: Any,
) -> Path:
    """A copy of GGUF `src` with metadata values replaced (same types) or removed (None), keys
    `added` (value, type), and its architecture (the keys named after it too) renamed `arch`."""
    reader = GGUFReader(src)
    file = open_gguf(src)
    w = GGUFWriter(str(dst), arch or file.architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = meta.get(key, file.get(key))
        if value is None:
            continue
        if arch is not None:
            key = key.replace(f"{file.architecture}.", f"{arch}.", 1)
        sub = field.types[-1] if len(field.types) > 1 else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)
    for key, (value, vtype) in (added or {}).items():
        w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_refusals_name_the_problem(files, tmp_path):
    src, _ = files["qwen2"]
    cases = [
        ({"tokenizer.ggml.model": "llama"}, Tokenizer.from_dir, "SentencePiece"),
        ({"tokenizer.ggml.pre": "falcon"}, Tokenizer.from_dir, "pre 'falcon' is not supported"),
        ({"qwen2.block_count": None}, ModelArch.from_dir, "'qwen2.block_count' is missing"),
        ({"qwen2.rope.dimension_count": 32}, ModelArch.from_dir, "partial rotary"),
    ]
    for i, (meta, call, message) in enumerate(cases):
        with pytest.raises(ModelConfigError, match=message):
            call(edited(src, tmp_path / f"{i}.gguf", **meta))
    (tmp_path / "two").mkdir()
    for n in ("a.gguf", "b.gguf"):
        shutil.copy(src, tmp_path / "two" / n)
    with pytest.raises(ModelConfigError, match="holds 2 .gguf files"):
        ModelArch.from_dir(tmp_path / "two")
    shard = tmp_path / "m-00001-of-00002.gguf"
    shutil.copy(src, shard)
    with pytest.raises(ModelConfigError, match="split GGUF"):
        load_model(shard, torch.float32, torch.device("cpu"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelConfigError, match="not a readable GGUF"):
        ModelArch.from_dir(junk)


def test_rope_scaling_comes_from_the_metadata(files, tmp_path):
    src, _ = files["qwen2"]
    linear = {
        "qwen2.rope.scaling.type": ("linear", GGUFValueType.STRING),
        "qwen2.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
    }
    arch = ModelArch.from_dir(edited(src, tmp_path / "linear.gguf", added=linear))
    assert (arch.rope_scaling.rope_type, arch.rope_scaling.factor) == ("linear", 4.0)
    yarn = {**linear, "qwen2.rope.scaling.type": ("yarn", GGUFValueType.STRING)}
    with pytest.raises(ModelConfigError, match="rope_scaling type 'yarn' not supported"):
        ModelArch.from_dir(edited(src, tmp_path / "yarn.gguf", added=yarn))


def test_an_unsupported_architecture_is_refused(files, tmp_path):
    dst = edited(files["qwen2"][0], tmp_path / "gemma2.gguf", arch="gemma2")
    assert open_gguf(dst).get("gemma2.block_count") == 2
    with pytest.raises(ModelConfigError, match="'gemma2' is not supported.*llama"):
        ModelArch.from_dir(dst)
