"""A Lightning Fabric strategy, registered as ``"tierwise"``: Fabric's loop over tierwise chunks.

[Note: Fabric through tierwise]
``Fabric(strategy="tierwise")`` (after ``import tierwise.integrations.fabric``, which registers
it) or ``Fabric(strategy=TierwiseStrategy(config=...))``. What each Fabric call becomes:

- ``fabric.init_module()``: the model is built on the meta device, whatever ``empty_init`` says;
  ``fabric.setup`` gives each module its values one at a time, with the model's own initialiser,
  as ``tierwise.setup`` does for any meta model (or load weights afterwards).
- ``fabric.setup(model, optimizer)``: ``tierwise.setup(model, optimizer, config)`` (one
  optimizer, set up together with its model); the module is never moved (``module_to_device``
  does nothing: the plan decides where its data lives). An LR scheduler made on the optimizer
  before ``setup`` keeps working: tierwise's optimizer keeps the same ``param_groups``.
- Precision is tierwise's: Fabric's ``precision`` flag is mapped onto ``Config.precision``
  ("32-true" → fp32, "bf16-mixed"/"bf16-true" → bf16, "16-mixed"/"16-true" → fp16), and the
  precision plugin Fabric gets (``TierwisePrecision``) changes nothing: no autocast, no input or
  module casts, no gradient scaler (tierwise keeps low-precision parameters with fp32 masters and
  scales fp16 losses itself).
- ``fabric.clip_gradients(model, optimizer, max_norm=...)``: ``tierwise.clip_grad_norm_``.
- ``fabric.no_backward_sync(model)``: ``tierwise.no_sync``.
- ``fabric.save(path, state)`` / ``fabric.load(path, state)``: ``tierwise.save_checkpoint`` /
  ``load_checkpoint`` — a directory written a chunk at a time by every rank, never the whole
  model in host memory; the state's other entries (numbers, a scheduler's ``state_dict``…) are
  the checkpoint's ``extra`` (plain data).
One process: several ranks run tierwise's own data parallelism under torchrun with the plain loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierwise import api
from tierwise.checkpoint.directory import load_checkpoint, save_checkpoint
from tierwise.config import Config
from tierwise.registry import engine_of

try:
    from lightning.fabric.accelerators import CUDAAccelerator
    from lightning.fabric.plugins.precision import Precision
    from lightning.fabric.strategies import STRATEGY_REGISTRY, SingleDeviceStrategy
except ImportError as err:  # pragma: no cover - the lightning extra is missing
    raise ImportError(
        "tierwise.integrations.fabric needs Lightning: pip install 'tierwise[lightning]'"
    ) from err

FABRIC_PRECISIONS = {
    "32-true": "fp32",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
}
"""Fabric's precision flags and the tierwise precision each becomes."""


class TierwiseFabricError(ValueError):
    """A Fabric call TierwiseStrategy cannot honour (one line: what to do instead)."""


class TierwisePrecision(Precision):
    """Fabric's precision plugin under tierwise: it leaves precision to tierwise (no autocast,
    no casts, no scaler). ``precision`` is the Fabric flag it stands for."""

    def __init__(self, precision: str = "32-true") -> None:
        self.precision = precision


class _TierwiseNoSync:
    """What Fabric's ``no_backward_sync`` calls on the strategy's backward-sync control."""

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool):
        return api.no_sync(module) if enabled else contextlib.nullcontext()


class TierwiseStrategy(SingleDeviceStrategy):
    """Lightning Fabric's training loop with the model's data in tierwise chunks ([Note: Fabric
    through tierwise]). ``config``: a ``tierwise.Config``, a dict or a .toml/.json path."""

    def __init__(self, config: Config | dict | str | None = None, **kwargs: Any) -> None:
        self.config = Config.from_any(config) if config is not None else None
        self._given = _config_fields(config)
        super().__init__(**kwargs)
        self._backward_sync_control = _TierwiseNoSync()

    # -- precision: tierwise's -----------------------------------------------------------
    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else TierwisePrecision()

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        if precision is None:  # not chosen yet: Fabric's precision flag decides
            self._precision = None
            return
        flag = getattr(precision, "precision", "32-true")
        if flag not in FABRIC_PRECISIONS:
            raise TierwiseFabricError(
                f"TierwiseStrategy: Fabric(precision={flag!r}) has no tierwise equivalent; use one "
                f"of {', '.join(FABRIC_PRECISIONS)} (tierwise keeps fp32 masters and Adam states)"
            )
        given = self._given.get("precision")
        if given is not None and flag != "32-true" and FABRIC_PRECISIONS[flag] != given:
            raise TierwiseFabricError(
                f"TierwiseStrategy: Fabric(precision={flag!r}) means {FABRIC_PRECISIONS[flag]} but "
                f"the tierwise config sets precision={given!r}; make them agree"
            )
        self._precision = TierwisePrecision(flag)

    def tierwise_precision(self) -> str:
        """The precision tierwise trains in: the config's, else Fabric's flag's."""
        return self._given.get("precision") or FABRIC_PRECISIONS[self.precision.precision]

    # -- one process on one device ---------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        device = self._given.get("device")
        if device is not None:
            return torch.device(device)
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def module_to_device(self, module: torch.nn.Module) -> None:
        """Never: the plan decides where the model's data lives."""

    def module_init_context(self, empty_init: bool | None = None):
        return torch.device("meta")

    def tensor_init_context(self):
        return self.root_device

    # -- setup -----------------------------------------------------------------------------
    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if len(optimizers) != 1:
            raise TierwiseFabricError(
                f"TierwiseStrategy: fabric.setup got {len(optimizers)} optimizers; tierwise sets a "
                "model up with exactly one Adam/AdamW (use param groups for different settings)"
            )
        overrides = {"precision": self.tierwise_precision(), "device": str(self.root_device)}
        model, optimizer = api.setup(module, optimizers[0], self.config, **overrides)
        return model, [optimizer], scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        raise TierwiseFabricError(
            "TierwiseStrategy: set the model up together with its optimizer: "
            "model, optimizer = fabric.setup(model, optimizer)"
        )

    def setup_optimizer(self, optimizer):
        raise TierwiseFabricError(self._err_msg_joint_setup_required())

    # -- clipping --------------------------------------------------------------------------
    def clip_gradients_norm(
        self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True
    ) -> torch.Tensor:
        if float(norm_type) != 2.0:
            raise TierwiseFabricError(
                f"TierwiseStrategy: clip_gradients(norm_type={norm_type}); tierwise clips the "
                "global 2-norm: leave norm_type at 2"
            )
        total = api.clip_grad_norm_(module, max_norm)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of the gradients is {total.item()}: not finite (pass "
                "error_if_nonfinite=False to clip anyway)"
            )
        return total

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        raise TierwiseFabricError(
            "TierwiseStrategy: clip_gradients(clip_val=...) is not supported; tierwise clips the "
            "global norm: use clip_gradients(model, optimizer, max_norm=...)"
        )

    # -- checkpoints: tierwise's directory, streamed ---------------------------------------
    def save_checkpoint(
        self,
        path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if filter:
            raise TierwiseFabricError(
                "TierwiseStrategy: fabric.save(filter=...) is not supported; a tierwise checkpoint "
                "holds the whole model, optimizer state included"
            )
        model, optimizer, extra = _split_state(state)
        save_checkpoint(Path(path), model, optimizer, extra=extra)

    def load_checkpoint(
        self, path, state=None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            raise TierwiseFabricError(
                "TierwiseStrategy: fabric.load needs the objects to restore, e.g. "
                "fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )
        model, optimizer, _ = _split_state(state)
        extra = load_checkpoint(Path(path), model, optimizer) or {}
        for name, obj in state.items():
            if name not in extra:
                if strict and not _is_model_or_optimizer(obj):
                    raise KeyError(f"fabric.load: {name!r} is not in checkpoint {path}")
                continue
            value = extra.pop(name)
            if hasattr(obj, "load_state_dict"):
                obj.load_state_dict(value)
            else:
                state[name] = value
        return extra

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if "tierwise" not in strategy_registry:
            strategy_registry.register(
                "tierwise",
                cls,
                description="tierwise: model data in chunks across device, host, NVMe",
            )


def _config_fields(config: Config | dict | str | None) -> dict[str, Any]:
    from tierwise.integrations.hf import config_dict

    return config_dict(config)


def _managed(model: torch.nn.Module) -> bool:
    try:
        engine_of(model)
    except ValueError:
        return False
    return True


def _is_model_or_optimizer(obj: Any) -> bool:
    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def _split_state(state: dict[str, Any]):
    """The managed model, its optimizer (or None) and the rest as plain data."""
    models = [obj for obj in state.values() if isinstance(obj, torch.nn.Module)]
    if len(models) != 1 or not _managed(models[0]):
        raise TierwiseFabricError(
            "TierwiseStrategy: fabric.save/load needs exactly one model set up by fabric.setup in "
            f"the state (got {len(models)} modules)"
        )
    optimizers = [obj for obj in state.values() if isinstance(obj, torch.optim.Optimizer)]
    extra = {
        name: obj.state_dict() if hasattr(obj, "state_dict") else obj
        for name, obj in state.items()
        if not _is_model_or_optimizer(obj)
    }
    return models[0], (optimizers[0] if optimizers else None), extra


TierwiseStrategy.register_strategies(STRATEGY_REGISTRY)
