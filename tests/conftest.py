"""Shared pytest setup: deterministic CPU math and a fresh plugin host per test."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(autouse=True)
def _fresh_plugin_host():
    from tierwise.plugins import _cached_host

    _cached_host.cache_clear()
    yield
    _cached_host.cache_clear()
