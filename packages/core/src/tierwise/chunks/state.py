"""Per-parameter tensor states (PatrickStar) with checked transitions."""

from __future__ import annotations

import enum


class TensorState(enum.Enum):
    FREE = "free"
    """No payload yet (before materialisation)."""
    HOLD = "hold"
    """Payload valid, not in use."""
    COMPUTE = "compute"
    """In use by a module's forward or backward: its chunk must stay resident."""
    HOLD_AFTER_FWD = "hold_after_fwd"
    """Used by forward, its backward is still to come."""
    HOLD_AFTER_BWD = "hold_after_bwd"
    """Its gradient for this backward has been captured."""


_S = TensorState
ALLOWED: dict[TensorState, frozenset[TensorState]] = {
    _S.FREE: frozenset({_S.HOLD}),
    _S.HOLD: frozenset({_S.COMPUTE, _S.HOLD}),
    _S.COMPUTE: frozenset({_S.HOLD_AFTER_FWD, _S.HOLD_AFTER_BWD, _S.HOLD}),
    _S.HOLD_AFTER_FWD: frozenset({_S.COMPUTE, _S.HOLD_AFTER_BWD, _S.HOLD}),
    _S.HOLD_AFTER_BWD: frozenset({_S.COMPUTE, _S.HOLD_AFTER_BWD, _S.HOLD}),
}


class IllegalTransition(RuntimeError):
    """A tensor state changed in a way the runtime never should: a tierwise bug."""


def check_transition(name: str, old: TensorState, new: TensorState) -> None:
    if new not in ALLOWED[old]:
        raise IllegalTransition(
            f"parameter {name}: illegal tensor state transition {old.name} -> {new.name} "
            "(this is a tierwise bug; please report it with the model and plan)"
        )
