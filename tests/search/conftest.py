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


@pytest.fixture(autouse=True)
def small_nvme_blocks(monkeypatch):
    """The search's toy models have sub-MiB host budgets; where tierwise-nvme is installed
    (the combined env) its read buffers count in the plan's host memory ([Note: storage tiers'
    host buffers]) and one default 4 MiB block outweighs such a model: plan with 4 KiB blocks."""
    monkeypatch.setenv("TIERWISE_NVME_BLOCK_SIZE", "4KiB")
