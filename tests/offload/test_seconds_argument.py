"""A duration argument (``prior_wait_s``, ``miss_ttl_s``, ``hit_ttl_s``): a number of seconds >= 0,
never a bool, checked by one rule (:func:`kvstage.errors.require_seconds`) that names the
argument."""

from __future__ import annotations

import math

import pytest

from kvstage.errors import InvalidArgumentError, require_seconds
from kvstage.offload import StoreIndex, StoreWorkers
from kvstage.storage import LayoutFingerprint, MemoryStore


@pytest.mark.parametrize("good", [0, 0.0, 2, 1.5, math.inf])
def test_a_number_of_seconds_at_least_zero_passes(good):
    assert require_seconds(good, "wait_s") is None


@pytest.mark.parametrize("bad", [-1, -0.5, True, False, "10", None, math.nan])
def test_anything_else_raises_naming_the_argument_and_the_rule(bad):
    with pytest.raises(InvalidArgumentError) as raised:
        require_seconds(bad, "wait_s")
    assert str(raised.value) == f"wait_s: must be a number of seconds >= 0, got {bad!r}"


@pytest.mark.parametrize("argument", ["miss_ttl_s", "hit_ttl_s"])
@pytest.mark.parametrize("bad", [-1, True])
def test_the_store_index_durations_use_the_rule(argument, bad):
    workers = StoreWorkers()
    try:
        with pytest.raises(InvalidArgumentError, match=rf"^{argument}: must be a number of seconds >= 0, got {bad!r}$"):
            StoreIndex(
                MemoryStore(LayoutFingerprint.opaque("m", page_bytes=64, page_format="test")),
                workers,
                **{argument: bad},
            )
    finally:
        workers.close()
