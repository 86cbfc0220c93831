"""DeepSeek-V4 with fp8 KV (`--kv-dtype fp8`) through PD (a prefill and a decode role in one
process, KV over shm): greedy tokens equal co-located fp8's exactly on the issue's prompt
lengths, every component D decodes from (fp8 entries, their scales, the rotary parts, the
per-request state) byte-equal to what P computed; a peer of the other KV dtype is refused at
registration, naming the component and both dtypes."""

from __future__ import annotations

import pytest

from pdserve.protocol.sampling import SamplingParams
from tests.engine.test_parity import prompts_for
from tests.helpers import make_engine, run
from tests.worker.test_deepseek_v4_pd import watch_byte_exact
from tests.worker.wire import Wire, ended, tokens

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
LENGTHS = [5, 77, 131, 258, 301, 517]


@pytest.fixture(scope="module")
def v4_dir(builtin_dir):  # type: ignore[no-untyped-def]
    return builtin_dir("deepseek-v4-tiny")


def wire(v4_dir, kv_dtype: tuple[str, str]) -> Wire:  # type: ignore[no-untyped-def]
    return Wire(v4_dir, page_size=128, chunk=100, d_kv_mb=16, p_kv_mb=16, kv_dtype=kv_dtype)


def test_fp8_pd_equals_colocated_fp8_every_component_byte_exact(v4_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """test_deepseek_v4_pd.py's byte-exact check: every page P wrote for a room (KV pages and
    its state slot's), as P held it when the write was posted, equals D's page when D takes
    the room's PrefillDone, component by component."""
    prompts = prompts_for(2000, LENGTHS, seed=5)
    colocated = run(make_engine(v4_dir, chunk=100, kv_mb=16, kv_dtype="fp8"), prompts, GREEDY)
    w = wire(v4_dir, ("fp8", "fp8"))
    checked = watch_byte_exact(monkeypatch)
    got = w.run_jobs([(p, GREEDY) for p in prompts])
    assert [got[f"r{i}"][0] for i in range(len(prompts))] == colocated
    assert all(reason == "length" for _, reason in got.values())
    layout = w.d.pool.layout
    assert layout.buffer("hca.kv").dtype == "float8_e4m3fn"
    assert checked == {b.name for b in layout.buffers} | {s.name for s in layout.state}
    assert w.violations() == []


@pytest.mark.parametrize(
    ("p_dtype", "d_dtype", "why"),
    [
        ("auto", "fp8", "buffer 'csa.kv' dtype: 'float32' vs 'float8_e4m3fn' (prefill vs decode)"),
        ("fp8", "auto", "buffer 'csa.kv' dtype: 'float8_e4m3fn' vs 'float32' (prefill vs decode)"),
    ],
)
def test_a_peer_of_the_other_kv_dtype_is_refused(v4_dir, p_dtype, d_dtype, why) -> None:  # type: ignore[no-untyped-def]
    w = wire(v4_dir, (p_dtype, d_dtype))
    out = w.submit("r", prompts_for(2000, [40], seed=7)[0], GREEDY)
    w.run_until(lambda: ended(out))
    assert out[-1].finish_reason == "error" and why in (out[-1].error or "")
    assert [reason for _, _, reason in w.p_role.refusals] == [f"KV layout mismatch, {why}"]
    assert w.p_role.by_room == {} and tokens(out) == []
    w.run_until(w.idle)
