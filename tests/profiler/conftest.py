"""Profiler tests never touch the user's cache: the hardware probe caches under a temp dir."""

import pytest


@pytest.fixture(scope="session")
def _session_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tierwise_cache")


@pytest.fixture(autouse=True)
def _private_cache_dir(_session_cache_dir, monkeypatch):
    monkeypatch.setenv("TIERWISE_CACHE_DIR", str(_session_cache_dir))
