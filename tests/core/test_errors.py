"""Bad input: a clear error, and nothing half-initialised."""

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model


def snapshot(model):
    return {n: (p.dtype, p.detach().clone()) for n, p in model.named_parameters()}


def assert_untouched(model, before):
    for name, p in model.named_parameters():
        dtype, value = before[name]
        assert p.dtype == dtype and torch.equal(p.detach(), value), name
        assert not getattr(p, "_tierwise_managed", False)
    assert not hasattr(model, "_tierwise_engine") or model._tierwise_engine is None
    model(**tiny_batch()).loss.backward()  # still a plain, working PyTorch model


def test_unsupported_optimizer():
    model = tiny_model("gpt2")
    before = snapshot(model)
    with pytest.raises(TypeError, match="SGD is not supported.*AdamW"):
        tierwise.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert_untouched(model, before)


def test_chunk_size_below_minimum():
    model = tiny_model("gpt2")
    before = snapshot(model)
    with pytest.raises(ValueError, match="chunk_size 64 is below the minimum"):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), chunk_size=64)
    assert_untouched(model, before)


def test_budget_too_small_for_one_cache_block():
    model = tiny_model("gpt2")
    before = snapshot(model)
    with pytest.raises(tierwise.PlanError, match="device memory binds.*short.*raise device_memory"):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), device_memory=1000)
    assert_untouched(model, before)


def test_bad_config_value_names_the_fix():
    model = tiny_model("gpt2")
    with pytest.raises(tierwise.ConfigError, match="precision.*bf16, fp16, fp32"):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), precision="fp8")
    with pytest.raises(tierwise.ConfigError, match="unknown Config field"):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), chunksize=5)
    with pytest.raises(tierwise.ConfigError, match="reduce_order='ring'.*fast, rank"):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), reduce_order="ring")


def test_parameter_already_managed():
    model = tiny_model("gpt2")
    model, _ = tierwise.setup(model, torch.optim.AdamW(model.parameters()), device="cpu")
    with pytest.raises(ValueError, match="already managed"):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()))
    other = torch.nn.Sequential(model.transformer.h[0].mlp.c_fc)
    with pytest.raises(ValueError, match="already managed"):
        tierwise.setup(other, torch.optim.AdamW(other.parameters()))


def test_setup_works_after_a_failed_attempt():
    model = tiny_model("gpt2")
    with pytest.raises(tierwise.PlanError):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), device_memory=1000)
    model, opt = tierwise.setup(model, torch.optim.AdamW(model.parameters()), device="cpu")
    model(**tiny_batch()).loss.backward()
    opt.step()


@pytest.mark.parametrize(
    ("value", "expected"),
    [("3.5GiB", int(3.5 * 2**30)), ("4096", 4096), ("2 KiB", 2048), (3.0, 3), ("8b", 8)],
)
def test_byte_counts_read_as_people_write_them(value, expected):
    from tierwise.units import parse_bytes

    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["3.5", "3.5B", 3.5, ".5"])
def test_a_byte_count_without_a_unit_is_a_whole_number(value):
    """``--device-memory 3.5`` became 3 bytes, silently (issue 30)."""
    from tierwise.units import parse_bytes

    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_bytes(value, what="device_memory")


@pytest.mark.parametrize("name", ["device_memory", "host_memory"])
@pytest.mark.parametrize("value", [0, "0", "0GiB"])
def test_a_zero_budget_is_refused_with_the_fix(name, value):
    with pytest.raises(tierwise.ConfigError, match=f"{name}=0: a budget of 0 bytes leaves no room"):
        tierwise.Config(**{name: value})
