"""Local keys: the key of each cluster `pdserve launch` runs, kept for the user who launched it.

`pdserve doctor --url URL`, `pdserve chaos --url URL` and their HTTP client need the cluster
key to read /debug/*. A launch leaves what its own user needs to inspect it: once its router
is up, the launcher copies the cluster key to KEY_DIR/<host>-<port>.key, the router's address,
and removes it when the cluster stops. The tools find it from the URL alone, when no flag or
$PDSERVE_CLUSTER_KEY_FILE names a key (those win).

KEY_DIR is $XDG_RUNTIME_DIR/pdserve/keys (a per-user tmpfs, emptied at logout, so a file a
killed launcher left does not outlive the session), else $XDG_CACHE_HOME/pdserve/keys, else
~/.cache/pdserve/keys; created 0700.

Invariants:
* A tool reads a local key only from a regular file (never a link) that this user owns and
  nobody else can read or write (mode 0600, as ssh insists); anything else is refused with
  the reason, never used.
* The file name depends only on (host, port); loopback and wildcard hosts (127.0.0.1,
  localhost, ::1, 0.0.0.0, ::) count as one host, since a port on them is one listener.
* A file is replaced whole (written aside, then renamed), so a reader sees an old key or a new
  one, never half of one; a launcher removes the file only while it still holds its own key,
  so a newer cluster on the same port keeps its file when an older one stops.

Imports no other pdserve package but cluster_key (runtime/ is layer 0).
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.runtime.cluster_key import ClusterKey, ClusterKeyError, write

LOCAL_HOST = "localhost"  # the one name of every loopback and wildcard address
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")  # what a host may not put into a file name


def key_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where this user's local keys live (see the module docstring); not created here."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and _owned_dir(Path(runtime)):
        return Path(runtime) / "pdserve" / "keys"
    cache = env.get("XDG_CACHE_HOME", "")
    if cache and os.path.isabs(cache):
        return Path(cache) / "pdserve" / "keys"
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".cache" / "pdserve" / "keys"


def _owned_dir(path: Path) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def address(url: str) -> tuple[str, int]:
    """(host, port) of a URL as local keys are named: a loopback or wildcard host is
    LOCAL_HOST, a missing port the scheme's. ValueError for a URL without a host."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    host = (parts.hostname or "").lower()
    if not host:
        raise ValueError(f"{url!r} names no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)  # ValueError: a bad port
    if host == "localhost":
        return LOCAL_HOST, port
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host, port
    return (LOCAL_HOST if ip.is_loopback or ip.is_unspecified else host), port


def key_path(url: str, env: Mapping[str, str] | None = None) -> Path:
    """The file of the cluster whose router is at `url` (it may not exist)."""
    host, port = address(url)
    return key_dir(env) / f"{_UNSAFE.sub('_', host)}-{port}.key"


def publish(url: str, key: ClusterKey, env: Mapping[str, str] | None = None) -> Path:
    """Leave `key` for the tools of this user as the key of the router at `url`, replacing a
    file a previous cluster on that address left; its path. OSError when it cannot be written;
    ClusterKeyError when the directory is not this user's alone."""
    path = key_path(url, env)
    _ensure_private_dir(path.parent)
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.unlink(missing_ok=True)
    write(aside, key)
    try:
        os.replace(aside, path)
    except OSError:
        aside.unlink(missing_ok=True)
        raise
    return path


def withdraw(path: Path, key: ClusterKey) -> bool:
    """Remove `path` if it still holds `key` (not a newer cluster's); whether it did."""
    try:
        if ClusterKey.load(path, owner=os.getuid()).secret != key.secret:
            return False
        path.unlink()
    except (OSError, ClusterKeyError):  # gone already, or no longer ours to remove
        return False
    return True


def find(url: str, env: Mapping[str, str] | None = None) -> ClusterKey | None:
    """The key `pdserve launch` left for the cluster at `url`; None when there is none.
    ClusterKeyError, naming the file and why, when one is there but is not safe to use."""
    try:
        path = key_path(url, env)
    except ValueError:
        return None
    try:
        os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ClusterKeyError(f"local key file {path}: {e.strerror}") from e
    try:
        return ClusterKey.load(path, owner=os.getuid())
    except ClusterKeyError as e:
        raise ClusterKeyError(f"not using the local key of {url}: {e}") from e


def _ensure_private_dir(path: Path) -> None:
    """Create `path` 0700 if need be, and check it is a directory only this user can use."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ClusterKeyError(
            f"local key directory {path} is not a directory that only you can use "
            f"(owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}); chmod 700 it"
        )
