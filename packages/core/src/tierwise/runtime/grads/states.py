"""The gradient state of every chunk: one table with checked transitions ([Note: gradient
lifecycle]).

The engine builds one ``GradStates`` and hands it to the gradient path (which owns the
transitions up to REDUCED and HELD, and back to EMPTY) and to the optimizer step (which owns
those from REDUCED/HELD on); everything else reads it through ``of``. The states are kept here,
keyed by chunk key, never on the chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tierwise.chunks import Chunk
from tierwise.chunks.grad_state import (
    HOME_HOLDS_GRADS,
    GradOwner,
    GradState,
    check_grad_transition,
)


class GradStates:
    """Chunk key -> where that chunk's gradients are in their lifecycle."""

    def __init__(self, chunks: Iterable[Chunk]) -> None:
        self._states: dict[tuple[str, int], GradState] = {c.key: GradState.EMPTY for c in chunks}

    def of(self, chunk: Chunk) -> GradState:
        return self._states[chunk.key]

    def home_holds_grads(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s home may hold gradients now, not parameters: [Note: gradients in
        the parameter payload]."""
        optim = chunk.optim
        if optim is None or not optim.grads_in_home:
            return False
        state = self.of(chunk)
        # a storage tier's update is committed at step: until then the home may hold gradients
        # kept for a redo, and the committed master holds the parameters
        return state in HOME_HOLDS_GRADS or (
            state is GradState.UPDATED and not optim.tier.ADDRESSABLE
        )

    def move(self, chunk: Chunk, new: GradState, owner: GradOwner) -> None:
        """The one way a chunk's state changes: checked against the transition's owner (a
        refused transition changes nothing)."""
        key = chunk.key
        old = self._states[key]
        if new is not old:
            check_grad_transition(f"{chunk.group.name}#{chunk.index}", old, new, owner)
            self._states[key] = new

    def carried_over(self, chunks: Iterable[Chunk]) -> GradState:
        """The state that chunks re-packed from ``chunks`` (a group's chunks, at rest between
        steps) start in: CONSUMED when an update consumed some of their gradients, HELD when
        some hold gradients, else EMPTY."""
        states = {self.of(c) for c in chunks}
        if GradState.CONSUMED in states:
            return GradState.CONSUMED
        return GradState.HELD if states - {GradState.EMPTY} else GradState.EMPTY

    def renew(self, chunks: Iterable[Chunk], carried: Mapping[str, GradState]) -> None:
        """After a re-layout: ``chunks`` are every chunk now; those of a re-packed group (a key
        of ``carried``) start in its carried-over state, the others keep theirs. Not a
        transition: new chunks start where the old ones were."""
        old = self._states
        self._states = {
            c.key: carried[c.group.name] if c.group.name in carried else old[c.key] for c in chunks
        }


__all__ = ["GradStates"]
