"""Fixtures for the search tests; the helpers live in ``search_helpers``."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_search")

from search_helpers import gpu_hardware, make_profile  # noqa: E402


@pytest.fixture
def profile_factory():
    return make_profile


@pytest.fixture
def gpu():
    return gpu_hardware
