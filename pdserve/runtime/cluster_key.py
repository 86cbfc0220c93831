"""The cluster key: the one secret that the workers and the router of a cluster share.

What it protects (docs/security.md): the ZMQ control plane between prefill and decode workers
(an HMAC on every frame, transfer/frame_auth.py) and the workers' own HTTP APIs (/generate,
/abort, /info, /debug/*), which take `Authorization: Bearer <token>`. The bearer token is
derived from the key, never the key itself: someone who reads a worker's HTTP traffic can
call those APIs, but still cannot sign a control frame.

The key lives in a file readable by its owner only (mode 0600, as ssh insists for its keys):
`pdserve launch` generates one per cluster, `pdserve keygen --out FILE` makes one for
workers started by hand on several hosts. `--cluster-key-file` names it, or the environment
variable PDSERVE_CLUSTER_KEY_FILE; the operator tools also find the key of a cluster that
`pdserve launch` started for this user from its router's URL (runtime/local_keys.py).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

KEY_FILE_ENV = "PDSERVE_CLUSTER_KEY_FILE"
KEY_BYTES = 32
HTTP_HEADER = "Authorization"


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an Authorization header is `Bearer <token>` (constant time): the one check of a
    bearer token, the cluster's or an API key. The header is whatever a client sent: aiohttp
    decodes its bytes as UTF-8 with surrogateescape, so bytes that are not UTF-8 arrive as
    lone surrogates, which a plain `.encode()` refuses (once a 500 on every keyed path, for
    anyone). "surrogatepass" encodes every str, one to one, so such a header is just wrong."""
    if not header or not header.startswith("Bearer "):
        return False
    given = header[len("Bearer ") :].encode("utf-8", "surrogatepass")
    return hmac.compare_digest(given, token.encode())


class ClusterKeyError(ValueError):
    """The key file is missing, unreadable, too open or not a key: the operator's fault."""


@dataclass(frozen=True)
class ClusterKey:
    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) < KEY_BYTES:
            raise ClusterKeyError(f"a cluster key needs at least {KEY_BYTES} bytes of secret")

    def __repr__(self) -> str:  # never print the secret
        return "ClusterKey(<secret>)"

    def derive(self, purpose: str) -> bytes:
        """A sub-key for one purpose, so no two uses of the key share a MAC key."""
        return hmac.new(self.secret, b"pdserve-v1/" + purpose.encode(), hashlib.sha256).digest()

    @functools.cached_property
    def http_token(self) -> str:
        """The bearer token (derived once: an HMAC per call was ~4% of a worker's event loop
        per /generate)."""
        return self.derive("http").hex()

    @property
    def http_headers(self) -> dict[str, str]:
        return {HTTP_HEADER: f"Bearer {self.http_token}"}

    def http_ok(self, header: str | None) -> bool:
        """Whether an Authorization header carries this cluster's token (constant time)."""
        return bearer_matches(header, self.http_token)

    @classmethod
    def load(cls, path: str | Path, owner: int | None = None) -> ClusterKey:
        """The key in `path`: a regular file (not a link) that only its owner can read, and,
        with `owner`, owned by that uid (a key found by convention rather than named)."""
        p = Path(path)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise ClusterKeyError(f"cluster key file {p}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ClusterKeyError(f"cluster key file {p} is not a regular file")
            if owner is not None and st.st_uid != owner:
                raise ClusterKeyError(
                    f"cluster key file {p} belongs to uid {st.st_uid}, not to you (uid {owner})"
                )
            if st.st_mode & 0o077:
                raise ClusterKeyError(
                    f"cluster key file {p} is readable by others (mode {st.st_mode & 0o777:o}); "
                    "chmod 600 it"
                )
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        try:
            secret = bytes.fromhex(raw.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError) as e:
            raise ClusterKeyError(f"cluster key file {p} does not hold a hex key") from e
        return cls(secret)

    @classmethod
    def from_env(cls, path: str | None) -> ClusterKey | None:
        """The key named by `path`, else by PDSERVE_CLUSTER_KEY_FILE, else None."""
        path = path or os.environ.get(KEY_FILE_ENV) or None
        return cls.load(path) if path else None


def write(path: str | Path, key: ClusterKey) -> None:
    """Write `key` to a new file `path`, created 0600 (refuses to overwrite a file)."""
    fd = os.open(Path(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.secret.hex() + "\n")


def generate(path: str | Path) -> ClusterKey:
    """Write a new random key to `path`, created 0600 (refuses to overwrite a file)."""
    key = ClusterKey(secrets.token_bytes(KEY_BYTES))
    write(path, key)
    return key
