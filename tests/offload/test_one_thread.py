"""``owner_thread_only``: the first call's thread owns the object; a call from another raises."""

from __future__ import annotations

import inspect
import threading

import pytest

from kvstage.errors import ThreadingError
from kvstage.offload.one_thread import OwnerThread, owner_thread_only


class Owned:
    def __init__(self):
        self._owner = OwnerThread()

    @owner_thread_only
    def step(self, value: int, *, twice: bool = False) -> int:
        """Double or keep ``value``."""
        return value * 2 if twice else value


def run_in_thread(call, name):
    outcome = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as error:  # handed back to the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    return outcome


def test_the_first_callers_thread_owns_it_and_another_thread_raises_naming_both():
    owned = Owned()
    assert owned.step(3, twice=True) == 6  # this (the main) thread owns it now
    # The owner is private: nothing public says which thread owns the object.
    assert owned._owner.name == threading.current_thread().name == "MainThread"
    error = run_in_thread(lambda: owned.step(1), "intruder")["error"]
    assert isinstance(error, ThreadingError)
    assert str(error).startswith("step: called from thread 'intruder' (")
    assert "but thread 'MainThread' (" in str(error)
    assert owned.step(2) == 2  # the owner still may


def test_a_first_call_from_another_thread_makes_that_thread_the_owner():
    owned = Owned()
    assert run_in_thread(lambda: owned.step(3), "engine") == {"value": 3}
    # The owner is private: nothing public says which thread owns the object.
    assert owned._owner.name == "engine"
    # The engine thread has exited; its ident may be reused by a later thread, so only the
    # main thread (alive throughout) is certain to be another.
    with pytest.raises(ThreadingError, match=r"^step: called from thread 'MainThread' \(\d+\), but thread 'engine'"):
        owned.step(1)


def test_the_owner_keeps_calling():
    owned = Owned()
    assert [owned.step(value) for value in range(3)] == [0, 1, 2]
    # The owner is private: nothing public says which thread owns the object.
    assert owned._owner.ident == threading.get_ident()


def test_the_method_keeps_its_name_docstring_and_signature():
    assert Owned.step.__name__ == "step" and Owned.step.__doc__ == "Double or keep ``value``."
    assert list(inspect.signature(Owned.step).parameters) == ["self", "value", "twice"]
    assert inspect.signature(Owned.step) == inspect.signature(Owned.step.__wrapped__)
