"""`pdserve launch --gpus`: which GPUs the workers are spread over (runtime/gpus.py), which
worker gets which (runtime/launcher.worker_gpus), and that a worker process sees only its own
(runtime/child.Child's env). The GPU side itself needs a multi-GPU host; this is the plan."""

from __future__ import annotations

import sys
import time

import pytest

from pdserve.runtime.child import Child
from pdserve.runtime.gpus import pin_to_device, resolve_gpus
from pdserve.runtime.launcher import worker_gpus
from tests.router.test_launch import config


def test_auto_spreads_over_every_visible_gpu_when_there_are_several():
    assert resolve_gpus("auto", "cuda", None, 2) == ("0", "1")
    assert resolve_gpus("auto", "auto", None, 4) == ("0", "1", "2", "3")
    assert resolve_gpus("auto", "cuda", "3,5", 2) == ("3", "5")  # the launcher's own view
    assert resolve_gpus("auto", "cuda", "GPU-aa, GPU-bb", 2) == ("GPU-aa", "GPU-bb")
    assert resolve_gpus("auto", "cuda", "0,1,7", 2) == ("0", "1")  # 7: not a GPU torch counts


def test_auto_places_nothing_on_one_gpu_the_cpu_or_a_chosen_device():
    assert resolve_gpus("auto", "cuda", None, 1) == ()
    assert resolve_gpus("auto", "cuda", "2", 1) == ()
    assert resolve_gpus("auto", "cpu", None, 8) == ()
    assert resolve_gpus("auto", "auto", None, 0) == ()
    assert resolve_gpus("auto", "cuda:1", None, 8) == ()  # the user picked the device
    assert resolve_gpus("none", "cuda", None, 8) == ()


def test_an_explicit_list_is_honoured_in_its_order():
    assert resolve_gpus("1,0", "cuda", None, 2) == ("1", "0")
    assert resolve_gpus(" 5 , 4 ", "auto", "4,5", 2) == ("5", "4")
    assert resolve_gpus("MIG-4f/1/0", "cuda", None, 1) == ("MIG-4f/1/0",)


@pytest.mark.parametrize(
    "spec, device, count, why",
    [
        ("0,0", "cuda", 2, "twice"),
        ("", "cuda", 2, "comma list"),
        ("0;rm -rf", "cuda", 2, "comma list"),
        ("../x", "cuda", 2, "comma list"),
        ("0,1", "cpu", 2, "needs --device cuda"),
        ("0,1", "cuda:0", 2, "needs --device cuda"),
        ("0,1", "cuda", 0, "no GPU visible"),
        ("5", "cuda", 2, r"5 not among this host's \(2 GPUs\)"),
    ],
)
def test_a_list_that_cannot_be_honoured_is_refused(spec, device, count, why):
    with pytest.raises(ValueError, match=why):
        resolve_gpus(spec, device, None, count)


def test_a_list_names_gpus_as_the_launcher_sees_them():
    with pytest.raises(ValueError, match="0 not among this host's"):
        resolve_gpus("0,4", "cuda", "4,5", 2)  # physical 0 is outside the launcher's GPUs
    with pytest.raises(ValueError, match="GPU-cc not among"):
        resolve_gpus("GPU-cc", "cuda", "GPU-aa,GPU-bb", 2)


def test_workers_take_the_gpus_round_robin_prefill_first():
    assert worker_gpus(config(decode=1, gpus=("0", "1"))) == {"prefill-0": "0", "decode-0": "1"}
    assert worker_gpus(config(prefill=2, decode=3, gpus=("a", "b"))) == {
        "prefill-0": "a",
        "prefill-1": "b",
        "decode-0": "a",
        "decode-1": "b",
        "decode-2": "a",
    }
    assert worker_gpus(config(prefill=0, decode=2, gpus=("3", "5"))) == {
        "colocated-0": "3",
        "colocated-1": "5",
    }
    assert worker_gpus(config(decode=1)) == {}


def test_a_child_sees_the_environment_it_was_given(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    probe = "import os; print('CVD=' + os.environ['CUDA_VISIBLE_DEVICES'], flush=True)"
    child = Child(
        "probe",
        [sys.executable, "-c", probe],
        tmp_path / "probe.log",
        {"CUDA_VISIBLE_DEVICES": "1"},
    )
    child.start()
    deadline = time.monotonic() + 30
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert child.poll() == 0
        assert "CVD=1" in (tmp_path / "probe.log").read_text()
    finally:
        if child.poll() is None:
            child.kill()


def test_launch_says_why_it_refuses_a_list(capsys):
    from argparse import Namespace

    from pdserve.launch import launch_gpus

    assert launch_gpus(Namespace(device="cpu", gpus="auto")) == ()
    assert launch_gpus(Namespace(device="cpu", gpus="0,1")) is None
    assert "needs --device cuda" in capsys.readouterr().err


def test_serve_pins_an_indexed_device_to_its_process():
    env: dict[str, str] = {}
    assert pin_to_device("cuda:1", env) == "cuda" and env == {"CUDA_VISIBLE_DEVICES": "1"}
    env = {"CUDA_VISIBLE_DEVICES": "4,6"}  # the N-th of the GPUs this process was given
    assert pin_to_device("cuda:1", env) == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "6"
    env = {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}
    assert pin_to_device("cuda:0", env) == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "GPU-aa"
    for device in ("cuda", "cpu", "auto"):  # nothing to pin
        env = {"CUDA_VISIBLE_DEVICES": "3"}
        assert pin_to_device(device, env) == device and env == {"CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(ValueError, match="gives this process 2 GPU"):
        pin_to_device("cuda:2", {"CUDA_VISIBLE_DEVICES": "4,6"})
    with pytest.raises(ValueError, match="gives this process 0 GPU"):
        pin_to_device("cuda:0", {"CUDA_VISIBLE_DEVICES": ""})
