"""Host and NVMe bytes per parameter for the NVMe placements (issue 36): gradients written into
the parameter payload ([Note: gradients in the parameter payload]) instead of a gradient shard.

A GPT-2 (17M parameters by default, the planner's chunk size unless ``--chunk-size``) is set up in bf16 on the CPU for each placement (parameter
home / optimizer states: host/nvme, nvme/nvme, and device/nvme, which keeps a gradient shard on
NVMe, for comparison) and trained for ``--steps`` clipped steps with gradient accumulation (the
after-backward path, where gradients wait in the payload or in the host buffers). One JSON line
per placement, from the engine's own tier accounting:
- ``host_peak_per_param``: ``peak_bytes_by_tier["host"]`` / parameters (model data in host
  memory plus the NVMe tier's staging pools and the gradient buffers, which do not grow with
  the model), ``host_pools_bytes`` those fixed pools and ``host_peak_without_pools_per_param``
  the rest (the host model data);
- ``nvme_per_param``: ``bytes_by_tier["nvme"]`` / parameters (parameter payloads, both copies
  of the optimizer states, any gradient shard);
- ``model_data_per_param``: what ``model_data_by_tier`` counts per parameter on every tier
  with the states' second NVMe copy taken off: the issue's 14 B/param figure (with the
  chunks' padding; ``model_data_per_chunk_element`` without it);
- ``hand``: the same three by hand (2 for the bf16 payload, 12 per copy of the fp32 master and
  Adam m, v, 2 for a gradient shard).

    python bench/nvme_bytes_per_param.py --nvme-dir /path/on/disk
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from _common import batch, emit, gpt2_model

PLACEMENTS = (("host", "nvme"), ("nvme", "nvme"), ("device", "nvme"))


def _pool_bytes(engine) -> int:
    """The NVMe tier's staging pools, the optimizer pipeline's and the gradient buffers."""
    tier = engine.tiers["nvme"]
    pools = [tier.staging] + [p.pool for p in engine.optimizer.pipelines.values()]
    extra = engine.grad_offload.nbytes if engine.grad_offload is not None else 0
    return sum(pool.count * pool.buffer_bytes for pool in pools) + extra


def measure(args, home: str, optim: str, nvme_dir: str) -> dict:
    import tierwise
    from tierwise.chunks.payload import model_data_by_tier

    model = gpt2_model(n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, vocab=args.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="bf16",
        device="cpu",
        param_placement=home,
        optimizer_placement=optim,
        nvme_path=nvme_dir,
        optimizer_overlap="after-backward",
        chunk_size=args.chunk_size or "auto",
    )
    engine = tierwise.engine_of(model)
    try:
        for step in range(args.steps):
            for micro in range(2):
                loss = model(**batch(args.batch, args.seq, args.vocab, 10 * step + micro)).loss
                (loss / 2).backward()
            tierwise.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
        stats = engine.stats()
        chunks = list(engine.chunks())
        in_home = sorted({c.optim.grads_in_home for c in chunks})
        counted = model_data_by_tier(
            [(c.shard_size, True, c.group.sharded) for c in chunks],
            precision="bf16",
            param_tier=home,
            optim_tier=optim,
        )  # one copy of the states: the figure
        elements = sum(c.shard_size for c in chunks)
        pools = _pool_bytes(engine)
        grads_in_home = in_home == [True]
        return {
            "bench": "nvme_bytes_per_param",
            "placement": f"{home}/{optim}",
            "params": n_params,
            "chunk_elements": elements,
            "grads_in_payload": grads_in_home,
            "host_peak_per_param": stats["peak_bytes_by_tier"]["host"] / n_params,
            "host_pools_bytes": pools,
            "host_peak_without_pools_per_param": (stats["peak_bytes_by_tier"]["host"] - pools)
            / n_params,
            "nvme_per_param": stats["bytes_by_tier"]["nvme"] / n_params,
            "device_per_param": stats["bytes_by_tier"].get("device", 0) / n_params,
            "model_data_per_param": sum(counted.values()) / n_params,
            "model_data_per_chunk_element": sum(counted.values()) / elements,
            "hand": {
                "host_model_data": 2.0 if home == "host" else 0.0,
                "nvme": 24.0 + (2.0 if home == "nvme" else 0.0) + (0.0 if grads_in_home else 2.0),
                "model_data": 14.0 if grads_in_home else 16.0,
                "per": "chunk element (padding makes a parameter slightly more)",
            },
        }
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-dir", default=None, help="a directory on disk (default: a tmp)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--chunk-size", type=int, default=0, help="elements; 0: the planner's")
    args = parser.parse_args()
    for home, optim in PLACEMENTS:
        with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme_dir:
            emit(**measure(args, home, optim, nvme_dir))


if __name__ == "__main__":
    main()
