"""Run by tests/hf/test_torchrun.py under `torchrun --nproc-per-node 2`: a TierwiseTrainer run
that writes each rank's view of it to OUT/rank<r>.json, its state_dict to OUT/state-rank<r>.pt
and the saved model to OUT/saved."""

import gc
import json
import sys
from pathlib import Path

import tierwise
import torch
from helpers.models import tiny_model
from hf_helpers import TokenBlocks, budget_config, logged, training_args
from tierwise.integrations.hf import TierwiseTrainer


def main(out: Path) -> None:
    model = tiny_model("llama")
    args = training_args(out / "run", max_steps=3, gradient_accumulation_steps=2)
    trainer = TierwiseTrainer(
        model=model, args=args, train_dataset=TokenBlocks(), tierwise_config=budget_config(model)
    )
    trainer.train()
    trainer.save_model(str(out / "saved"))
    engine = tierwise.engine_of(trainer.model)
    rank = torch.distributed.get_rank()
    state = trainer.model.state_dict()  # collective: the whole model on every rank
    torch.save(state, out / f"state-rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "world": torch.distributed.get_world_size(),
                "loss": logged(trainer, "loss"),
                "dp_sizes": sorted({g.world for g in engine.groups}),
                "wrapped": type(trainer.model_wrapped).__name__,
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # [Note: destroying process groups] (tierwise/train/distributed.py): the trainer, model and
    # engine are gone once main returns; collect their cycles and destroy the group while the
    # interpreter is alive (otherwise a gloo worker can abort the process at exit)
    gc.collect()
    torch.distributed.destroy_process_group()
