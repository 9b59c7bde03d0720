"""What the trained model does on data it did not train on: the held-out loss, and a text sample
(greedy or temperature sampling, one token at a time)."""

from __future__ import annotations

import time
import unicodedata
from typing import TYPE_CHECKING

import torch

from tierwise.train.blocks import to_device
from tierwise.train.distributed import World, mean_over_ranks

if TYPE_CHECKING:
    from tierwise.train.blocks import Corpus

SAMPLE_BUDGET_S = 60.0
"""A final sample predicted to take longer is skipped (with the command that runs it)."""


class SampleTooSlow(Exception):
    """The first sampled token shows the sample would take longer than allowed."""

    def __init__(self, *, tokens: int, first_token_s: float):
        self.tokens, self.first_token_s = tokens, first_token_s
        self.predicted_s = tokens * first_token_s
        super().__init__(f"the sample would take about {self.predicted_s:.0f} s")

    def note(self, run_dir) -> str:
        """The one line saying the sample was skipped, and the command that runs it."""
        return (
            f"sample skipped: {self.tokens} tokens would take about "
            f"{self.predicted_s / 60:.0f} min (the first took {self.first_token_s:.1f} s: one "
            f"full forward per token); run it with: tierwise train --resume {run_dir} "
            f"--sample-tokens {self.tokens}"
        )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, corpus: Corpus, batch: int, world: World, device: torch.device
) -> float:
    """Mean loss over the held-out rows; every rank runs the same number of forwards."""
    per_rank = corpus.n_eval // world.size
    first = world.rank * per_rank
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(first, first + per_rank, batch):
            part = corpus.eval_batch(start, min(start + batch, first + per_rank))
            rows = len(part["input_ids"])
            total += model(**to_device(part, device)).loss.item() * rows
            count += rows
    finally:
        model.train()
    return mean_over_ranks(total / count, world)


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters other than newline and tab are shown as
    escapes (``\x1b``), so a generated escape sequence cannot move the cursor or recolour it."""
    return "".join(
        ch
        if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Co", "Cn")
        else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    *,
    new_tokens: int,
    temperature: float,
    context: int,
    seed: int,
    device: torch.device,
    max_seconds: float | None = None,
) -> list[int]:
    """``prompt_ids`` followed by ``new_tokens`` generated ids.

    Each token is one full forward over the last ``context`` ids (no KV cache: simple, and the
    engine sees ordinary forwards). ``temperature`` 0 is greedy. Sampling draws from its own
    generator, so the training RNG is untouched. With ``max_seconds``, raises SampleTooSlow
    after the first token when ``new_tokens`` times its time exceeds it.
    """
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    was_training = model.training
    model.eval()
    try:
        for n in range(new_tokens):
            started = time.perf_counter()
            window = torch.tensor([ids[-context:]], device=device)
            logits = model(input_ids=window, use_cache=False).logits[0, -1].float().cpu()
            if temperature == 0:
                next_id = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_id = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(next_id)
            took = time.perf_counter() - started
            if n == 0 and max_seconds is not None and took * new_tokens > max_seconds:
                raise SampleTooSlow(tokens=new_tokens, first_token_s=took)
    finally:
        model.train(was_training)
    return ids
