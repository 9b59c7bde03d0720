"""Host and NVMe bytes per parameter for the NVMe placements (issue 36): gradients written into
the parameter payload ([Note: gradients in the parameter payload]) instead of a gradient shard.

A GPT-2 (17M parameters by default, the planner's chunk size unless ``--chunk-size``) is set up
in bf16 on the CPU for each placement (parameter home / optimizer states, ranks): host/nvme,
nvme/nvme and, on two gloo ranks with the chunks sharded, device/nvme ([Note: gradients staged
from a device home]): 14 B; for comparison device/nvme on one rank (the model computes in its
home: a gradient shard on NVMe) and nvme/host (a host gradient shard), 16 B. Each is trained
for ``--steps`` clipped steps with gradient accumulation (the after-backward path, where
gradients wait in the payload or in the host buffers). One JSON line per placement (rank 0's
on two ranks; per-parameter figures over that rank's share of the parameters), from the
engine's own tier accounting:
- ``host_peak_per_param``: ``peak_bytes_by_tier["host"]`` / parameters (model data in host
  memory plus the NVMe tier's staging pools and the gradient buffers, which do not grow with
  the model), ``host_pools_bytes`` those fixed pools and ``host_peak_without_pools_per_param``
  the rest (the host model data);
- ``nvme_per_param``: ``bytes_by_tier["nvme"]`` / parameters (parameter payloads, both copies
  of the optimizer states, any gradient shard);
- ``model_data_per_param``: what ``model_data_by_tier`` counts per parameter on every tier
  with the states' second NVMe copy taken off: the issue's 14 B/param figure (with the
  chunks' padding; ``model_data_per_chunk_element`` without it);
- ``grad_disk_bytes_per_param_per_step``: gradient bytes spilled to and read back from disk
  (``moved_bytes`` "grad:host->nvme" + "grad:nvme->host") per parameter and step: what keeping
  gradients in an NVMe home costs in disk traffic after backward;
- ``hand``: the same three by hand (2 for the bf16 payload, 12 per copy of the fp32 master and
  Adam m, v, 2 for a gradient shard).

    python bench/nvme_bytes_per_param.py --nvme-dir /path/on/disk
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from _common import batch, emit, gpt2_model, spawn_ranks

PLACEMENTS = (
    ("host", "nvme", 1),
    ("nvme", "nvme", 1),
    ("device", "nvme", 2),
    ("device", "nvme", 1),
    ("nvme", "host", 1),
)
"""(parameter home, optimizer states, ranks)."""


def _pool_bytes(engine) -> int:
    """The NVMe tier's staging pools, the optimizer pipeline's and the gradient buffers."""
    tier = engine.tiers["nvme"]
    pools = [tier.staging] + [p.pool for p in engine.optimizer.pipelines.values()]
    extra = engine.grad_offload.nbytes if engine.grad_offload is not None else 0
    return sum(pool.count * pool.buffer_bytes for pool in pools) + extra


def measure(args, home: str, optim: str, nvme_dir: str, ranks: int = 1) -> dict:
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
        shard=ranks > 1,
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
        share = n_params / ranks  # this rank's share of the parameters
        pools = _pool_bytes(engine)
        grads_in_home = in_home == [True]
        grad_shard = 0.0 if grads_in_home else 2.0
        moved = stats["moved_bytes"]
        disk = moved.get("grad:host->nvme", 0) + moved.get("grad:nvme->host", 0)
        host_peak = stats["peak_bytes_by_tier"]["host"]
        return {
            "bench": "nvme_bytes_per_param",
            "placement": f"{home}/{optim}",
            "ranks": ranks,
            "sharded": all(c.group.sharded for c in chunks),
            "params": n_params,
            "chunk_elements": elements,
            "grads_in_payload": grads_in_home,
            "host_peak_per_param": host_peak / share,
            "host_pools_bytes": pools,
            "host_peak_without_pools_per_param": (host_peak - pools) / share,
            "nvme_per_param": stats["bytes_by_tier"].get("nvme", 0) / share,
            "device_per_param": stats["bytes_by_tier"].get("device", 0) / share,
            "model_data_per_param": sum(counted.values()) / share,
            "model_data_per_chunk_element": sum(counted.values()) / elements,
            "grad_disk_bytes_per_param_per_step": disk / share / args.steps,
            "hand": {
                "host_model_data": (2.0 if home == "host" else 0.0)
                + (12.0 + grad_shard if optim == "host" else 0.0),
                "nvme": (2.0 if home == "nvme" else 0.0)
                + (24.0 + grad_shard if optim == "nvme" else 0.0),
                "model_data": 14.0 + grad_shard,
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
    parser.add_argument(
        "--placements", default="", help="comma-separated home/optim[/ranks] (default: all)"
    )
    args = parser.parse_args()
    chosen = PLACEMENTS
    if args.placements:
        names = args.placements.split(",")
        chosen = [
            p
            for p in PLACEMENTS
            if "/".join(map(str, p[:2])) in names or "/".join(map(str, p)) in names
        ]
    for home, optim, ranks in chosen:
        with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme_dir:
            if ranks == 1:
                emit(**measure(args, home, optim, nvme_dir))
                continue
            reports = spawn_ranks(_rank, ranks, args, home, optim, nvme_dir)
            errors = [error for *_, error in reports if error]
            emit(**({"error": errors[0]} if errors else reports[0][1]))


def _rank(rank, world, port, args, home, optim, nvme_dir, queue) -> None:
    """One gloo rank of a sharded placement: reports (rank, its figures, error or None)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = measure(args, home, optim, f"{nvme_dir}/rank{rank}", ranks=world)
        queue.put((rank, result, None))
    except Exception as err:  # reported by the parent
        queue.put((rank, None, f"rank {rank}: {err!r}"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
