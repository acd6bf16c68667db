"""``FinishBacklog``: finished requests' pages waiting for host pages, against the limit."""

from __future__ import annotations

from kvstage.offload.finish_backlog import FinishBacklog
from kvstage.offload.request_state import RequestState
from kvstage.offload.testing import SimpleRequest


def state(rid):
    return RequestState(SimpleRequest(rid, list(range(8))), 0)


def test_pages_wait_up_to_the_limit_and_no_further():
    backlog, first, second = FinishBacklog(5), state("a"), state("b")
    assert backlog.admit(first, 3) and backlog.pages == 3 and first.backlog_pages == 3
    assert not backlog.admit(second, 3)  # 6 > 5: refused, nothing changed
    assert backlog.pages == 3 and second.backlog_pages == 0 and backlog.states == [first]
    assert backlog.admit(second, 2) and backlog.pages == 5 and backlog.states == [first, second]


def test_no_limit_admits_any_number():
    backlog = FinishBacklog(None)
    assert backlog.admit(state("a"), 10_000) and backlog.pages == 10_000


def test_launched_pages_leave_the_count_and_remove_returns_the_rest():
    backlog, first, second = FinishBacklog(None), state("a"), state("b")
    backlog.admit(first, 4)
    backlog.admit(second, 2)
    backlog.set_pages(first, 1)  # three of its pages launched
    assert backlog.pages == 3 and first.backlog_pages == 1
    assert backlog.remove(second) == 2
    assert backlog.pages == 1 and second.backlog_pages == 0 and backlog.states == [first] and backlog
    assert backlog.remove(first) == 1 and backlog.pages == 0 and not backlog
