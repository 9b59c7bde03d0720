"""The gradient lifecycle of one chunk: one state, checked transitions, one owner each.

[Note: gradient lifecycle]
A trainable chunk's gradients go through one state machine, as FSDP2 keeps one
``TrainingState`` per module: the engine's one ``GradStates`` table (``runtime/grads/states.py``,
chunk key -> state, read with ``of``), handed to the two owners below, the only ones that call
its ``move``. Each transition has one owner and is checked:

    EMPTY --first gradient since zero_grad--> FILLING --all of this backward's--> REDUCED
    HELD --first gradient of a later backward (accumulation)--> ACCUMULATING --> REDUCED
    FILLING --end of a ``no_sync`` backward of several ranks (kept in the reducer's local buffer)--> EMPTY
    EMPTY --end of backward, no gradient at all (zeros)--> REDUCED
    REDUCED --a late gradient in the same backward (re-entrant checkpoint reuse)--> ACCUMULATING
    REDUCED --end of backward--> HELD
    REDUCED or HELD --the chunk's update is queued with its gradients--> UPDATING --> UPDATED
    UPDATED --step commits--> HELD (gradients still in memory) or CONSUMED (an offloaded shard
             the update read and gave back: [Note: active gradient offloading])
    UPDATED --the speculation failed (norm over max_norm, fp16 overflow)--> ROLLED_BACK
    ROLLED_BACK --the update is redone with the right coefficient--> UPDATING
    UPDATING, ROLLED_BACK --a failed step was undone ([Note: atomic optimizer step])--> HELD
    any --zero_grad, a dropped backward or a checkpoint load--> EMPTY

A re-layout is no transition: the re-packed group's new chunks start where its old ones were
(CONSUMED if any was, else HELD if any held gradients, else EMPTY), which the engine puts in
the table (``GradStates.renew``) after the re-layout returns.

The gradient path (``GradientPath``) owns every transition up to REDUCED and HELD, and back to
EMPTY; the optimizer step (``OptimizerStep``) owns those from REDUCED/HELD on: the update,
speculation, rollback and commit. Several ranks: a chunk handed to the streaming reducer stays
FILLING/ACCUMULATING until its reduction lands (the reducer knows which chunks it holds); it is
REDUCED then, and its update may start during backward (REDUCED -> UPDATING) once the ranks
agreed that none of them was missing a gradient of it at launch, else at the end of backward
([Note: one collective order]).

What stays beside the state is data, not lifecycle: the buffers that hold a chunk's gradients
(its shard, ``OptimSlabs.grad_buffer``, the reducer's staging and ``no_sync`` buffers, the slots' ``kept_grad``
and ``OptimSlabs.grads_kept`` saying which of them holds this step's), the count of gradients
this backward still owes (``pending``) and the per-parameter facts (``got_grad``,
``has_grad``).
"""

from __future__ import annotations

import enum


class GradState(enum.Enum):
    EMPTY = "empty"
    """No gradient since zero_grad (the shard's memory may be given back)."""
    FILLING = "filling"
    """The first backward since zero_grad is delivering gradients: a slot's first gradient is
    copied in, what got none is zeroed when the chunk is finished ([Note: first gradient is a
    copy])."""
    ACCUMULATING = "accumulating"
    """A later backward adds its gradients into the held ones."""
    REDUCED = "reduced"
    """This backward's gradients are all in the shard (reduced across ranks): final unless a
    later backward adds more."""
    HELD = "held"
    """Gradients of finished backwards, waiting for the step or another backward."""
    UPDATING = "updating"
    """Its optimizer update is queued or running and reads the gradients."""
    UPDATED = "updated"
    """Its update ran; speculative until the step commits it."""
    ROLLED_BACK = "rolled-back"
    """A speculative update was undone; the gradients are in place for the redo."""
    CONSUMED = "consumed"
    """The committed update read an offloaded shard and gave its buffer back: no gradient to
    use again until zero_grad and a new backward."""


class GradOwner(enum.Enum):
    GRADIENT_PATH = "gradient path"
    OPTIMIZER_STEP = "optimizer step"


_S, _G, _O = GradState, GradOwner.GRADIENT_PATH, GradOwner.OPTIMIZER_STEP
TRANSITIONS: dict[tuple[GradState, GradState], GradOwner] = {
    (_S.EMPTY, _S.FILLING): _G,
    (_S.HELD, _S.ACCUMULATING): _G,
    (_S.FILLING, _S.REDUCED): _G,
    (_S.ACCUMULATING, _S.REDUCED): _G,
    (_S.REDUCED, _S.ACCUMULATING): _G,
    (_S.EMPTY, _S.REDUCED): _G,
    (_S.FILLING, _S.EMPTY): _G,
    (_S.ACCUMULATING, _S.HELD): _G,
    (_S.REDUCED, _S.HELD): _G,
    (_S.REDUCED, _S.UPDATING): _O,
    (_S.HELD, _S.UPDATING): _O,
    (_S.UPDATING, _S.UPDATED): _O,
    (_S.UPDATED, _S.HELD): _O,
    (_S.UPDATED, _S.CONSUMED): _O,
    (_S.UPDATED, _S.ROLLED_BACK): _O,
    (_S.UPDATING, _S.ROLLED_BACK): _O,
    (_S.ROLLED_BACK, _S.UPDATING): _O,
    (_S.ROLLED_BACK, _S.HELD): _O,
    (_S.UPDATING, _S.HELD): _O,
    **{(state, _S.EMPTY): _G for state in GradState if state is not _S.FILLING},
}
"""(old, new) -> the one component allowed to make that transition."""

HOLDS_GRADIENTS = frozenset({_S.REDUCED, _S.HELD, _S.UPDATING, _S.UPDATED, _S.ROLLED_BACK})
"""States in which the chunk's gradients of finished backwards are there to read."""

HOME_HOLDS_GRADS = frozenset(
    {_S.FILLING, _S.ACCUMULATING, _S.REDUCED, _S.HELD, _S.UPDATING, _S.ROLLED_BACK}
)
"""States in which a chunk that keeps its gradients in its home ([Note: gradients in the
parameter payload]) may have gradients there instead of parameters (UPDATED and CONSUMED: its
update wrote the new parameters; EMPTY: ``drop_grads`` wrote them back from the master)."""

IN_BACKWARD = frozenset({_S.FILLING, _S.ACCUMULATING})
"""States in which the running backward still delivers gradients to the chunk."""


class IllegalGradTransition(RuntimeError):
    """A chunk's gradient state changed in a way the runtime never should: a tierwise bug."""


def check_grad_transition(chunk: str, old: GradState, new: GradState, owner: GradOwner) -> None:
    allowed = TRANSITIONS.get((old, new))
    if allowed is not owner:
        why = "not a transition" if allowed is None else f"owned by the {allowed.value}"
        raise IllegalGradTransition(
            f"chunk {chunk}: illegal gradient state transition {old.name} -> {new.name} by the "
            f"{owner.value} ({why}; this is a tierwise bug, please report it with the model "
            "and plan)"
        )


__all__ = [
    "HOLDS_GRADIENTS",
    "HOME_HOLDS_GRADS",
    "IN_BACKWARD",
    "TRANSITIONS",
    "GradOwner",
    "GradState",
    "IllegalGradTransition",
    "check_grad_transition",
]
