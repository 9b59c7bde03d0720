"""Run under torchrun: train a tiny model; the last rank raises in backward of step 1 and
prints ``FAILED_AT <unix time>`` first (tests/core/test_rank_failure.py)."""

import sys
import time

import tierwise
import torch
import torch.distributed as dist
from tierwise.train.distributed import init_world

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from helpers.models import tiny_batch, tiny_model  # noqa: E402


def main() -> None:
    world = init_world("cpu")
    torch.set_num_threads(1)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=2048,
        param_placement="host",
        cache_blocks=4,
    )
    for step in range(3):
        loss = model(**tiny_batch(seed=10 * step + world.rank)).loss
        if world.rank == world.size - 1 and step == 1:

            def boom(grad):
                print(f"FAILED_AT {time.time()}", file=sys.stderr, flush=True)
                raise RuntimeError(f"boom in backward on rank {world.rank}")

            loss.register_hook(boom)
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
