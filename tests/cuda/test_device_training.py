"""Invariants 1, 2 and 5 on every compute device: on CUDA they go through pinned host memory,
the side-stream prefetch, the fused device Adam and the caching allocator, which the CPU runs
of tests/core never touch. Each test runs once per device (tests/helpers/devices.py); the cuda
case is skipped with a reason where there is no GPU.

On CUDA, bitwise equality across plans also needs the same kernels for the same shapes: a
parameter's address inside its chunk (its alignment) can change which cuBLAS kernel runs, so a
failure of the invariant test that only some chunk sizes show points there first.
"""

import pytest
import tierwise
import torch
from helpers.devices import DEVICES, ONLY_CUDA, deterministic
from helpers.models import tiny_model
from helpers.plans import PLANS
from helpers.train import max_rel_diff, run_reference, run_tierwise, train

STEPS = 6


def _cpu_state(model) -> dict[str, torch.Tensor]:
    return {key: value.detach().cpu() for key, value in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_plan_trains_bitwise_alike_on_device(device, precision):
    with deterministic(device):
        results = {
            name: run_tierwise("llama", STEPS, precision=precision, device=device, **plan)
            for name, plan in PLANS.items()
        }
    base_losses, base_model = results["all-device"]
    base_params = _cpu_state(base_model)
    for name, (losses, model) in results.items():
        assert tierwise.engine_of(model).device.type == device
        assert losses == base_losses, f"{name}: losses differ from all-device"
        params = _cpu_state(model)
        for key, value in base_params.items():
            assert torch.equal(params[key], value), f"{name}: {key} differs"
    prefetched = tierwise.engine_of(results["all-host-prefetch2"][1]).stats()
    assert prefetched["moved_bytes"].get("host->device", 0) > 0


@pytest.mark.parametrize("plan", ["all-device", "all-host-prefetch2"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp32_matches_fused_adamw_on_device(device, plan):
    with deterministic(device):
        ref_losses, ref_model = run_reference("gpt2", 10, device=device)
        losses, model = run_tierwise("gpt2", 10, precision="fp32", device=device, **PLANS[plan])
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b)
    reference = {
        name: p.detach().cpu() for name, p in ref_model.named_parameters(remove_duplicate=False)
    }
    assert max_rel_diff(_cpu_state(model), reference) <= 1e-6


@pytest.mark.parametrize("plan", ["all-device", "all-host-prefetch2"])
@pytest.mark.parametrize("device", DEVICES)
def test_resume_continues_bitwise_on_device(tmp_path, device, plan):
    def build():
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        return tierwise.setup(model, opt, precision="bf16", device=device, **PLANS[plan])

    with deterministic(device):
        model, opt = build()
        train(model, opt, 3)
        tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
        straight = train(model, opt, 3, first_seed=3)
        final = _cpu_state(model)

        resumed, resumed_opt = build()
        tierwise.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
        assert train(resumed, resumed_opt, 3, first_seed=3) == straight
    for key, value in _cpu_state(resumed).items():
        assert torch.equal(value, final[key]), key


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_follow_the_compute_device(device):
    model = tiny_model("llama")  # rotary inv_freq: a non-persistent buffer built on cpu
    assert any(True for _ in model.buffers())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, device=device, param_placement="host", cache_blocks=3)
    assert {b.device.type for b in model.buffers()} == {device}
    assert len(train(model, opt, 1)) == 1


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_probe_honours_the_per_process_memory_fraction(device):
    """bench/gpu caps the GPU at 40 GiB this way; the plan must see the cap, not the free memory."""
    from tierwise.config import Config
    from tierwise.probe import basic_probe

    total = torch.cuda.get_device_properties(0).total_memory
    held = torch.empty(2**28, dtype=torch.uint8, device=device)  # 256 MiB allocated by us
    torch.cuda.set_per_process_memory_fraction(0.25)
    try:
        probed = basic_probe(Config(device=device))["device_memory"]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert 0 < probed <= int(0.25 * total) - held.numel()
    assert probed >= int(0.25 * total) - torch.cuda.memory_allocated() - 2**20
