"""Shared fixtures: built-in model directories and real server processes on free ports."""

from __future__ import annotations

import inspect
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.runtime.pids import wait_gone
from tests.procs import ServerProcess

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run in its CPU interpreter: `triton.jit` reads this when a kernel
# module is imported, so it is set before any test imports one, whatever the order.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_the_cores() -> None:
    """Under pytest-xdist the workers share the machine's cores: each test process takes its
    share of torch threads, not all of them (two workers of two threads each on `make test`'s
    two cores thrashed: the three heaviest model files took 187 s, 80 s at one thread each).
    Processes the tests start set their own (`--threads`)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores()


@pytest.fixture(scope="session", autouse=True)
def cluster_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cluster key for the run: every worker, router and tool we start inherits it."""
    from pdserve.runtime.cluster_key import KEY_FILE_ENV, generate

    path = tmp_path_factory.mktemp("pdserve-key") / "cluster.key"
    generate(path)
    os.environ[KEY_FILE_ENV] = str(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def local_key_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the clusters the run launches leave their keys (runtime/local_keys.py): a temp
    $XDG_RUNTIME_DIR, never the user's own."""
    path = tmp_path_factory.mktemp("xdg-runtime")
    path.chmod(0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(path)
    return path


@pytest.fixture(autouse=True)
def gbnf_converter_stopped(request: pytest.FixtureRequest) -> Iterator[None]:
    """A GBNF grammar converted in this process starts the converter's child
    (runtime/gbnf_converter.py): stopped by pid after the test, whatever its outcome; a test
    that started one is marked `process` like any other that starts a process. What earlier
    tests converted or compile-checked is forgotten first, so a test converts whatever ran
    before it (and an unmarked one fails in any order)."""
    module = sys.modules.get("pdserve.runtime.gbnf_converter")
    if module is not None:
        module.GBNF_CONVERTER.clear()
    constraint = sys.modules.get("pdserve.protocol.constraint")
    if constraint is not None:
        constraint.compile_error.cache_clear()
    before = 0 if module is None else module.GBNF_CONVERTER.started
    yield
    module = sys.modules.get("pdserve.runtime.gbnf_converter")
    if module is None:
        return
    converter = module.GBNF_CONVERTER
    pid = converter.pid()
    converter.close()
    assert pid is None or wait_gone([pid], 10.0) == [], f"the GBNF converter {pid} outlived close"
    if converter.started > before:
        assert request.node.get_closest_marker("process") is not None, (
            "this test started the GBNF converter's child but is not marked process"
        )


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for the whole run, shared with the server processes we start."""
    path = tmp_path_factory.mktemp("pdserve-cache")
    os.environ["PDSERVE_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def builtin_dir(model_cache: Path):
    from pdserve.model.builtin import resolve_model

    return lambda name: resolve_model(f"builtin:{name}")


@pytest.fixture(scope="session")
def tiny_dir(builtin_dir) -> Path:
    return builtin_dir("tiny")


@pytest.fixture(scope="module")
def tiny_server(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    with ServerProcess(
        [
            "serve",
            "--model",
            str(tiny_dir),
            "--served-model-name",
            "tiny",
            "--kv-budget-mb",
            "16",
            "--max-model-len",
            "1024",
        ],
        log,
    ) as srv:
        yield srv


# -- the fast tier --------------------------------------------------------------------------
# `make test-fast` runs what starts no process (`-m "not process"`). A test that starts one
# (its own code or any fixture it uses, transitively) says so with `@pytest.mark.process`, or
# its module with `pytestmark`. Collection reads their source and fails on a test that starts
# processes without the mark, so a new test cannot forget it.
_STARTS_PROCESSES = re.compile(r"ServerProcess\(|LaunchedCluster\(|subprocess\.|Popen\(|\bPeer\(")


def _starts_processes(item: pytest.Item) -> bool:
    """The test, the fixtures it uses, and the module-level functions either of them calls."""
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        for name in item.fixturenames:  # type: ignore[attr-defined]
            funcs += [d.func for d in info.name2fixturedefs.get(name, ())]
    for f in list(funcs):
        code, scope = getattr(f, "__code__", None), getattr(f, "__globals__", {})
        if code is not None:
            funcs += [scope[n] for n in code.co_names if inspect.isfunction(scope.get(n))]
    for f in funcs:
        if f is None:
            continue
        try:
            src = inspect.getsource(f)
        except (OSError, TypeError):
            continue
        if _STARTS_PROCESSES.search(src):
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "process: starts real pdserve (or helper) processes")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if item.get_closest_marker("process") is None and _starts_processes(item)
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests start processes but are not marked @pytest.mark.process (the fast "
            "tier would run them): " + ", ".join(unmarked[:20])
        )
