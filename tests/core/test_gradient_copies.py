"""No gradient is copied between autograd and the optimizer in one process ([Note: gradients
without copies]): the bytes that copy ops write during backward (and the step) are counted with
a dispatch mode and compared with plain PyTorch running the same model."""

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

_COPIES = {
    torch.ops.aten.copy_.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
}


class CopyCounter(TorchDispatchMode):
    """Bytes written by copy ops (copy_, _to_copy, clone) while active; autograd runs the
    backward's CPU work on the calling thread with this mode on its stack."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _COPIES:
            written = args[0] if func is torch.ops.aten.copy_.default else out
            self.bytes += written.numel() * written.element_size()
        return out


def copied_bytes(model, opt, *, with_step: bool, steps: int = 3) -> int:
    """Copy bytes of the last of ``steps`` steps (the first ones warm up and re-lay out)."""
    for s in range(steps):
        loss = model(**tiny_batch(seed=s)).loss
        counter = CopyCounter()
        with counter:
            loss.backward()
            if with_step:
                opt.step()
        if not with_step:
            opt.step()
        opt.zero_grad()
    return counter.bytes


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fp32_step_copies_no_more_than_plain_pytorch(kind):
    plain = tiny_model(kind)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    reference = copied_bytes(plain, plain_opt, with_step=True)

    model = tiny_model(kind)
    model, opt = tierwise.setup(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        precision="fp32",
        device="cpu",
        param_placement="device",
        optimizer_placement="device",
    )
    assert copied_bytes(model, opt, with_step=True) <= reference

    # the counter sees gradient copies: with the gradient shards on host, every gradient is
    # copied into one (at least the parameters' bytes more than plain PyTorch)
    host = tiny_model(kind)
    host, host_opt = tierwise.setup(
        host,
        torch.optim.AdamW(host.parameters(), lr=1e-3),
        precision="fp32",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
    )
    assert copied_bytes(host, host_opt, with_step=True) >= reference + param_bytes(host)


def test_bf16_backward_copies_no_more_than_plain_bf16_pytorch():
    plain = tiny_model("llama").to(torch.bfloat16)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    reference = copied_bytes(plain, plain_opt, with_step=False)

    model = tiny_model("llama")
    model, opt = tierwise.setup(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        precision="bf16",
        device="cpu",
        param_placement="device",
        optimizer_placement="device",
    )
    assert copied_bytes(model, opt, with_step=False) <= reference
