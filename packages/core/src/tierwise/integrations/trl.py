"""TRL's ``SFTTrainer`` and ``DPOTrainer`` with the model's data in tierwise chunks.

[Note: TRL's trainers through tierwise]
``TierwiseSFTTrainer`` is ``class TierwiseSFTTrainer(SFTTrainer, TierwiseTrainer)`` (and alike for
DPO), so the method order is TRL's trainer, then ``TierwiseTrainer``, then ``transformers.Trainer``.
TRL's ``__init__`` runs first and does to the model all it does to a plain one — PEFT wrapping from
``peft_config``, DPO's frozen "ref" adapter, the datasets' tokenising — and calls its parent's
``__init__``, which is ``TierwiseTrainer``'s: the model TRL will train (adapters included) is set up
with tierwise there, and only then is ``transformers.Trainer``'s ``__init__`` called. TRL's
``__init__`` takes no ``tierwise_config``, so the subclass keeps it on the instance
(``_composed_options``) for ``TierwiseTrainer`` to take. What ``TierwiseTrainer`` overrides
(accelerate's preparation, clipping, ``no_sync``, checkpoints, ``save_model``) TRL's trainers do
not, so those stay tierwise's; what TRL overrides (its losses, metrics, logging) stays TRL's.

TRL's losses project through ``lm_head.weight`` in tiles without calling ``lm_head``: [Note:
parameters used outside their module's forward] makes that work.

``tierwise.setup`` gets the first train batch, collated by TRL's collator, as TRL's loss calls the
model with it (DPO's less the keys only its loss reads): [Note: the Trainer's example batch].

``gradient_checkpointing=True`` becomes tierwise's ``activation_checkpointing`` (every transformer
block recomputed by tierwise, [Note: per-block recompute]) and is then turned off in the arguments,
so that ``Trainer`` does not also switch on Hugging Face's own checkpointing.

DPO's reference model is never a second copy of the model: it is the model with its adapters
disabled (a PEFT model or ``peft_config``; TRL's frozen "ref" adapter when the model came with a
trained adapter) or the log-probabilities precomputed once before training
(``precompute_ref_log_probs=True``). A separate ``ref_model`` is refused.
"""

from __future__ import annotations

import os
from typing import Any

from tierwise.config import Config
from tierwise.integrations.hf import TierwiseTrainer, TierwiseTrainerError, config_dict

try:
    from trl import DPOTrainer, SFTTrainer
except ImportError as err:  # pragma: no cover - the trl extra is missing
    raise ImportError("tierwise.integrations.trl needs trl: pip install 'tierwise[trl]'") from err


_DPO_LOSS_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")
"""Keys of a DPO batch that its loss reads and the model is not called with."""


def _compose(
    trainer: Any,
    name: str,
    model: Any,
    args: Any,
    tierwise_config: Config | dict | str | os.PathLike | None,
    save_dtype: str,
) -> None:
    """Check what TRL is about to get and keep the tierwise options for ``TierwiseTrainer``."""
    if model is None or isinstance(model, (str, os.PathLike)):
        raise TierwiseTrainerError(
            f"{name}: `model` must be a torch module (TRL would load {model!r} whole into host "
            "memory); build it first, e.g. AutoModelForCausalLM.from_pretrained(path), or on the "
            "meta device and pass it to tierwise.integrations.hf.TierwiseTrainer with the path"
        )
    given = config_dict(tierwise_config)
    # transformers ≥ 5.24 names it activation_checkpointing, gradient_checkpointing mirrors it
    if args is not None and (
        getattr(args, "activation_checkpointing", False) or args.gradient_checkpointing
    ):
        if given.get("activation_checkpointing") is False:
            raise TierwiseTrainerError(
                f"{name}: gradient_checkpointing=True but tierwise_config sets "
                "activation_checkpointing=False; make them agree"
            )
        given["activation_checkpointing"] = True
        # tierwise recomputes the blocks; Trainer must not switch on Hugging Face's too
        args.gradient_checkpointing = False
        if hasattr(args, "activation_checkpointing"):
            args.activation_checkpointing = False
    trainer._composed_options = (given, save_dtype)


class TierwiseSFTTrainer(SFTTrainer, TierwiseTrainer):
    """TRL's ``SFTTrainer`` through tierwise: SFTTrainer's arguments plus ``tierwise_config`` and
    ``save_dtype`` as for ``TierwiseTrainer`` ([Note: TRL's trainers through tierwise])."""

    def __init__(
        self,
        model: Any,
        args: Any = None,
        *trl_args: Any,
        tierwise_config: Config | dict | str | os.PathLike | None = None,
        save_dtype: str = "fp32",
        **trl_kwargs: Any,
    ):
        _compose(self, type(self).__name__, model, args, tierwise_config, save_dtype)
        super().__init__(model, args, *trl_args, **trl_kwargs)


class TierwiseDPOTrainer(DPOTrainer, TierwiseTrainer):
    """TRL's ``DPOTrainer`` through tierwise: DPOTrainer's arguments plus ``tierwise_config`` and
    ``save_dtype``. The reference is the model with its adapters disabled (PEFT) or precomputed
    log-probabilities (``precompute_ref_log_probs=True``), never a second model ([Note: TRL's
    trainers through tierwise])."""

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        *trl_args: Any,
        tierwise_config: Config | dict | str | os.PathLike | None = None,
        save_dtype: str = "fp32",
        **trl_kwargs: Any,
    ):
        name = type(self).__name__
        if ref_model is not None:
            raise TierwiseTrainerError(
                f"{name}: a separate ref_model is a second full copy of the model; leave it out "
                "and train a PEFT adapter (the reference is the model with adapters disabled) or "
                "set precompute_ref_log_probs=True"
            )
        peft = trl_kwargs.get("peft_config") is not None or hasattr(model, "peft_config")
        if not peft and not (args is not None and args.precompute_ref_log_probs):
            raise TierwiseTrainerError(
                f"{name}: without PEFT, DPO's reference would be a second full copy of the model; "
                "pass peft_config (the reference is the model with adapters disabled) or set "
                "precompute_ref_log_probs=True in DPOConfig"
            )
        _compose(self, name, model, args, tierwise_config, save_dtype)
        super().__init__(model, None, args, *trl_args, **trl_kwargs)

    def _model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """DPO calls the model with the collated chosen and rejected rows less the keys only its
        loss reads, and labels of the completion tokens (``DPOTrainer._compute_loss``)."""
        inputs = {k: v for k, v in batch.items() if k not in _DPO_LOSS_KEYS}
        inputs["labels"] = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        return inputs
