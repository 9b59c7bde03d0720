"""A model built on the meta device against the same model built on the CPU: both set up with
the same options and weights, then trained side by side (tests/core/test_meta_setup.py, and
tests/profiler/test_meta_profiled.py with the profiler's tracer in the way)."""

from __future__ import annotations

import tierwise
import torch

from helpers.models import _config, tiny_batch, tiny_model

OFFLOADED = dict(  # every chunk offloaded to host: fetched into 6 rCache blocks
    precision="fp32",
    device="cpu",
    chunk_size=4096,
    cache_blocks=6,
    param_placement="host",
    optimizer_placement="host",
)


def _train(model, optimizer, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(**tiny_batch(seed=step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def assert_meta_trains_like_cpu(family: str, steps: int = 3, **options) -> None:
    """Set up ``family`` built on the CPU and built on the meta device (then given the CPU
    model's weights; buffers come from setup alone) and train both ``steps`` steps: buffers,
    losses and final weights are bitwise equal."""
    import transformers

    options = {**OFFLOADED, **options}
    reference = tiny_model(family, seed=0)
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    cpu_buffers = {k: v.clone() for k, v in reference.named_buffers()}
    cpu_model, cpu_opt = tierwise.setup(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), **options
    )
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(_config(family)).train()
    assert all(b.is_meta for b in meta.buffers())
    meta_model, meta_opt = tierwise.setup(
        meta, torch.optim.AdamW(meta.parameters(), lr=1e-2), **options
    )
    meta_model.load_state_dict(weights)
    try:
        buffers = dict(meta_model.named_buffers())
        assert buffers.keys() == cpu_buffers.keys()
        for name, value in cpu_buffers.items():
            assert torch.equal(buffers[name], value), name
        assert _train(meta_model, meta_opt, steps) == _train(cpu_model, cpu_opt, steps)
        for (name, a), b in zip(
            meta_model.state_dict().items(), cpu_model.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), name
    finally:
        tierwise.engine_of(meta_model).close()
        tierwise.engine_of(cpu_model).close()
