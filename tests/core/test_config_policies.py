"""Config is made of policy dataclasses; every flat name keeps working (keyword, TOML key,
attribute, ``replace``)."""

from __future__ import annotations

import dataclasses

import pytest
import tierwise
from tierwise.config import (
    POLICIES,
    ActivationsPolicy,
    Config,
    MemoryPolicy,
    OverlapPolicy,
    ParallelPolicy,
    PlacementPolicy,
    PluginSettings,
    PrecisionPolicy,
)
from tierwise.train.options import field_docs

CONTRACT = (  # DESIGN.md "Public API": these names are part of the contract
    "precision device chunk_size cache_blocks param_placement optimizer_placement device_memory "
    "host_memory nvme_path prefetch activation_checkpointing activation_offload activation_policy"
).split()


def test_every_field_is_declared_and_documented_by_exactly_one_policy():
    owners: dict[str, list[str]] = {}
    for policy in POLICIES:
        assert dataclasses.is_dataclass(policy)
        docs = field_docs(policy)
        for f in dataclasses.fields(policy):
            owners.setdefault(f.name, []).append(policy.__name__)
            assert docs.get(f.name), f"{policy.__name__}.{f.name} has no docstring"
    assert {name: len(o) for name, o in owners.items() if len(o) != 1} == {}
    assert set(owners) == {f.name for f in dataclasses.fields(Config)}
    assert set(CONTRACT) <= set(owners)
    assert set(field_docs(Config)) == set(owners)  # `tierwise train --help` documents each flag


def test_flat_names_and_policies_agree():
    config = Config(
        device="cpu",
        chunk_size=4096,
        host_memory="1GiB",
        activation_offload="host",
        reduce_order="rank",
        optimizer_overlap="after-backward",
        precision="fp32",
    )
    assert config.chunk_size == 4096 and config.host_memory == 2**30
    assert config.placement == PlacementPolicy(device="cpu", chunk_size=4096)
    assert config.memory == MemoryPolicy(host_memory=2**30)
    assert config.activations == ActivationsPolicy(activation_offload="host")
    assert config.parallelism == ParallelPolicy(reduce_order="rank")
    assert config.overlap == OverlapPolicy(optimizer_overlap="after-backward")
    assert config.mixed_precision == PrecisionPolicy(precision="fp32")
    assert config.policy(PluginSettings) == PluginSettings()
    for policy in POLICIES:
        assert isinstance(config, policy)
    changed = dataclasses.replace(config, chunk_size=8192)
    assert changed.chunk_size == 8192 and changed.placement.chunk_size == 8192
    assert config.replace(prefetch=0).prefetch == 0
    assert Config.from_any(config.to_dict()) == config


def test_toml_keys_of_every_policy(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        '[tierwise]\ndevice = "cpu"\nprecision = "fp16"\ncache_blocks = 3\n'
        'device_memory = "64MiB"\nactivation_checkpointing = true\nshard = false\n'
        "accumulation_steps = 4\n"
    )
    config = Config.from_any(path, prefetch=1)
    assert (config.precision, config.cache_blocks, config.device_memory) == ("fp16", 3, 64 << 20)
    assert config.activation_checkpointing and not config.shard
    assert (config.accumulation_steps, config.prefetch) == (4, 1)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("precision", "fp8", r"^Config\.precision='fp8': choose one of bf16, fp16, fp32$"),
        ("chunk_size", 0, r"^Config\.chunk_size=0: give a positive number of elements"),
        ("cache_blocks", True, r"^Config\.cache_blocks=True: give a number of blocks"),
        ("host_memory", "0GiB", r"^Config\.host_memory=0: a budget of 0 bytes"),
        ("frag_factor", 0.5, r"^Config\.frag_factor=0\.5: must be ≥ 1$"),
        ("saves_weights", "yes", r"^Config\.saves_weights='yes': must be True or False$"),
        ("activation_offload", "disk", r"^Config\.activation_offload='disk': choose one of"),
        ("parallel", {"expert": 0}, r"^Config\.parallel=\{'expert': 0\}: give a dict"),
        ("accumulation_steps", 0, r"^Config\.accumulation_steps=0: give a positive number"),
    ],
)
def test_a_policy_refuses_a_bad_value_in_config_terms(field, value, message):
    with pytest.raises(tierwise.ConfigError, match=message):
        Config(device="cpu", **{field: value})
    policy = next(p for p in POLICIES if field in {f.name for f in dataclasses.fields(p)})
    with pytest.raises(tierwise.ConfigError, match=message):
        policy(**{field: value})
