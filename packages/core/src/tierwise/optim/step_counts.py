"""Adam's step count per parameter, so a parameter without a gradient can skip a step.

[Note: unused parameters are skipped]
``torch.optim.AdamW`` skips every parameter whose ``.grad`` is None at ``step()``: no weight
decay, no moment update, and its step count (the exponent of Adam's bias correction) stays put.
tierwise keeps that: each slot remembers whether a gradient arrived since the last zero_grad
(``ParamSlot.has_grad``, set by any micro-batch; with several ranks OR-ed over the chunk's
data-parallel group before the update, as DDP gives every rank the gradient of a parameter that
any rank used), and the chunked update runs the fused kernel only on the slot ranges of
parameters that have one, each with its own step count from this component. When every
parameter of a chunk got a gradient and their counts agree (the usual case) the chunk is still
updated in one call over its whole flat shard.

The counts are plain integers keyed by each parameter's first name: they do not depend on the
chunk layout, the plan or the world size, so checkpoints store them by name and resharding or a
re-layout carries them over unchanged. The fused kernel gets each count as a float32 tensor of
that value, exactly what PyTorch's own per-parameter ``step`` tensor holds.
"""

from __future__ import annotations

from collections.abc import Iterable


class StepCounts:
    """How many optimizer updates each trainable parameter has had (by first name)."""

    def __init__(self, names: Iterable[str]):
        self.counts: dict[str, int] = dict.fromkeys(names, 0)

    def __getitem__(self, name: str) -> int:
        return self.counts[name]

    def advance(self, names: Iterable[str]) -> None:
        """One update of each of ``names``."""
        for name in names:
            self.counts[name] += 1

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        unknown = sorted(set(state["counts"]) - set(self.counts))
        if unknown:
            raise ValueError(
                f"checkpoint has optimizer step counts for parameters this model does not train "
                f"({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}): load a "
                "checkpoint of the same model"
            )
        self.counts.update({name: int(n) for name, n in state["counts"].items()})
