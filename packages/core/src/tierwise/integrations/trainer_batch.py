"""The example batch ``TierwiseTrainer`` gives ``tierwise.setup``, and the random states kept
around drawing it.

[Note: the Trainer's example batch]
``tierwise.setup`` predicts a step only from a batch's shape, so ``TierwiseTrainer`` gives it the
first batch of the train dataloader: Trainer's own (``get_train_dataloader``: its collator, column
removal and sampler), collated, from a loader of its own that training never sees, through
torch's plain iterator (accelerate's ``__iter__`` synchronises random states across ranks and
registers the loader as the active one until it is exhausted). So that the loader exists,
``transformers.Trainer.__init__`` runs before setup, on the model not yet managed; the optimizer
is swapped for tierwise's after. The random states are taken twice: before ``Trainer.__init__``
(the caller's) and after it (the Trainer's, from its ``set_seed(args.seed)``). Setup runs on the
caller's (a meta model's initial values come from them, as when setup ran before
``Trainer.__init__``), and the Trainer's are put back after the batch and setup have drawn from
them, so training draws exactly what it drew without an example batch.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def first_train_batch(trainer: Any) -> Any:
    """The first collated batch of ``trainer``'s train dataloader (a mapping as a dict); None without a train dataset
    or for an IterableDataset (it may not iterate twice). It draws random numbers: the caller
    puts the states back."""
    dataset = trainer.train_dataset
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    loader = trainer.get_train_dataloader()
    batch = next(torch.utils.data.DataLoader.__iter__(loader), None)
    # a tokenizer's collator gives a BatchEncoding, a Mapping but no dict: profilers call
    # ``model(**batch)`` on a dict
    return dict(batch) if isinstance(batch, Mapping) else batch


def rng_states() -> dict[str, Any]:
    """Python's, numpy's and torch's random states (CUDA's when it has started)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state()}
    states["cpu"] = torch.get_rng_state()
    if torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Put back what ``rng_states`` took."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
