"""runtime/local_keys.py: where a launch leaves its key, who may read it, and when it goes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.runtime import httpcall, local_keys
from pdserve.runtime.cluster_key import KEY_FILE_ENV, ClusterKey, ClusterKeyError, generate


def key() -> ClusterKey:
    return ClusterKey(os.urandom(32))


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    return {"XDG_RUNTIME_DIR": str(runtime), "HOME": str(tmp_path / "home")}


def test_the_directory_is_the_runtime_dir_else_the_cache(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    home = tmp_path / "home"
    assert local_keys.key_dir({"XDG_RUNTIME_DIR": str(runtime), "HOME": str(home)}) == (
        runtime / "pdserve" / "keys"
    )
    # No runtime dir, a relative one, or one that does not exist: the cache under $HOME.
    for bad in ("", "relative/run", str(tmp_path / "missing")):
        assert local_keys.key_dir({"XDG_RUNTIME_DIR": bad, "HOME": str(home)}) == (
            home / ".cache" / "pdserve" / "keys"
        )
    cache = tmp_path / "cache"
    assert local_keys.key_dir({"XDG_CACHE_HOME": str(cache), "HOME": str(home)}) == (
        cache / "pdserve" / "keys"
    )


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("http://127.0.0.1:8000", ("localhost", 8000)),
        ("http://localhost:8000/", ("localhost", 8000)),
        ("http://LOCALHOST:8000", ("localhost", 8000)),
        ("http://[::1]:8000", ("localhost", 8000)),
        ("http://0.0.0.0:8000", ("localhost", 8000)),
        ("http://127.1.2.3:8000", ("localhost", 8000)),
        ("127.0.0.1:8000", ("localhost", 8000)),
        ("http://10.0.0.7:9000/v1", ("10.0.0.7", 9000)),
        ("http://gpu-3.example:9000", ("gpu-3.example", 9000)),
        ("http://gpu-3", ("gpu-3", 80)),
        ("https://gpu-3", ("gpu-3", 443)),
    ],
)
def test_an_address_names_one_listener(url: str, address: tuple[str, int]) -> None:
    assert local_keys.address(url) == address


def test_a_url_without_a_host_is_refused() -> None:
    with pytest.raises(ValueError, match="names no host"):
        local_keys.address("http://:8000")


def test_ipv6_hosts_make_a_plain_file_name(env: dict[str, str]) -> None:
    path = local_keys.key_path("http://[fe80::1]:8000", env)
    assert path.name == "fe80__1-8000.key"


def test_publish_then_find_from_any_name_of_the_address(env: dict[str, str]) -> None:
    k = key()
    path = local_keys.publish("http://0.0.0.0:8123", k, env)
    assert path == Path(env["XDG_RUNTIME_DIR"]) / "pdserve" / "keys" / "localhost-8123.key"
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert ClusterKey.load(path) == k  # an ordinary key file: --cluster-key-file takes it
    for url in ("http://127.0.0.1:8123", "http://localhost:8123/", "http://[::1]:8123"):
        found = local_keys.find(url, env)
        assert found is not None and found.secret == k.secret
    assert local_keys.find("http://127.0.0.1:8124", env) is None
    assert local_keys.find("not a url at all: ::", env) is None
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing left aside


def test_a_new_cluster_on_the_address_replaces_the_file(env: dict[str, str]) -> None:
    old, new = key(), key()
    path = local_keys.publish("http://127.0.0.1:8000", old, env)
    assert local_keys.publish("http://127.0.0.1:8000", new, env) == path
    found = local_keys.find("http://127.0.0.1:8000", env)
    assert found is not None and found.secret == new.secret
    # The old cluster stops after the new one started: it leaves the new one's file alone.
    assert not local_keys.withdraw(path, old)
    assert path.exists()
    assert local_keys.withdraw(path, new)
    assert not path.exists()
    assert not local_keys.withdraw(path, new)  # gone already: nothing to do


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_a_key_others_can_read_or_write_is_refused(env: dict[str, str], mode: int) -> None:
    path = local_keys.publish("http://127.0.0.1:8000", key(), env)
    path.chmod(mode)
    with pytest.raises(ClusterKeyError) as e:
        local_keys.find("http://127.0.0.1:8000", env)
    assert str(e.value) == (
        f"not using the local key of http://127.0.0.1:8000: cluster key file {path} is "
        f"readable by others (mode {mode:o}); chmod 600 it"
    )


def test_a_link_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.key"
    generate(elsewhere)
    path = local_keys.key_path("http://127.0.0.1:8000", env)
    path.parent.mkdir(parents=True, mode=0o700)
    path.symlink_to(elsewhere)
    with pytest.raises(ClusterKeyError, match="not using the local key of .*: cluster key file"):
        local_keys.find("http://127.0.0.1:8000", env)


def test_a_key_another_user_owns_is_refused(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    local_keys.publish("http://127.0.0.1:8000", key(), env)
    me = os.getuid()
    monkeypatch.setattr(local_keys.os, "getuid", lambda: me + 1)
    monkeypatch.setattr(local_keys, "_owned_dir", lambda path: True)  # the same directory
    with pytest.raises(ClusterKeyError, match=rf"belongs to uid {me}, not to you \(uid {me + 1}\)"):
        local_keys.find("http://127.0.0.1:8000", env)


def test_a_directory_others_can_use_is_not_written(env: dict[str, str]) -> None:
    d = local_keys.key_dir(env)
    d.mkdir(parents=True, mode=0o700)
    d.chmod(0o777)
    with pytest.raises(ClusterKeyError, match="only you can use .*mode 777.*chmod 700"):
        local_keys.publish("http://127.0.0.1:8000", key(), env)
    assert list(d.iterdir()) == []


@pytest.fixture
def undecided(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, str]:
    """httpcall with no key decided yet, no key named in the environment, `env`'s key dir."""
    monkeypatch.setattr(httpcall, "_auth", None)
    monkeypatch.setattr(httpcall, "_origin", "no key")
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])
    return env


def test_the_client_uses_the_local_key_of_its_url(undecided: dict[str, str]) -> None:
    k = key()
    path = local_keys.publish("http://127.0.0.1:8000", k, undecided)
    assert httpcall.use_key_for("http://127.0.0.1:8000") is None
    assert httpcall.auth_headers() == k.http_headers
    assert httpcall.key_origin() == f"the key `pdserve launch` left in {path}"


def test_the_client_sends_no_key_when_there_is_none(undecided: dict[str, str]) -> None:
    assert httpcall.use_key_for("http://127.0.0.1:8000") is None
    assert httpcall.auth_headers() == {}
    assert httpcall.key_origin().startswith("no key (none for http://127.0.0.1:8000 in ")


def test_the_client_refuses_an_open_local_key(undecided: dict[str, str]) -> None:
    path = local_keys.publish("http://127.0.0.1:8000", key(), undecided)
    path.chmod(0o644)
    refused = httpcall.use_key_for("http://127.0.0.1:8000")
    assert refused is not None and "readable by others (mode 644); chmod 600 it" in refused
    assert httpcall.auth_headers() == {}


def test_a_named_key_wins_over_the_local_one(
    undecided: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_keys.publish("http://127.0.0.1:8000", key(), undecided)
    named = generate(tmp_path / "named.key")
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "named.key"))
    assert httpcall.use_key_for("http://127.0.0.1:8000") is None
    assert httpcall.auth_headers() == named.http_headers
    # And a key decided before (a flag) is kept.
    other = key()
    httpcall.use_key(other, "--cluster-key-file X")
    assert httpcall.use_key_for("http://127.0.0.1:8000") is None
    assert httpcall.auth_headers() == other.http_headers
