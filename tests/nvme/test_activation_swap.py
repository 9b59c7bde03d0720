"""Activations swapped to NVMe through tierwise-nvme's asynchronous tier."""

from __future__ import annotations

import errno

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from helpers.train import run_tierwise, train  # noqa: E402
from nvme_helpers import FailingBackend, swap_files  # noqa: E402
from tierwise_nvme import NVMeIOError, NVMeSpaceError  # noqa: E402

MIXED = {
    "gpt2": {"transformer.h.0": "nvme", "transformer.h.1": "recompute"},
    "llama": {"model.layers.0": "host", "model.layers.1": "nvme"},
}


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_nvme_and_mixed_policies_train_bitwise_like_keep(nvme_dir, kind, precision):
    kw = dict(precision=precision, device="cpu")
    base_losses, base = run_tierwise(kind, 4, **kw)
    for cfg in (dict(activation_offload="nvme"), dict(activation_policy=MIXED[kind])):
        losses, model = run_tierwise(kind, 4, nvme_path=str(nvme_dir), **kw, **cfg)
        assert losses == base_losses, cfg
        assert _same(model, base), cfg
        stats = tierwise.engine_of(model).stats()
        assert stats["activations"]["swapped_out_bytes"]["nvme"] > 0
        assert stats["activations"]["swapped_in_bytes"] == stats["activations"]["swapped_out_bytes"]
        assert stats["moved_bytes"]["act:device->nvme"] == stats["moved_bytes"]["act:nvme->device"]
        tierwise.engine_of(model).close()


def test_no_leak_over_20_steps_and_swap_files_gone_after_close(nvme_dir):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, device="cpu", precision="fp32",
                                activation_offload="nvme", nvme_path=str(nvme_dir))
    engine = tierwise.engine_of(model)
    for step in range(20):
        train(model, opt, 1, first_seed=step)
        assert engine.activations.swapped_now() == {"device": 0, "host": 0, "nvme": 0}
        assert engine.tiers["nvme"].used_bytes == 0
    assert any("activation" in name for name in swap_files(nvme_dir))
    engine.close()
    assert swap_files(nvme_dir) == []


@pytest.fixture
def failing_io(monkeypatch):
    """Every nvme tier created from now on goes through a FailingBackend (armed by the test)."""
    import tierwise_nvme.tier as tier_module

    made = []
    real = tier_module.open_backend

    def open_failing(options, directory):
        made.append(FailingBackend(real(options, directory), fail_at=None))
        return made[-1]

    monkeypatch.setattr(tier_module, "open_backend", open_failing)
    return made


def _activation_write(request) -> bool:
    return request.op == "write" and "activation" in request.path


@pytest.mark.parametrize("code, error", [(errno.EIO, NVMeIOError), (errno.ENOSPC, NVMeSpaceError)])
def test_failed_swap_out_is_a_clear_error_and_the_engine_goes_on(nvme_dir, failing_io, code, error):
    kw = dict(precision="fp32", device="cpu")
    base_losses, base = run_tierwise("llama", 3, **kw)
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(model, opt, activation_offload="nvme", nvme_path=str(nvme_dir), **kw)
    engine = tierwise.engine_of(model)
    losses = train(model, opt, 1)
    for io in failing_io:
        io.code = code
        io.fail_if = _activation_write
    with pytest.raises(error, match=r"nvme tier: write of \d+ bytes at offset \d+ in .*activation") as info:
        model(**tiny_batch(seed=1)).loss.backward()
    assert any("block model.layers" in note for note in getattr(info.value, "__notes__", []))
    assert engine.activations.swapped_now() == {"device": 0, "host": 0, "nvme": 0}
    assert engine.tiers["nvme"].used_bytes == 0
    opt.zero_grad()  # nothing of the failed step was applied: the same step again
    losses += train(model, opt, 2, first_seed=1)
    assert losses == base_losses
    assert _same(model, base)
    engine.close()
