"""NVTX ranges nest, pop on exceptions, and degrade to no-ops without the nvtx package."""

from __future__ import annotations

import threading

import pytest

from kvstage import nvtx_ranges
from kvstage.nvtx_ranges import annotated, nvtx_range, open_ranges


def test_ranges_nest_in_order():
    assert open_ranges() == ()
    with nvtx_range("outer"):
        with nvtx_range("inner"):
            assert open_ranges() == ("outer", "inner")
        assert open_ranges() == ("outer",)
    assert open_ranges() == ()


def test_range_is_popped_when_the_body_raises():
    with pytest.raises(KeyError):
        with nvtx_range("outer"):
            with nvtx_range("failing"):
                raise KeyError("boom")
    assert open_ranges() == ()


def test_decorator_wraps_the_call_and_keeps_its_name():
    @annotated("work")
    def work(x):
        """Doc."""
        return open_ranges(), x * 2

    assert work(3) == (("work",), 6)
    assert work.__name__ == "work" and work.__doc__ == "Doc."
    assert open_ranges() == ()


def test_ranges_are_per_thread():
    seen = []
    with nvtx_range("main"):
        thread = threading.Thread(target=lambda: seen.append(open_ranges()))
        thread.start()
        thread.join()
    assert seen == [()]


def test_no_nvtx_package_makes_ranges_no_ops(monkeypatch):
    monkeypatch.setattr(nvtx_ranges, "_domain", None)
    with nvtx_range("still-tracked"):
        assert open_ranges() == ("still-tracked",)
    assert open_ranges() == ()


def test_nvtx_package_is_used_when_installed():
    pytest.importorskip("nvtx")
    assert nvtx_ranges.NVTX_AVAILABLE
    with nvtx_range("cached"):
        pass
    # The attributes cache is private: nothing public says a range's attributes were reused.
    assert "cached" in nvtx_ranges._attributes
