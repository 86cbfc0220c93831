"""The penalties' device state (engine/sampling/penalty_state.py): a `Sampler` that keeps each
penalised request's counts on the device gives logits bit-identical to the stateless sampler
reading every id from the host, over random runs with requests joining, finishing, preempted,
sampled row by row by the isolation fallback, failing a launch, and with their last token still
in flight; and the engine's overlapped loop no longer waits for the step in flight."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

import pdserve.engine.sampler as sampler_module
import pdserve.engine.sampling.batch as batch_module
from pdserve.engine.request import Event, Request, Status
from pdserve.engine.sampler import Sampled, Sampler, sample
from pdserve.engine.sampling.penalty_state import PenaltyState
from pdserve.protocol.sampling import SamplingParams
from tests.helpers import make_engine

VOCAB = 24
MAX_RUNNING = 4  # the engine's max_running: the sampler's max_slots


def params(rng: random.Random, n: int) -> SamplingParams:
    """Mostly penalised rows (some not), greedy or seeded draws, sometimes a bias."""
    pen = rng.random() < 0.8
    return SamplingParams(
        max_tokens=1000,
        temperature=rng.choice([0.0, 0.9]),
        seed=n,
        repetition_penalty=rng.choice([1.0, 1.4, 0.7]) if pen else 1.0,
        frequency_penalty=rng.choice([0.0, 0.6, -0.4]) if pen else 0.0,
        presence_penalty=rng.choice([0.0, 0.9]) if pen else 0.0,
        logit_bias=((rng.randrange(VOCAB), 1.5),) if rng.random() < 0.3 else (),
    )


@dataclass
class Sim:
    """Drives a Sampler as the engine's overlapped loop does: a launched step's tokens are
    pending (`Request.pending`) until the next step launched, then land in `output_ids`
    (dropped for a request that finished meanwhile). Each launch is checked against the
    stateless `sample` over copies of the requests holding every id on the host."""

    rng: random.Random
    sampler: Sampler
    device: torch.device
    live: list[Request] = field(default_factory=list)
    inflight: list[tuple[Request, int]] = field(default_factory=list)
    launches: int = 0
    checked_rows: int = 0
    # Sampled row by row since their last launch: their slots count those tokens next launch.
    behind: set[int] = field(default_factory=set)

    def join(self, n: int) -> None:
        prompt = [self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(1, 9))]
        req = Request(f"r{n}", prompt, params(self.rng, n), sink=lambda o: None)
        if self.rng.random() < 0.3:  # a decode worker's request: its first token came from P
            req.output_ids = [self.rng.randrange(VOCAB)]
        self.live.append(req)  # waiting: `events` schedules it when a running place is free

    def land(self) -> None:
        """The step in flight completes: its tokens reach the host."""
        for req, tok in self.inflight:
            req.pending -= 1
            if not req.status.finished:
                req.output_ids.append(tok)
        self.inflight = []

    def history(self, req: Request) -> list[int]:
        """Every output id of `req`, those in flight included."""
        return req.output_ids + [t for r, t in self.inflight if r is req]

    def reference(self, req: Request) -> Request:
        ref = Request(req.request_id, req.prompt_ids, req.params, sink=lambda o: None)
        ref.output_ids = self.history(req)
        return ref

    def step(self, spy: dict[str, list[torch.Tensor]]) -> None:
        batch = [r for r in self.live if r.status is Status.RUNNING]
        if not batch:
            return
        logits = (torch.randn(len(batch), VOCAB) * 3).to(self.device)
        refs = [self.reference(r) for r in batch]
        spy.clear()
        expected, _ = sample(logits, refs)
        ref_logits = spy.pop("host", [])
        if self.rng.random() < 0.05:  # a launch that fails: the fallback
            self.failing_launch(logits, batch)
            return
        sampled = self.sampler.launch(logits, batch)
        self.launches += 1
        got, _ = sampled.result()
        assert got == expected
        for a, b in zip(spy.get("slots", []), ref_logits, strict=True):
            assert torch.equal(a, b)  # bit for bit, not merely close
            self.checked_rows += int(a.shape[0])
        for req in batch:
            req.pending += 1
            self.behind.discard(id(req))
        self.land()  # the engine processes the previous step after launching this one
        self.inflight = list(zip(batch, got, strict=True))

    def failing_launch(self, logits: torch.Tensor, batch: list[Request]) -> None:
        """A launch raises before its plan (the batch's bias ids are checked first: the slots
        then miss the fallback's tokens, counted at the next launch) or after it (a draw: the
        plan's slots are dropped, rebuilt at the next launch)."""
        module, name = self.rng.choice([(sampler_module, "draw"), (batch_module, "_sparse")])
        real = getattr(module, name)

        def broken(*a: object, **k: object) -> torch.Tensor:
            raise FloatingPointError("a poisoned row")

        setattr(module, name, broken)
        try:
            if name == "_sparse" or any(not r.params.greedy for r in batch):
                with pytest.raises(FloatingPointError):
                    self.sampler.launch(logits, batch)
        finally:
            setattr(module, name, real)
        self.land()  # the engine's fallback: the step in flight first, then row by row
        ids, _ = sample(logits, batch)
        for req, tok in zip(batch, ids, strict=True):
            req.output_ids.append(tok)
            self.behind.add(id(req))

    def events(self) -> None:
        for req in list(self.live):
            x = self.rng.random()
            if x < 0.04:
                ends = [Event.ABORT, Event.FAIL]
                req.transition(
                    self.rng.choice(ends + [Event.STOP, Event.LENGTH])
                    if req.status is Status.RUNNING
                    else self.rng.choice(ends)
                )
                self.live.remove(req)
            elif x < 0.12 and req.status is Status.RUNNING:
                req.transition(Event.PREEMPT)  # possibly with its token in flight
            elif req.status is Status.WAITING and x < 0.5 and self.running() < MAX_RUNNING:
                req.transition(Event.SCHEDULE)

    def running(self) -> int:
        return sum(r.status is Status.RUNNING for r in self.live)

    def check_state(self) -> None:
        """Each slot holds every output id's count, and marks its prompt and output ids."""
        state = self.sampler.penalties
        if state.counts is None or state.seen is None:
            return
        for req in self.live:
            slot = state.slot_of(req)
            if slot is None or id(req) in self.behind:
                continue
            counts = torch.bincount(
                torch.tensor(self.history(req), dtype=torch.long), minlength=VOCAB
            )
            assert torch.equal(state.counts[slot].cpu(), counts.float()), req.request_id
            seen = torch.zeros(VOCAB, dtype=torch.bool)
            seen[req.prompt_ids + self.history(req)] = True
            assert torch.equal(state.seen[slot].cpu(), seen), req.request_id


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[torch.Tensor]]:
    """The penalised logits of each path, as each sampler call left them."""
    seen: dict[str, list[torch.Tensor]] = {}
    for name, key in (("apply_penalties", "host"), ("apply_slot_penalties", "slots")):
        real = getattr(sampler_module, name)

        def spying(logits, *args, real=real, key=key):  # type: ignore[no-untyped-def]
            real(logits, *args)
            seen.setdefault(key, []).append(logits.clone())

        monkeypatch.setattr(sampler_module, name, spying)
    return seen


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    ("seed", "device"),
    [(0, "cpu"), (1, "cpu"), (2, "cpu"), pytest.param(3, "cuda", marks=CUDA)],
)
def test_device_state_gives_the_host_paths_logits_bit_for_bit(seed, device, spy):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # More requests than slots: some are reused.
    sim = Sim(rng, Sampler(max_slots=MAX_RUNNING), torch.device(device))
    n = 0
    for _ in range(100):
        while len(sim.live) < 8 or rng.random() < 0.15:
            sim.join(n)
            n += 1
        sim.events()
        sim.step(spy)
        sim.check_state()
    assert sim.launches > 60 and sim.checked_rows > 150
    state = sim.sampler.penalties
    # Bounded: waiting requests' slots were taken; only requests preempted with a token in
    # flight (often here) make it grow.
    assert MAX_RUNNING <= state.capacity <= 2 * MAX_RUNNING


def test_a_finished_requests_slot_is_reused_clean():
    state_sampler = Sampler(max_slots=2)
    state: PenaltyState = state_sampler.penalties
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    a = Request("a", [1, 2], p, sink=lambda o: None)
    a.output_ids = [5, 5, 7]
    logits = torch.zeros(1, VOCAB)
    state_sampler.launch(logits, [a]).result()
    assert state.slot_of(a) == 0 and int(state.counts[0, 5]) == 2  # type: ignore[index]
    a.transition(Event.SCHEDULE)
    a.transition(Event.ABORT)
    b = Request("b", [3], p, sink=lambda o: None)
    (tok,), _ = state_sampler.launch(logits, [b]).result()
    assert tok == 0 and state.slot_of(a) is None and state.slot_of(b) == 0
    assert state.capacity == 2 and len(state) == 1 and state.counts is not None
    assert state.counts[0].tolist() == [1] + [0] * (VOCAB - 1)  # only b's own token
    assert state.seen is not None and state.seen[0].nonzero().flatten().tolist() == [0, 3]


def test_a_token_in_flight_the_state_did_not_count_is_refused():
    s = Sampler(max_slots=2)
    req = Request("a", [1], SamplingParams(temperature=0, presence_penalty=1.0), lambda o: None)
    req.pending = 1  # a token in flight that no launch of this sampler drew
    with pytest.raises(RuntimeError, match="in flight"):
        s.launch(torch.zeros(1, VOCAB), [req])
    assert len(s.penalties) == 0  # nothing half-planned stays


class HostIds:
    """The stateless sampler (every id uploaded from the host), in place of an engine's."""

    def launch(self, logits: torch.Tensor, reqs: list[Request]) -> Sampled:
        assert all(r.pending == 0 for r in reqs)  # the plain loop: every id is on the host
        return sampler_module.launch(logits, reqs)


def test_overlapped_penalties_no_longer_wait_for_the_step_in_flight(tiny_dir):
    """The engine's overlapped loop launches a penalised row with its last token still on the
    device (pending), and gives exactly the tokens of the plain loop sampling from host ids,
    with preemptions (a KV pool too small for every request) and requests joining."""
    from tests.engine.test_overlap import PROMPTS, run  # its Wire import is heavy

    jobs = [
        (
            p,
            SamplingParams(
                max_tokens=8,
                temperature=0.8 if i % 2 else 0.0,
                seed=i,
                repetition_penalty=1.3,
                frequency_penalty=0.4 * (i % 3),
                presence_penalty=0.5,
                ignore_eos=True,
            ),
        )
        for i, p in enumerate(PROMPTS[:6])
    ]
    small = {"kv_mb": 0.5, "page_size": 4}
    plain_eng = make_engine(tiny_dir, overlap=False, **small)
    plain_eng.sampler = HostIds()  # type: ignore[assignment] - the reference: no device state
    plain = run(plain_eng, jobs, stagger=1)
    eng = make_engine(tiny_dir, overlap=True, **small)
    pending_at_launch: list[int] = []
    real = eng.sampler.launch

    def recording(logits: torch.Tensor, reqs: list[Request]) -> Sampled:
        pending_at_launch.extend(r.pending for r in reqs)
        return real(logits, reqs)

    eng.sampler.launch = recording  # type: ignore[method-assign]
    assert run(eng, jobs, stagger=1) == plain
    assert max(pending_at_launch) == 1  # sampled with its previous token still in flight
    assert eng.metrics.preemptions._value.get() > 0  # noqa: SLF001 - preemption happened
    assert eng.metrics.step_errors._value.get() == 0  # noqa: SLF001 - no fallback taken
