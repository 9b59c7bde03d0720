"""The interfaces core calls on objects plugins make: the warm-up memory tracer (from the
``tierwise_memory_tracer`` hook) and a storage tier's optimizer pipeline
(``Tier.optimizer_pipeline``). Structural (``typing.Protocol``): a plugin implements the
methods, it need not import or subclass these."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from tierwise.tiers.base import Slab


@runtime_checkable
class MemoryTracer(Protocol):
    """Measures non-model memory between the engine's module accesses ([Note: warm-up
    tracing])."""

    def start(self) -> None:
        """Begin counting (the warm-up forward begins)."""

    def mark(self, moment: str) -> None:
        """Close the current moment and open one named ``moment``."""

    def stop(self) -> list[tuple[str, int]]:
        """Stop counting; (moment, peak non-model bytes) for each moment."""

    def paused(self) -> AbstractContextManager[None]:
        """A context whose allocations are not counted (the engine's own work)."""


@runtime_checkable
class OptimizerPipeline(Protocol):
    """Overlaps reading, updating and writing the optimizer states of successive chunks on a
    storage tier ([Note: atomic optimizer step] for ``drain`` and ``abandon``)."""

    def prefetch(self, key: Hashable, slabs: Sequence[Slab]) -> bool:
        """Start reading ``slabs`` (master, exp_avg, exp_avg_sq) of chunk ``key`` ahead of use."""

    def submit(
        self,
        key: Hashable,
        slabs: Sequence[Slab],
        update: Callable[[list[torch.Tensor]], None],
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Run ``update`` on the states of ``slabs`` once read, then write them back;
        ``on_done()`` once the update ran or was dropped (any thread)."""

    def drain(self) -> None:
        """Wait until every submitted update is written and committed."""

    def abandon(self) -> None:
        """Drop submitted updates that are not committed."""

    def close(self) -> None:
        """Stop the pipeline's workers and release its buffers."""
