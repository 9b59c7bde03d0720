"""No per-chunk or per-parameter host reads in the clip and the step (issue 37, [Note: host
scalars]): on a GPU each ``.cpu()``, ``bool()``, ``.item()``, ``float()`` or ``tolist()`` of a
device value waits for the whole compute stream, each fp64 copy of a shard is 4x a bf16 shard
outside the device tier, and each ``torch.tensor(x, device=...)`` / ``torch.full`` is a host to
device copy. A torch-function mode counts them during ``clip_grad_norm_`` and ``step`` on one
and on two ranks, with few and with many chunks: the counts are the stated budget, the same
whatever the number of chunks.

Budget per step (fp16, clipping; the step's updates run after backward):
- one ``.cpu()``: the total norm, read once ([Note: host scalars]);
- one ``bool()``: the fp16 overflow flag, combined on the device and read once;
- one ``float()`` of the host norm the step already has (for the speculation policy), no
  ``.item()``/``tolist()`` (every slot had a gradient: the agreement on gradients needs no
  read: [Note: unused parameters are skipped]);
- one ``torch.full``: the Adam step count the fused kernel reads, made once per step and
  device (a fill where the states are, no copy), not once per chunk;
- no fp64 copy of gradients (an fp64 tensor of 1024 elements or more: the shards here have
  4096 or more; the per-chunk sums of squares, one fp64 scalar each, are summed in one small
  vector), no ``torch.tensor(..., device=...)``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.multiproc import run_ranks
from torch.overrides import TorchFunctionMode

READS = ("cpu", "item", "__bool__", "__float__", "tolist")
BUDGET = {"cpu": 1, "__bool__": 1, "__float__": 1, "full": 1}
"""What a step may do (see the module docstring); every other count is zero."""


class HostSyncs(TorchFunctionMode):
    """Counts host reads, fp64 temporaries and host-to-device factories."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self.counts[name] += 1
        if name == "tensor" and kwargs.get("device") is not None:
            self.counts["tensor(device=...)"] += 1
        if name == "full":
            self.counts["full"] += 1
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel() >= 1024:
            self.counts["fp64 temporary"] += 1
        return out


def _counted_step(rank, world, chunk_size):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp16",
        device="cpu",
        chunk_size=chunk_size,
        optimizer_placement="host",
        optimizer_overlap="after-backward",
    )
    engine = tierwise.engine_of(model)
    try:
        chunks = sum(len(g.chunks) for g in engine.index.groups)
        counts = Counter()
        for step in range(3):  # the first is the warm-up and re-layout
            loss = model(**tiny_batch(seed=10 * step + rank)).loss
            loss.backward()
            with HostSyncs() as syncs:
                tierwise.clip_grad_norm_(model, 0.5)
                opt.step()
            opt.zero_grad()
            if step > 0:
                counts.update(syncs.counts)
        return chunks, dict(counts)
    finally:
        engine.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_clip_and_step_read_the_host_once_per_step(world):
    want = {name: 2 * n for name, n in BUDGET.items()}  # two counted steps
    results = {}
    for chunk_size in (20000, 4096):
        per_rank = run_ranks(_counted_step, world, chunk_size)
        for chunks, counts in per_rank:
            assert counts == want, f"{chunks} chunks: {counts}, budget {want}"
        results[chunk_size] = per_rank[0][0]
    assert results[4096] > results[20000] > 1  # the budget holds with more chunks
