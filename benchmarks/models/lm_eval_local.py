"""lm-evaluation-harness through pdserve vs. lm-eval's own HF model, on a small local task.

    python benchmarks/models/lm_eval_local.py --lm-eval-python /tmp/lme/bin/python [--pd]

lm-eval lives in its own venv (never pdserve's): `python3 -m venv /tmp/lme &&
/tmp/lme/bin/pip install torch==2.13.0 && /tmp/lme/bin/pip install "lm-eval[hf,api]"`.
Nothing is downloaded: the model is `pdserve make-model tiny` (an HF checkpoint directory:
LlamaForCausalLM + a fast tokenizer), the task is a YAML written here with `dataset_path: json`
over a local jsonl of multiple-choice items, scored by loglikelihood.

Runs lm-eval's `hf` model (float32, CPU) and its `local-completions` model against a
co-located `pdserve serve` (and, with --pd, a `pdserve launch` prefill/decode cluster); each
scores every choice with `echo` + `logprobs` + `max_tokens: 1`. Prints accuracy per run and
the largest loglikelihood difference from HF; exits 1 if an accuracy differs or a
loglikelihood is off by more than --tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.serving.launched import wait_healthy  # noqa: E402

TASK = "pdserve_local_mc"
STARTUP_S = 120.0
EVAL_TIMEOUT_S = 1800.0

TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

WORDS = ["cat", "river", "green", "seven", "table", "music", "winter", "bread", "stone", "light"]


def items() -> list[dict[str, object]]:
    """30 deterministic four-way items: counting, sequences, completions of common phrases."""
    out: list[dict[str, object]] = []
    for i in range(10):
        n = 3 + 7 * i
        out.append(
            {
                "question": f"Question: what number comes after {n}?\nAnswer:",
                "choices": [f" {n + 1}", f" {n + 2}", f" {n - 1}", f" {2 * n}"],
                "answer": 0,
            }
        )
    for i in range(10):
        a, b = WORDS[i], WORDS[(i + 3) % len(WORDS)]
        out.append(
            {
                "question": f"The {a} and the {b}. Repeat the first word: the",
                "choices": [f" {b}", f" {a}", f" {WORDS[(i + 5) % 10]}", " and"],
                "answer": 1,
            }
        )
    phrases = [
        ("def main():\n    return", [" 0", " main", " def", " ("]),
        ("import os\nimport", [" sys", " os", " the", " 1"]),
        ("for i in range(10):\n   ", [" print(i)", " range", " 10", " for"]),
        ("Once upon a", [" time", " table", " seven", " river"]),
        ("The quick brown fox jumps over the lazy", [" dog", " cat", " fox", " the"]),
        ("1, 2, 3, 4,", [" 5", " 9", " 1", " 40"]),
        ("<html><body>", ["</body></html>", "</html>", "<body>", "x"]),
        ("if x == 1:\n    pass\nelse", [":", " if", " ==", " 1"]),
        ("Monday, Tuesday,", [" Wednesday", " Friday", " Monday", " June"]),
        ("a b c d e", [" f", " a", " z", " q"]),
    ]
    for text, choices in phrases:
        out.append({"question": text, "choices": choices, "answer": 0})
    return out


def write_task(work: Path) -> Path:
    tasks = work / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    data = work / "items.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in items()))
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return tasks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, pd: bool, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    common = ["--model", str(model), "--served-model-name", "tiny", "--port", str(port)]
    if pd:
        argv = ["launch", "--prefill", "1", "--decode", "1", *common, "--log-dir", str(log) + ".d"]
    else:
        argv = ["serve", *common, "--max-model-len", "1024"]
    out = open(log, "wb")  # noqa: SIM115 (closed with the process, in stop())
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", *argv],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, STARTUP_S)
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)  # SIGINT is ignored by a background job's children
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def lm_eval(python: str, work: Path, tasks: Path, name: str, model: str, args: str) -> Path:
    out = work / name
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(work / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", TASK]
    cmd += ["--include_path", str(tasks), "--output_path", str(out), "--log_samples"]
    cmd += ["--batch_size", "8", "--seed", "0", "--device", "cpu"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True, timeout=EVAL_TIMEOUT_S)
    return out


def read_run(out: Path) -> tuple[dict[str, float], dict[tuple[int, int], float]]:
    """(acc metrics, loglikelihood per (doc, choice)) of one lm-eval output directory."""
    results = sorted(out.rglob("results_*.json"))[-1]
    metrics = json.loads(results.read_text())["results"][TASK]
    samples = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))[-1]
    ll: dict[tuple[int, int], float] = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        for j, resp in enumerate(s["resps"]):
            ll[(s["doc_id"], j)] = float(resp[0][0])
    accs = {k: v for k, v in metrics.items() if k in ("acc,none", "acc_norm,none")}
    return accs, ll


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval-python", default="/tmp/lme/bin/python")
    ap.add_argument("--work", default="/tmp/pdserve-lm-eval", help="model, task, outputs")
    ap.add_argument("--pd", action="store_true", help="also a prefill/decode cluster")
    ap.add_argument("--tolerance", type=float, default=1e-3, help="per-choice loglikelihood")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny"
    if not (model / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "pdserve", "make-model", "tiny", "--out", str(model)], check=True
        )
    tasks = write_task(work)
    hf_args = f"pretrained={model},dtype=float32"
    runs = {"hf": read_run(lm_eval(args.lm_eval_python, work, tasks, "hf", "hf", hf_args))}
    for name, pd in [("pdserve", False), *([("pdserve-pd", True)] if args.pd else [])]:
        proc, url = start_server(model, pd, work / f"{name}.log")
        try:
            api_args = (
                f"model=tiny,base_url={url}/v1/completions,tokenizer={model},"
                "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1,"
                # The tiny tokenizer adds a BOS (add_bos_token in its config), and so do lm-eval's
                # hf model and pdserve with a text prompt; local-completions sends token ids and
                # adds none unless told: without this every score is of a different text.
                "add_bos_token=True"
            )
            out = lm_eval(args.lm_eval_python, work, tasks, name, "local-completions", api_args)
            runs[name] = read_run(out)
        finally:
            stop(proc)
    ok = True
    hf_acc, hf_ll = runs["hf"]
    print(f"\n{'run':<12} {'acc':>6} {'acc_norm':>8} {'max |dLL| vs hf':>16}  items: {len(hf_ll)}")
    for name, (acc, ll) in runs.items():
        diff = max(abs(ll[k] - hf_ll[k]) for k in hf_ll)
        same = acc == hf_acc and diff <= args.tolerance
        ok = ok and same
        print(
            f"{name:<12} {acc['acc,none']:>6.4f} {acc['acc_norm,none']:>8.4f} {diff:>16.2e}"
            + ("" if same else "  DIFFERS")
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
