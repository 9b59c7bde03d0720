"""The model -> engine lookup: a leaf module every layer may import (api, checkpoint, plugins).

[Note: engine registry]
The engine of a managed model is kept on the model itself (attribute ``_tierwise_engine``),
not in a module-level table: the engine refers to its model, so a table keyed by the model
(even a ``WeakKeyDictionary``) would hold the model alive through its own value. This way the
registry holds no reference at all: dropping the model (and its optimizer) frees both. The
attribute's name belongs to this module; nothing else reads or writes it. The registry is a
leaf: it stores the engine as any object and never imports it; ``tierwise.api.engine_of`` is
the typed lookup callers use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_ENGINE_ATTR = "_tierwise_engine"


def register(model: torch.nn.Module, engine: object) -> None:
    """Record ``engine`` as the engine managing ``model``."""
    setattr(model, _ENGINE_ATTR, engine)


def unregister(model: torch.nn.Module) -> None:
    """Forget ``model``'s engine (no-op when it has none)."""
    if hasattr(model, _ENGINE_ATTR):
        delattr(model, _ENGINE_ATTR)


def managed(model: torch.nn.Module) -> bool:
    """Whether a tierwise engine manages ``model``."""
    return getattr(model, _ENGINE_ATTR, None) is not None


def engine_of(model: torch.nn.Module) -> Any:
    """The engine managing ``model`` (``.plan``, ``.stats()``), as registered."""
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is None:
        raise ValueError("this model is not managed by tierwise: call tierwise.setup first")
    return engine
