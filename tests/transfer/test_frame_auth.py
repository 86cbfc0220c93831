"""Control-frame authentication: only fresh frames signed with the cluster key get through."""

from __future__ import annotations

import secrets
import struct

import pytest

from pdserve.runtime.cluster_key import ClusterKey, ClusterKeyError, generate
from pdserve.transfer import frame_auth
from pdserve.transfer.bulk import Bulk, BulkRefused
from pdserve.transfer.frame_auth import FrameAuth, Refusal


def key() -> ClusterKey:
    return ClusterKey(secrets.token_bytes(32))


def test_a_signed_frame_passes_once():
    k = key()
    d, p = FrameAuth(k, "decode-1"), FrameAuth(k, "prefill-1")
    parts = d.sign([b"body", b"page bytes"])
    assert p.check("decode-1", parts) is None
    assert p.check("decode-1", parts) is Refusal.REPLAY  # the same frame again
    assert p.check("decode-1", d.sign([b"next"])) is None  # later frames still pass


def test_unsigned_altered_and_foreign_frames_are_refused():
    k = key()
    d, p = FrameAuth(k, "decode-1"), FrameAuth(k, "prefill-1")
    assert p.check("decode-1", [b"body"]) is Refusal.MISSING  # a stranger's plain frame
    assert p.check("decode-1", []) is Refusal.MISSING
    good = d.sign([b"body", b"page"])
    assert p.check("decode-1", [good[0], b"bodY", b"page"]) is Refusal.BAD_MAC
    assert p.check("decode-1", [good[0], b"body"]) is Refusal.BAD_MAC  # a frame dropped
    assert p.check("decode-1", [good[0], b"body", b"page", b"x"]) is Refusal.BAD_MAC
    stranger = FrameAuth(key(), "decode-1")  # right name, another cluster's key
    assert p.check("decode-1", stranger.sign([b"body"])) is Refusal.BAD_MAC
    bad_magic = b"XXXX" + good[0][4:]
    assert p.check("decode-1", [bad_magic, b"body", b"page"]) is Refusal.MISSING


def test_a_frame_must_come_from_the_sender_it_names():
    k = key()
    d, p = FrameAuth(k, "decode-1"), FrameAuth(k, "prefill-1")
    # On P's ROUTER socket the routing identity is the D's; a frame naming another is refused.
    assert p.check("decode-2", d.sign([b"body"])) is Refusal.WRONG_SENDER
    assert p.check(None, d.sign([b"body"])) is None  # a DEALER reports no routing identity


def test_stale_frames_are_refused(monkeypatch):
    k = key()
    d, p = FrameAuth(k, "decode-1"), FrameAuth(k, "prefill-1")
    now = 1_000_000.0
    monkeypatch.setattr(frame_auth.time, "time", lambda: now)
    old = d.sign([b"body"])
    now += frame_auth.MAX_SKEW_S + 1
    assert p.check("decode-1", old) is Refusal.STALE
    assert p.check("decode-1", d.sign([b"body"])) is None


def test_a_forged_time_cannot_be_written_without_the_key():
    k = key()
    d, p = FrameAuth(k, "decode-1"), FrameAuth(k, "prefill-1")
    parts = d.sign([b"body"])
    head = bytearray(parts[0])
    struct.pack_into(">d", head, 28, float("nan"))  # the time field
    assert p.check("decode-1", [bytes(head), b"body"]) is Refusal.BAD_MAC


def test_sessions_are_bounded(monkeypatch):
    monkeypatch.setattr(frame_auth, "MAX_SESSIONS", 3)
    k = key()
    p = FrameAuth(k, "prefill-1")
    senders = [FrameAuth(k, f"decode-{i}") for i in range(4)]
    for i, s in enumerate(senders[:3]):
        assert p.check(f"decode-{i}", s.sign([b"x"])) is None
    assert p.check("decode-3", senders[3].sign([b"x"])) is Refusal.SESSIONS_FULL
    assert p.check("decode-0", senders[0].sign([b"x"])) is None  # known sessions go on


def test_key_files(tmp_path):
    path = tmp_path / "k"
    made = generate(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert ClusterKey.load(path) == made
    with pytest.raises(FileExistsError):
        generate(path)
    path.chmod(0o644)
    with pytest.raises(ClusterKeyError, match="readable by others"):
        ClusterKey.load(path)
    short = tmp_path / "short"
    short.write_text("abcd")
    short.chmod(0o600)
    with pytest.raises(ClusterKeyError):
        ClusterKey.load(short)
    with pytest.raises(ClusterKeyError):
        ClusterKey.load(tmp_path / "missing")
    assert made.secret.hex() not in repr(made)


def test_http_token():
    k = key()
    assert k.http_ok(f"Bearer {k.http_token}")
    assert not k.http_ok(f"Bearer {key().http_token}")
    assert not k.http_ok(None)
    assert not k.http_ok(k.http_token)  # no scheme
    assert k.secret.hex() not in k.http_token  # the token is derived, not the key itself


def test_bulk_frames_are_covered_by_their_digests():
    k = key()
    p, d = FrameAuth(k, "prefill-1"), FrameAuth(k, "decode-1")
    pages = [b"page one" * 100, b"page two" * 100]
    bulk = Bulk.seal(pages)
    parts = [*p.sign([b"body"], bulk.digests), *pages]
    assert d.check(None, parts) is None  # the MAC covered the digests, not the pages
    assert FrameAuth.digests(parts[0]) == bulk.digests
    # Altered bytes pass the MAC (it never read them), but not their digest's check.
    altered = Bulk.received([pages[0], b"x" + pages[1][1:]], FrameAuth.digests(parts[0]))
    assert altered.checked(0) == pages[0]
    with pytest.raises(BulkRefused, match="frame 1 of 2 does not match its digest"):
        altered.checked(1)
    with pytest.raises(BulkRefused):
        altered.frames()
    # The digests themselves are under the MAC: another digest fails the frame.
    fresh = [*p.sign([b"body"], bulk.digests), *pages]
    forged = bytearray(fresh[0])
    forged[frame_auth._HEAD.size + frame_auth.MAC_LEN] ^= 1
    assert d.check(None, [bytes(forged), *fresh[1:]]) is Refusal.BAD_MAC


def test_the_body_is_never_bulk_and_the_count_must_fit():
    k = key()
    p, d = FrameAuth(k, "prefill-1"), FrameAuth(k, "decode-1")
    with pytest.raises(ValueError, match="follow a body"):
        p.sign([], [bytes(32)])
    one = Bulk.seal([b"page"])
    signed = p.sign([b"body"], one.digests)
    assert d.check(None, [signed[0], b"body"]) is Refusal.MISSING  # a bulk frame missing
    assert d.check(None, [signed[0], b"body", b"page", b"more"]) is Refusal.BAD_MAC
    # An auth frame that declares more digests than it carries is refused before its MAC.
    head = bytearray(signed[0])
    struct.pack_into(">H", head, frame_auth._HEAD.size - 2, 9)
    assert d.check(None, [bytes(head), b"body", *[b"p"] * 9]) is Refusal.MISSING
