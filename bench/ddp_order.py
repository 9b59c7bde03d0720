"""Does DDP at 4 gloo ranks agree with itself bitwise when only its bucket size changes?

Trains the same small GPT-2 (tests/helpers/models.py's, 8 layers; fp32, AdamW, each rank its own
batch) at 4 gloo ranks with:
- ``ddp``: DDP's default bucketing (25 MiB: one bucket for this model) and ``ddp_tiny``: 10 kB
  buckets; both with DDP's default all-reduce;
- ``ddp_rank`` / ``ddp_rank_tiny``: the same two bucket sizes with a communication hook that
  sums every rank's bucket in rank order (tests/helpers/ddp_order.py);
- ``tierwise_fast``: tierwise with the default ``reduce_order="fast"`` (gloo's reduce-scatter
  of each chunk); ``tierwise_rank`` / ``tierwise_rank_big``: ``reduce_order="rank"`` at chunk
  sizes 4096 and 8192 elements. Parameters and optimizer states on the host, a device budget
  of a third of the full fp32 gradient (tests/core/test_reduction_order.py's setting).

Prints one JSON line: the largest absolute parameter difference after ``--steps`` steps for
each pair that matters (0.0 = bitwise equal), whether the losses were equal, and each
system's median step time on rank 0, with the machine.

    python bench/ddp_order.py [--steps 4] [--ranks 4]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import emit, spawn_ranks  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402

SYSTEMS = (
    "ddp",
    "ddp_tiny",
    "ddp_rank",
    "ddp_rank_tiny",
    "tierwise_fast",
    "tierwise_rank",
    "tierwise_rank_big",
)
PAIRS = (
    ("ddp", "ddp_tiny"),
    ("ddp", "tierwise_fast"),
    ("ddp_tiny", "tierwise_fast"),
    ("ddp_rank", "ddp_rank_tiny"),
    ("ddp_rank", "tierwise_rank"),
    ("tierwise_rank", "tierwise_rank_big"),
)


def _model():
    return tiny_model("gpt2", n_layer=8)


def _batch(rank: int, step: int) -> dict:
    return tiny_batch(seed=100 * step + rank)


def _train(system: str, rank: int, steps: int):
    model = _model()
    if system.startswith("ddp"):
        from helpers.ddp_order import rank_order_hook

        cap = {"bucket_cap_mb": 0.01} if system.endswith("tiny") else {}
        wrapped = torch.nn.parallel.DistributedDataParallel(model, **cap)
        if system.startswith("ddp_rank"):
            wrapped.register_comm_hook(None, rank_order_hook)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    else:
        import tierwise

        full_grad = sum(p.numel() for p in model.parameters()) * 4
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        wrapped, opt = tierwise.setup(
            model,
            opt,
            precision="fp32",
            device="cpu",
            chunk_size=8192 if system.endswith("big") else 4096,
            device_memory=full_grad // 3,
            param_placement="host",
            optimizer_placement="host",
            reduce_order="fast" if system.endswith("fast") else "rank",
        )
        model = wrapped
    losses, times = [], []
    for step in range(steps):
        start = time.perf_counter()
        loss = wrapped(**_batch(rank, step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    state = {k.removeprefix("module."): v.clone() for k, v in model.state_dict().items()}
    return losses, state, statistics.median(times[1:] or times)


def _worker(rank, world, port, systems, steps, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {system: _train(system, rank, steps) for system in systems}
        buffer = io.BytesIO()
        torch.save(results, buffer)
        queue.put((rank, buffer.getvalue(), None))
    except Exception as err:  # report, never hang the parent
        queue.put((rank, None, f"{type(err).__name__}: {err}"))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    systems = args.systems.split(",")
    reports = spawn_ranks(_worker, args.ranks, systems, args.steps)
    errors = [e for *_, e in reports if e]
    if errors:
        raise SystemExit(errors[0])
    results = torch.load(io.BytesIO(reports[0][1]))  # rank 0's (every rank holds the same)
    diffs, losses_equal = {}, {}
    for a, b in PAIRS:
        if a in results and b in results:
            state_a, state_b = results[a][1], results[b][1]
            diffs[f"{a} vs {b}"] = max(
                float((state_a[n] - state_b[n]).abs().max()) for n in state_a
            )
            losses_equal[f"{a} vs {b}"] = results[a][0] == results[b][0]
    emit(
        bench="ddp_order",
        ranks=args.ranks,
        steps=args.steps,
        params=sum(p.numel() for p in _model().parameters()),
        precision="fp32",
        backend="gloo",
        max_abs_param_diff=diffs,
        losses_equal=losses_equal,
        # rank 0's median step after the first; the 4 ranks share this machine's cores, so
        # only ratios within one run mean anything
        step_s={system: round(results[system][2], 4) for system in systems},
    )


if __name__ == "__main__":
    main()
