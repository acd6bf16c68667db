"""Fixtures of the offload tests: a rig whose store already holds a prompt's pages."""

from __future__ import annotations

import pytest

from offload_rig import Rig, make_stored_rig


@pytest.fixture
def stored_rig() -> Rig:
    """:func:`offload_rig.make_stored_rig`: a page-2 rig that stores prompts, its store holding
    request 'a''s 4 pages of ``STORED_PROMPT``."""
    return make_stored_rig()
