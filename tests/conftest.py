"""Shared fixtures: built-in model directories and real server processes on free ports."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import ServerProcess

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def cluster_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cluster key for the run: every worker, router and tool we start inherits it."""
    from pdserve.runtime.cluster_key import KEY_FILE_ENV, generate

    path = tmp_path_factory.mktemp("pdserve-key") / "cluster.key"
    generate(path)
    os.environ[KEY_FILE_ENV] = str(path)
    return path


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
