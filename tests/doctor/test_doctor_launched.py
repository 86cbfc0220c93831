"""`pdserve doctor --url URL` (and `pdserve chaos --url URL`) on a cluster `pdserve launch`
started, with no key named: the launcher leaves its key for its user at the router's address
(runtime/local_keys.py), the tools find it, doctor refuses it once others can read it, and it
is gone once the cluster stops."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.runtime import local_keys
from pdserve.runtime.cluster_key import KEY_FILE_ENV, ClusterKey
from pdserve.runtime.pids import wait_gone
from tests.procs import LaunchedCluster

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A user's own HOME and XDG_RUNTIME_DIR, and no key named in the environment."""
    root = tmp_path_factory.mktemp("user")
    (root / "home").mkdir()
    (root / "run").mkdir(mode=0o700)
    return {"HOME": str(root / "home"), "XDG_RUNTIME_DIR": str(root / "run")}


def environ(user: dict[str, str], **extra: str) -> dict[str, str]:
    named = (KEY_FILE_ENV, "PDSERVE_API_KEY")
    return {**{k: v for k, v in os.environ.items() if k not in named}, **user, **extra}


@pytest.fixture(scope="module")
def cluster(
    tiny_dir: Path, user: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchedCluster]:
    args = ["launch", "--prefill", "1", "--decode", "1", "--model", str(tiny_dir)]
    args += ["--kv-budget-mb", "16", "--max-model-len", "256", "--threads", "1"]
    c = LaunchedCluster(args, tmp_path_factory.mktemp("launch"), own_key=True, env=user)
    with c:
        c.wait_ready()
        yield c


def doctor(url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "doctor", "--url", url],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )


def test_doctor_needs_only_the_url(cluster: LaunchedCluster, user: dict[str, str]) -> None:
    path = local_keys.key_path(cluster.url, user)
    assert path.parent == Path(user["XDG_RUNTIME_DIR"]) / "pdserve" / "keys"
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert ClusterKey.load(path).secret == ClusterKey.load(cluster.log_dir / "cluster.key").secret
    assert f"finds the cluster key in {path} (removed on stop)" in cluster.log()

    done = doctor(cluster.url, environ(user))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith("VERDICT: healthy"), done.stdout
    assert done.stderr == ""


def test_a_named_key_wins(cluster: LaunchedCluster, user: dict[str, str]) -> None:
    # The test run's key (tests/conftest.py) is another cluster's: named, it is the one sent.
    done = doctor(cluster.url, environ(user, **{KEY_FILE_ENV: os.environ[KEY_FILE_ENV]}))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "HTTP 401, a key is needed" in done.stdout
    assert f"(key sent: ${KEY_FILE_ENV} ({os.environ[KEY_FILE_ENV]}))" in done.stdout


def test_a_key_others_can_read_is_refused(cluster: LaunchedCluster, user: dict[str, str]) -> None:
    path = local_keys.key_path(cluster.url, user)
    path.chmod(0o644)
    try:
        done = doctor(cluster.url, environ(user))
    finally:
        path.chmod(0o600)
    assert done.returncode == 3, done.stdout + done.stderr
    refusal = f"cluster key file {path} is readable by others (mode 644); chmod 600 it"
    assert f"pdserve doctor: not using the local key of {cluster.url}: {refusal}" in done.stderr
    assert "HTTP 401, a key is needed" in done.stdout and refusal in done.stdout
    assert done.stdout.splitlines()[-1].startswith("VERDICT: unknown")


def test_chaos_needs_only_the_url(
    cluster: LaunchedCluster, user: dict[str, str], tmp_path: Path
) -> None:
    argv = ["chaos", "--url", cluster.url, "--scenario", "fuzz", "--requests", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", *argv, "--work-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=environ(user),
    )
    path = local_keys.key_path(cluster.url, user)
    assert f"chaos[chaos] key: the key `pdserve launch` left in {path}" in done.stderr
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "fuzz             PASS" in done.stdout, done.stdout


def test_the_key_is_gone_once_the_cluster_stops(
    cluster: LaunchedCluster, user: dict[str, str]
) -> None:
    path = local_keys.key_path(cluster.url, user)
    assert path.exists()
    pids = cluster.child_pids
    assert cluster.stop() == 0, cluster.log()[-3000:]
    assert wait_gone(pids, 10.0) == []
    assert not path.exists()
    assert list(path.parent.iterdir()) == []
