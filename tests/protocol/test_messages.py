import random

import msgspec
import pytest

from pdserve.protocol import messages as m
from pdserve.protocol.layout_desc import BufferDesc, LayoutDesc
from pdserve.protocol.sampling import SamplingParams

SAMPLES = [
    m.Hello(nonce=2**63 - 1),
    m.HelloAck(nonce=5, address="tcp://p:1"),
    m.Register(
        room=0,
        sender="d0",
        layout=LayoutDesc(
            buffers=(BufferDesc("k", (2, 8), "float32"), BufferDesc("v", (2, 8), "float32", (0,))),
            page_size=16,
            num_layers=2,
        ),
        backend="shm",
        shm=m.ShmPool(pid=1, fd=3, token="ab" * 16),
    ),
    m.RegisterAck(ok=False, error="dtype: float32 vs bfloat16"),
    m.PrefillRequest(
        room=2**62 + 5,
        epoch=3,
        prompt_ids=[1, 2, 3],
        dst_pages=[7, 9],
        params=SamplingParams(temperature=0.0, stop_token_ids=(2, 3), logit_bias=((5, -1.5),)),
        write_deadline=1.8e9,
    ),
    m.PrefillAccept(room=1, epoch=1),
    m.PrefillReject(room=1, reason="full"),
    m.KVChunk(room=1, epoch=1, dst_pages=[4]),
    m.FirstToken(room=1, epoch=1, token=42),
    m.PrefillDone(room=1, epoch=1, first_token=42),
    m.PrefillFailed(room=1, reason="x"),
    m.Abort(room=1, epoch=1),
    m.AbortAck(room=1, known=False),
    m.Ping(nonce=3),
    m.Pong(nonce=3),
]


def test_every_type_round_trips():
    assert {type(s) for s in SAMPLES} == set(m.MESSAGE_TYPES)
    for s in SAMPLES:
        assert m.decode(m.encode(s)) == s


def test_unknown_type_malformed_and_version_are_typed_errors():
    unknown = msgspec.msgpack.encode({"type": "Teleport", "room": 1})
    assert m.decode(unknown) == m.DecodeError("unknown_type", "type 'Teleport'")
    assert m.decode(b"\xff\x00garbage").kind == "malformed"
    assert m.decode(b"").kind == "malformed"
    missing = msgspec.msgpack.encode({"type": "PrefillDone", "room": 1})
    assert m.decode(missing).kind == "malformed"
    wrong = msgspec.msgpack.encode({"type": "Abort", "room": "one"})
    assert m.decode(wrong).kind == "malformed"
    future = msgspec.msgpack.encode({"type": "Ping", "proto_version": 99})
    assert m.decode(future).kind == "version"


@pytest.mark.parametrize("seed", range(3))
def test_random_and_truncated_frames_never_raise(seed):
    rng = random.Random(seed)
    frames = [m.encode(s) for s in SAMPLES]
    for _ in range(2000):
        f = rng.choice(frames)
        cut = f[: rng.randrange(len(f) + 1)]
        flipped = bytearray(f)
        flipped[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        for frame in (cut, bytes(flipped), rng.randbytes(rng.randrange(40))):
            out = m.decode(frame)
            assert isinstance(out, (m.DecodeError, *m.MESSAGE_TYPES))


@pytest.mark.parametrize("room", ["one", -1, 2**63, True, None])
def test_a_malformed_frame_with_an_unreadable_envelope_names_no_room(room):
    raw = msgspec.msgpack.encode({"type": "PrefillRequest", "room": room, "params": 3})
    err = m.decode(raw)
    assert isinstance(err, m.DecodeError) and err.kind == "malformed"
    assert (err.of, err.room, err.epoch) == ("", 0, 0)


def test_an_unhashable_type_tag_is_an_unknown_type():
    err = m.decode(msgspec.msgpack.encode({"type": [1], "room": 1}))
    assert isinstance(err, m.DecodeError) and err.kind == "unknown_type"
