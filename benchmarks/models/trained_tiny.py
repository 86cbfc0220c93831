"""A small DeepSeek-V3 trained here, so that accuracy measures see a trained model's margins.

    python benchmarks/models/trained_tiny.py --out DIR [--steps 600]

The built-in models are random: their next-token margins are small against rounding, so how
often a lossy path (fp8 weights, bf16) keeps the same greedy token says little about a real
checkpoint (benchmarks/RESULTS.md 2026-12-07 (c)). No trained DeepSeek checkpoint is at hand
(nothing is downloaded), so this trains one: the architecture of `builtin:deepseek-v3-fp8-tiny`
(hidden 256, 3 layers, 8 routed experts of which 3 a token, one shared; every projection a
multiple of DeepSeek's 128 x 128 fp8 blocks) from HF's random init, in float32 with
transformers' own DeepseekV3ForCausalLM and AdamW, on the built-in tokenizer's training text
(pdserve/model/corpus.py: English-like prose, code, numbers, markup, other scripts), next-token
loss on windows of `--seq` tokens. It prints the loss as it goes and the held-out loss (text
of another seed) at the end, and writes an HF directory (save_pretrained, the tokenizer files
copied). `held_out_prompts` gives prompts from that held-out text: in-distribution inputs.

Not DeepSeek's weights: a model of 4.6 M parameters trained for minutes on synthetic text. It is
trained, which is the property the measure needs.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pdserve.model.builtin import resolve_model  # noqa: E402
from pdserve.model.corpus import corpus_text  # noqa: E402

HELD_OUT_SEED = 7  # corpus_text's default seed is the training text's


def tokens_of(text: str, tokenizer_json: Path) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = [i for line in text.split("\n") for i in tok.encode(line + "\n").ids]
    return torch.tensor(ids, dtype=torch.long)


def held_out_prompts(model_dir: Path, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens cut from held-out corpus text at random places."""
    ids = tokens_of(corpus_text(200_000, seed=HELD_OUT_SEED), model_dir / "tokenizer.json")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (n,), generator=g).tolist()
    return [ids[s : s + length].tolist() for s in starts]


def train(out: Path, steps: int, batch: int, seq: int, lr: float, seed: int = 0) -> Path:
    """Train from HF's init and write the model to `out` (an HF directory); returns it."""
    import transformers

    base = resolve_model("builtin:deepseek-v3-fp8-tiny")
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((base / "config.json").read_text())
    cfg.pop("quantization_config")  # trained in float32; fp8_accuracy.py writes the fp8 copy
    (out / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    data = tokens_of(corpus_text(), out / "tokenizer.json")
    held = tokens_of(corpus_text(200_000, seed=HELD_OUT_SEED), out / "tokenizer.json")
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f} M parameters, {len(data):,} training tokens", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        for group in opt.param_groups:  # warm-up, then cosine to a tenth
            warm = min(1.0, step / 50)
            group["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # HF shifts the labels
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step == 1 or step % 50 == 0 or step == steps:
            took = time.perf_counter() - t0
            print(f"step {step}: loss {loss.item():.3f} ({took:.0f} s)", flush=True)
    model.eval()
    with torch.no_grad():
        windows = held[: (len(held) // (seq + 1)) * (seq + 1)].view(-1, seq + 1)[:32]
        held_loss = model(input_ids=windows[:, :-1], labels=windows[:, :-1]).loss.item()
    print(f"held-out loss {held_loss:.3f} (uniform: {math.log(config.vocab_size):.3f})")
    model.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the HF directory to write (must not exist)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    train(Path(args.out), args.steps, args.batch, args.seq, args.lr)


if __name__ == "__main__":
    main()
