import pytest

from pdserve.engine.request import FINISHED, TRANSITIONS, Event, IllegalTransition, Request, Status
from pdserve.kvcache.allocator import PageAllocator
from pdserve.kvcache.lease import Leases
from pdserve.protocol.sampling import SamplingParams


def make() -> Request:
    return Request("r", [1, 2, 3], SamplingParams(), sink=lambda o: None)


# The request lifecycle's legal edges, written out: everything else is refused.
LEGAL = {
    (Status.WAITING, Event.SCHEDULE): Status.RUNNING,
    (Status.WAITING, Event.STOP): Status.FINISHED_STOPPED,  # preempted, its token in flight
    (Status.WAITING, Event.LENGTH): Status.FINISHED_LENGTH,
    (Status.WAITING, Event.ABORT): Status.FINISHED_ABORTED,
    (Status.WAITING, Event.FAIL): Status.FINISHED_FAILED,
    (Status.RUNNING, Event.PREEMPT): Status.WAITING,
    (Status.RUNNING, Event.STOP): Status.FINISHED_STOPPED,
    (Status.RUNNING, Event.LENGTH): Status.FINISHED_LENGTH,
    (Status.RUNNING, Event.ABORT): Status.FINISHED_ABORTED,
    (Status.RUNNING, Event.FAIL): Status.FINISHED_FAILED,
}


def test_the_table_is_exactly_the_legal_edges_and_the_rest_are_refused():
    assert TRANSITIONS == LEGAL
    for state in Status:
        for event in Event:
            req = make()
            req.status = state
            if (state, event) in LEGAL:
                assert req.transition(event) is LEGAL[(state, event)]
            else:
                with pytest.raises(IllegalTransition):
                    req.transition(event)
                assert req.status is state


def test_finished_states_are_sticky_and_live_states_can_end():
    for s in FINISHED:
        assert not any(k[0] is s for k in TRANSITIONS)
    for s in (Status.WAITING, Status.RUNNING):
        assert (s, Event.ABORT) in TRANSITIONS and (s, Event.FAIL) in TRANSITIONS
    assert [s for s in Status if s.finished] == [s for s in Status if s in FINISHED]


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_params_name_the_parameter(kw, param):
    from pdserve.protocol.sampling import InvalidParams

    with pytest.raises(InvalidParams) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_pages_come_from_the_lease_and_are_a_copy():
    req = make()
    assert req.pages == [] and req.num_pages == 0
    req.pages = [5, 2]  # a table built by hand (no pool): the runner's tests do this
    assert req.pages == [5, 2] and req.num_pages == 2
    req.pages = []
    req.lease = Leases(PageAllocator(4)).open("r", 3)
    table = req.pages
    table.append(9)  # a copy: the lease is unchanged
    assert req.pages == [0, 1, 2] and req.num_pages == 3 and list(req.lease.pages) == [0, 1, 2]
