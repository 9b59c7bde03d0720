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

``--nvme-home-14`` ([Note: the 14-byte NVMe home]): nvme/host twice side by side in one process,
the 16-byte plan and ``Plan.grads_in_nvme_home``, both from core's planner (the search disabled;
the variant asked for explicitly: which plan the planners choose under a host budget is what
``tests/nvme/test_nvme_home_14b.py`` checks), with ``disk_bytes_per_param_per_step`` (every
NVMe byte the steps after the first moved: parameter loads, home writes, gradient spills and
read-backs), ``step_time_s`` (median of the steps after the first) and a last line of ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

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


def _ask_for_nvme_home_variant(variant: bool) -> None:
    """Core's planner, its plan asking for ``Plan.grads_in_nvme_home`` or not."""
    import tierwise.planning.planner as planner

    made = getattr(planner, "_made_by_core", planner.default_plan)
    planner._made_by_core = made

    def asking(**kwargs):
        plan = made(**kwargs)
        plan.grads_in_nvme_home = variant
        return plan

    planner.default_plan = asking


def _disk_bytes(moved: dict) -> int:
    return sum(n for direction, n in moved.items() if "nvme" in direction)


def measure(args, home: str, optim: str, nvme_dir: str, ranks: int = 1, variant=None) -> dict:
    import tierwise
    from tierwise.chunks.payload import model_data_by_tier

    if variant is not None:
        _ask_for_nvme_home_variant(variant)

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
        step_s, disk_after_first = [], 0
        for step in range(args.steps):
            began = time.perf_counter()
            for micro in range(2):
                loss = model(**batch(args.batch, args.seq, args.vocab, 10 * step + micro)).loss
                (loss / 2).backward()
            tierwise.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            step_s.append(time.perf_counter() - began)
            if step == 0:
                disk_after_first = _disk_bytes(engine.stats()["moved_bytes"])
        stats = engine.stats()
        chunks = list(engine.chunks())
        in_home = sorted({c.optim.grads_in_home for c in chunks})
        counted = model_data_by_tier(
            [(c.shard_size, True, c.group.sharded) for c in chunks],
            precision="bf16",
            param_tier=home,
            optim_tier=optim,
            grads_in_nvme_home=bool(variant),
        )  # one copy of the states: the figure
        elements = sum(c.shard_size for c in chunks)
        share = n_params / ranks  # this rank's share of the parameters
        pools = _pool_bytes(engine)
        grads_in_home = in_home == [True]
        grad_shard = 0.0 if grads_in_home else 2.0
        moved = stats["moved_bytes"]
        disk = moved.get("grad:host->nvme", 0) + moved.get("grad:nvme->host", 0)
        host_peak = stats["peak_bytes_by_tier"]["host"]
        buffers = engine.grad_offload.nbytes if engine.grad_offload is not None else 0
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
            "grad_offload_buffer_bytes": buffers,
            # model data and the gradient buffers: the NVMe tier's own pools taken off
            "host_peak_with_grad_buffers_per_param": (host_peak - pools + buffers) / share,
            "disk_bytes_per_param_per_step": (_disk_bytes(moved) - disk_after_first)
            / share
            / max(1, args.steps - 1),
            "moved_bytes": dict(moved),
            "step_time_s": statistics.median(step_s[1:] or step_s),
            "step_times_s": step_s,
            "n_chunks": len(chunks),
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
    parser.add_argument(
        "--nvme-home-14",
        action="store_true",
        help="nvme/host at 16 bytes and with grads_in_nvme_home, side by side",
    )
    args = parser.parse_args()
    if args.nvme_home_14:
        _nvme_home_14(args)
        return
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


def _nvme_home_14(args) -> None:
    """[Note: the 14-byte NVMe home]: the 16-byte plan, then the variant, then their ratios."""
    os.environ["TIERWISE_DISABLE_PLUGINS"] = "search"  # core's planner, patched per case
    results = {}
    for variant in (False, True):
        with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme_dir:
            result = measure(args, "nvme", "host", nvme_dir, variant=variant)
        result["case"] = 14 if variant else 16
        results[variant] = result
        emit(**result)
    sixteen, fourteen = results[False], results[True]
    emit(
        bench="nvme_bytes_per_param",
        case="14 over 16",
        host_peak_over_16=fourteen["host_peak_per_param"] / sixteen["host_peak_per_param"],
        host_peak_with_grad_buffers_over_16=fourteen["host_peak_with_grad_buffers_per_param"]
        / sixteen["host_peak_with_grad_buffers_per_param"],
        disk_bytes_per_param_per_step={
            16: sixteen["disk_bytes_per_param_per_step"],
            14: fourteen["disk_bytes_per_param_per_step"],
        },
        step_time_over_16=fourteen["step_time_s"] / sixteen["step_time_s"],
    )


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
