"""14 B/param with the search's packing (issue 36): a meta-built model, bf16, params and
optimizer states in host memory, 2 clipped steps: the host tier peaks at the hand count (14
bytes per chunk element: gradients in the parameter payload) and, with the chunks' padding, at
most 14.5 bytes per parameter: the search's chunk size wastes at most 3% ([Note: chunk padding]
in tierwise.planning.chunk_size); the plan counts the same bytes. tests/core/test_chunk_padding.py
checks core's own "auto" size."""

from __future__ import annotations

import sys
from pathlib import Path

import tierwise
import torch
from helpers.models import tiny_batch
from tierwise.planning.totals import plan_model_bytes

sys.path.insert(0, str(Path(__file__).parent.parent / "core"))
from test_grads_in_home import _meta_gpt2  # noqa: E402


def test_host_tier_peaks_at_14_bytes_per_parameter_after_clipped_steps():
    """A meta-built model, bf16, params and optimizer states in host memory, 2 clipped steps:
    the host tier's peak is the hand count (14 bytes per element of every chunk's shard, no
    gradient shard), at most 14.5 bytes per parameter with the chunks' padding, and the plan
    counts the same bytes."""
    model = _meta_gpt2()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="bf16",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=2,
    )
    engine = tierwise.engine_of(model)
    try:
        for step in range(2):
            model(**tiny_batch(seed=step, vocab=256)).loss.backward()
            tierwise.clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
        chunks = list(engine.chunks())
        assert all(c.optim.grads_in_home and c.optim.grad is c.home for c in chunks)
        hand = sum(14 * c.shard_size for c in chunks)
        peak = engine.stats()["peak_bytes_by_tier"]["host"]
        assert peak == hand
        assert peak <= 14.5 * n_params
        planned = plan_model_bytes(engine.profile, engine.plan, "bf16")["host"]
        assert planned <= 14.5 * n_params
        assert planned == hand  # the planner packs as setup does, byte for byte
    finally:
        engine.close()
