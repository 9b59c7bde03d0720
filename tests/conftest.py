"""Shared pytest setup: deterministic CPU math, a fresh plugin host per test, and which tox env
runs which test.

[Note: one env per test]
Each test runs in exactly one tox env. A test that needs several plugins together is marked
``combined`` (``pytestmark = pytest.mark.combined`` or on the test) and runs only in the ``all``
env (``TIERWISE_TEST_SCOPE=combined``); every other test runs in the env of its package
(``TIERWISE_TEST_SCOPE=single``). ``tests/integration`` drives ``tierwise train`` as the README's
install leaves it, with every plugin, so it counts as combined. ``tests/trl`` and ``tests/fabric``
need TRL and Lightning, which only the ``frameworks`` env installs; ``all`` leaves them out. ``tests/plugins`` checks the plugin
set of the env it runs in, so it runs in every env. Without the variable (a developer's ``pytest tests``) everything runs.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
# cuBLAS picks reproducible reductions only with a fixed workspace, read when CUDA first starts;
# the device-parametrized tests (tests/helpers/devices.py) compare CUDA runs bitwise
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

_PLUGIN_TESTS = Path(__file__).parent / "plugins"
_COMBINED_TESTS = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(config, items):
    scope = os.environ.get("TIERWISE_TEST_SCOPE")
    if scope not in ("single", "combined"):
        return
    keep, drop = [], []
    for item in items:
        parents = Path(item.fspath).parents
        combined = item.get_closest_marker("combined") is not None or _COMBINED_TESTS in parents
        in_plugin_tests = _PLUGIN_TESTS in parents
        wanted = in_plugin_tests or (combined if scope == "combined" else not combined)
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def _session_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tierwise_cache")


@pytest.fixture(autouse=True)
def _private_cache_dir(_session_cache_dir, monkeypatch):
    """Probe caches (hardware, NVMe bandwidth per path) go to a temp dir, never the user's."""
    monkeypatch.setenv("TIERWISE_CACHE_DIR", str(_session_cache_dir))


@pytest.fixture(autouse=True)
def _fresh_plugin_host():
    from tierwise.plugins import _cached_host

    _cached_host.cache_clear()
    yield
    _cached_host.cache_clear()
