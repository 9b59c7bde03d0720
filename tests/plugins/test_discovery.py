"""Plugin discovery end to end: entry points, registries, env switches, the CLI."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from tierwise import hookspecs
from tierwise.hookspecs import hookimpl
from tierwise.plugins import PluginError, PluginHost, build_plugin_manager

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DISTS = {
    "profiler": "tierwise-profiler",
    "search": "tierwise-search",
    "nvme": "tierwise-nvme",
    "moe": "tierwise-moe",
}


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tierwise.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        check=False,
    )


def listed_plugins(env: dict | None = None) -> dict[str, dict]:
    result = run_cli("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return {info["name"]: info for info in json.loads(result.stdout)}


def test_listing_matches_what_this_env_installs():
    expected = os.environ.get("TIERWISE_EXPECT_PLUGINS")
    if expected is None:
        pytest.skip("TIERWISE_EXPECT_PLUGINS is set per tox env")
    listed = listed_plugins()
    assert set(listed) == set(expected.split(","))
    assert listed["core"]["tiers"] == ["device", "host"]
    assert listed["core"]["patterns"] == ["data"]
    for name, info in listed.items():
        if name != "core":
            assert info["version"] == metadata.version(PLUGIN_DISTS[name])
            assert info["distribution"] == PLUGIN_DISTS[name]


@pytest.mark.parametrize("name", sorted(PLUGIN_DISTS))
def test_installed_plugin_is_discovered_and_can_be_blocked(name):
    pytest.importorskip(PLUGIN_DISTS[name].replace("-", "_"))
    assert name in listed_plugins()
    blocked = listed_plugins(env={"TIERWISE_DISABLE_PLUGINS": f"{name},unrelated"})
    assert name not in blocked
    assert "core" in blocked


def test_version_flag():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"tierwise {metadata.version('tierwise')}"


def test_trace_switch_prints_hook_calls():
    result = run_cli("plugins", env={"TIERWISE_TRACE_PLUGINS": "1"})
    assert result.returncode == 0
    assert "tierwise_add_cli_commands" in result.stderr


@pytest.fixture(scope="module")
def example_plugin_path(tmp_path_factory) -> Path:
    """Install tests/plugins/example_plugin (the README example) into a private target dir."""
    target = tmp_path_factory.mktemp("example_plugin_site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO / "tests" / "plugins" / "example_plugin"),
        ],
        check=True,
    )
    return target


def test_third_party_plugin_adds_tier_and_pattern_without_core_changes(example_plugin_path):
    env = {
        "PYTHONPATH": os.pathsep.join([str(example_plugin_path), os.environ.get("PYTHONPATH", "")])
    }
    listed = listed_plugins(env=env)
    assert listed["example"]["tiers"] == ["scratch"]
    assert listed["example"]["patterns"] == ["replicated"]
    assert listed["example"]["distribution"] == "tierwise-example-plugin"
    code = (
        "from tierwise.plugins import get_plugin_host as g; h = g();"
        "t = h.tier_classes(); p = h.pattern_classes();"
        "print(t['scratch'].__module__, p['replicated'].__module__, sorted(t), sorted(p))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    ).stdout.split(maxsplit=2)
    assert out[:2] == ["example_plugin", "example_plugin"]
    assert "'device'" in out[2] and "'scratch'" in out[2] and "'data'" in out[2]


def test_readme_example_is_the_installed_example():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```python\n# example_plugin/__init__.py[^\n]*\n(.*?)```", readme, re.S)
    source = (REPO / "tests/plugins/example_plugin/src/example_plugin/__init__.py").read_text()
    assert block is not None
    # the source opens with a docstring line and the blank line the formatter puts after it
    assert source.split("\n", 1)[1].lstrip("\n") == block.group(1)


class _TierA:
    PLUGIN_NAME = "shared-name"


class _TierB:
    PLUGIN_NAME = "shared-name"


class _PluginA:
    @hookimpl
    def tierwise_register_tiers(self):
        return [_TierA]


class _PluginB:
    @hookimpl
    def tierwise_register_tiers(self):
        return [_TierB]


class _PluginNoName:
    @hookimpl
    def tierwise_register_parallel_patterns(self):
        return [type("Nameless", (), {})]


def _host_with(*plugins) -> PluginHost:
    host = build_plugin_manager(load_entry_points=False)
    for i, plugin in enumerate(plugins):
        host.pm.register(plugin, name=f"plugin_{type(plugin).__name__}_{i}")
    return host


def test_duplicate_plugin_name_is_rejected_naming_both_plugins():
    host = _host_with(_PluginA(), _PluginB())
    with pytest.raises(PluginError) as err:
        host.tier_classes()
    message = str(err.value)
    assert "shared-name" in message
    assert "plugin__PluginA_0" in message and "plugin__PluginB_1" in message


def test_duplicate_of_a_core_name_is_rejected():
    class Clash:
        PLUGIN_NAME = "host"

    class ClashPlugin:
        @hookimpl
        def tierwise_register_tiers(self):
            return [Clash]

    with pytest.raises(PluginError, match="'core'"):
        _host_with(ClashPlugin()).tier_classes()


def test_misspelled_hookimpl_is_rejected_naming_it(monkeypatch):
    import types

    from tierwise import plugins

    misspelled = types.ModuleType("misspelled_plugin")

    @hookimpl
    def tierwise_register_tierz():  # the real hook is tierwise_register_tiers
        return []

    misspelled.tierwise_register_tierz = tierwise_register_tierz

    class EntryPoint:
        name, dist = "misspelled", None

        def load(self):
            return misspelled

    monkeypatch.setattr(plugins.metadata, "entry_points", lambda group: [EntryPoint()])
    with pytest.raises(PluginError) as err:
        build_plugin_manager()
    assert "'misspelled'" in str(err.value) and "tierwise_register_tierz" in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_plugin_name_is_rejected():
    with pytest.raises(PluginError, match="without a PLUGIN_NAME"):
        _host_with(_PluginNoName()).pattern_classes()


def _hookspec_functions():
    return [
        (name, fn)
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("tierwise_")
    ]


def test_every_hook_is_documented_with_the_template():
    specs = _hookspec_functions()
    assert len(specs) >= 6
    for name, fn in specs:
        doc = inspect.getdoc(fn) or ""
        assert doc, f"{name} has no docstring"
        assert "Params:" in doc and "Returns:" in doc, f"{name}: docstring misses the template"
        opts = fn.tierwise_spec
        firstresult = opts.get("firstresult", False)
        assert ("Stops at first non-None result." in doc) == firstresult, name
        assert name in hookspecs.__all__
        for param in inspect.signature(fn).parameters:
            assert f"``{param}``" in doc or "Params: none" in doc, f"{name}: {param} undocumented"


def test_every_hook_has_a_typed_wrapper_called_with_keywords():
    wrappers = inspect.getsource(PluginHost)
    for name, _ in _hookspec_functions():
        assert name in wrappers or name.startswith("tierwise_register_"), name
    # class-registration hooks go through _collect_classes with the hook's name
    assert (
        "tierwise_register_tiers" in wrappers and "tierwise_register_parallel_patterns" in wrappers
    )


def test_plugin_manager_is_not_built_at_import():
    code = "import tierwise, tierwise.plugins as p; print(p._cached_host.cache_info().currsize)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_placeholders_say_not_implemented():
    for module, attr in (("tierwise_nvme", "NVMeTier"), ("tierwise_moe", "ExpertParallel")):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        cls = getattr(mod, attr, None)
        if cls is None or "Placeholder" not in (cls.__doc__ or "") + "".join(
            b.__name__ for b in cls.__mro__
        ):
            continue  # the real implementation has landed
        with pytest.raises(NotImplementedError, match="not implemented yet"):
            cls()
