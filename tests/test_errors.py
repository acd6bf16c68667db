"""kvstage's exceptions keep the built-in meaning and name the argument."""

from __future__ import annotations

import pytest

from kvstage import errors
from kvstage.kernels.backend import resolve_backend


@pytest.mark.parametrize(
    "error, builtin",
    [
        (errors.InvalidArgumentError, ValueError),
        (errors.ArgumentTypeError, TypeError),
        (errors.DeviceMismatchError, ValueError),
        (errors.BackendUnavailableError, RuntimeError),
        (errors.StorageError, RuntimeError),
    ],
)
def test_each_error_is_a_kvstage_error_and_its_builtin(error, builtin):
    assert issubclass(error, errors.KvstageError)
    assert issubclass(error, builtin)


def test_require_names_argument_and_rule():
    errors.require(True, "x", "never raised")
    with pytest.raises(errors.ArgumentTypeError, match=r"^tokens: must be integers$"):
        errors.require(False, "tokens", "must be integers", errors.ArgumentTypeError)


def test_backend_choice_is_validated():
    with pytest.raises(errors.InvalidArgumentError, match="backend: must be one of"):
        resolve_backend("cuda", on_cuda=False)
    assert resolve_backend("torch", on_cuda=True) == "torch"


def test_auto_backend_on_cpu_follows_triton_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", on_cuda=False) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("auto", on_cuda=False) == "torch"
    with pytest.raises(errors.BackendUnavailableError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", on_cuda=False)


def test_require_takes_a_rule_made_only_when_it_fails():
    made = []

    def rule() -> str:
        made.append(1)
        return "must be even, got 3"

    errors.require(True, "n", rule)
    assert made == []
    with pytest.raises(errors.InvalidArgumentError, match="^n: must be even, got 3$"):
        errors.require(False, "n", rule)
    assert made == [1]
