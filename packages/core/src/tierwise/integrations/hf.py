"""``TierwiseTrainer``: ``transformers.Trainer`` with the model's data in tierwise chunks.

Everything is the Trainer users know; tierwise takes over what it must own:

- ``model`` may be the path of a Hugging Face checkpoint: the model is built on the meta device
  and its weights read straight into chunks (``tierwise.from_pretrained``'s path; host memory
  holds one tensor at a time, never the model). ``model_init`` is called once, in ``__init__``.
- ``tierwise.setup`` runs in ``__init__`` with an AdamW over Trainer's own decay / no-decay groups
  (``learning_rate``, ``weight_decay``, ``adam_*``); the LR scheduler and warmup are Trainer's.
- Precision comes from ``bf16`` / ``fp16`` (neither: fp32); accelerate does no mixed precision of
  its own (tierwise keeps low-precision parameters and fp32 masters, and scales fp16 losses).
- ``max_grad_norm`` clips with ``tierwise.clip_grad_norm_``; ``grad_norm`` is logged as usual.
- Gradient accumulation communicates on the last micro-batch only (``tierwise.no_sync``).
- The model is never wrapped (no DDP: tierwise shards and reduces) nor moved with ``model.to``.
- Checkpoints (``save_strategy``) hold the usual files plus ``tierwise/`` (every rank's chunks,
  masters and Adam states); ``resume_from_checkpoint`` restores from it bitwise.
- ``save_model`` writes a ``from_pretrained`` folder (safetensors shards ≤ 5 GB streamed one chunk
  at a time, never the whole model in host memory; the dtype written recorded in config.json, the
  tokenizer); under data/expert/tensor parallelism every rank gathers and rank 0 writes. A PEFT
  model writes its adapter files.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from tierwise import api
from tierwise.checkpoint.directory import load_checkpoint, save_checkpoint
from tierwise.checkpoint.full_state import full_state
from tierwise.config import Config, ConfigError
from tierwise.integrations.hf_save import DTYPES, MAX_SHARD_SIZE, save_pretrained
from tierwise.integrations.trainer_batch import first_train_batch, rng_states, set_rng_states
from tierwise.pretrained import build_on_meta
from tierwise.registry import engine_of

try:
    import transformers
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - the hf extra is missing
    raise ImportError(
        "tierwise.integrations.hf needs transformers: pip install 'tierwise[hf]'"
    ) from err

_TRAINER_HOOKS = (
    "_build_accelerator_args",
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
)
"""Trainer methods TierwiseTrainer overrides; an older Trainer without them would clip and step
around tierwise (transformers 5 has them all)."""
_missing = [name for name in _TRAINER_HOOKS if not hasattr(Trainer, name)]
if _missing:  # pragma: no cover - depends on the installed transformers
    raise ImportError(
        f"tierwise.integrations.hf needs a transformers.Trainer with {', '.join(_missing)} "
        f"(transformers {transformers.__version__} has not): pip install 'transformers>=5'"
    )

SUPPORTED_OPTIMS = ("adamw_torch", "adamw_torch_fused")
"""TrainingArguments.optim values TierwiseTrainer honours (tierwise runs its own chunked AdamW)."""
TIERWISE_CHECKPOINT = "tierwise"
"""Sub-folder of a Trainer checkpoint holding tierwise's per-rank checkpoint."""
_UNSUPPORTED_ARGS = {
    "deepspeed": "tierwise replaces DeepSpeed",
    "fsdp": "tierwise shards the model itself",
    "fp16_full_eval": "it casts the model behind tierwise's back; tierwise evaluates in its precision",
    "bf16_full_eval": "it casts the model behind tierwise's back; tierwise evaluates in its precision",
    "torch_compile": "tierwise's access hooks need eager modules",
}


class TierwiseTrainerError(ValueError):
    """TrainingArguments or tierwise_config that TierwiseTrainer cannot honour (one line)."""


def precision_of(args: Any, config: dict[str, Any]) -> str:
    """tierwise precision from ``bf16``/``fp16`` (neither: fp32), checked against the config's."""
    if args.bf16 and args.fp16:
        raise TierwiseTrainerError(
            "TierwiseTrainer: TrainingArguments sets both bf16 and fp16; choose one (or neither "
            "for fp32)"
        )
    wanted = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    given = config.get("precision")
    if given is not None and given != wanted:
        flag = {"bf16": "bf16=True", "fp16": "fp16=True", "fp32": "neither bf16 nor fp16"}[wanted]
        raise TierwiseTrainerError(
            f"TierwiseTrainer: TrainingArguments ask for {wanted} ({flag}) but tierwise_config "
            f"sets precision={given!r}; make them agree, or leave precision out of "
            "tierwise_config (TrainingArguments then decide)"
        )
    return wanted


def check_args(args: Any) -> None:
    """Reject TrainingArguments TierwiseTrainer cannot honour, one line each."""
    optim = getattr(args.optim, "value", args.optim)
    if optim not in SUPPORTED_OPTIMS:
        raise TierwiseTrainerError(
            f"TierwiseTrainer: optim={optim!r} is not supported; tierwise updates the chunks with "
            f"its own AdamW: use optim={SUPPORTED_OPTIMS[0]!r} or {SUPPORTED_OPTIMS[1]!r}"
        )
    for name, why in _UNSUPPORTED_ARGS.items():
        if getattr(args, name, None):
            raise TierwiseTrainerError(
                f"TierwiseTrainer: TrainingArguments.{name} is set, which TierwiseTrainer does not "
                f"support ({why}); leave it unset"
            )
    if args.n_gpu > 1:
        raise TierwiseTrainerError(
            f"TierwiseTrainer: this process sees {args.n_gpu} GPUs (torch.nn.DataParallel); run "
            "one process per GPU with torchrun instead"
        )


def config_dict(tierwise_config: Config | dict | str | os.PathLike | None) -> dict[str, Any]:
    """``tierwise_config`` as the dict of fields it gives (a Config gives all of them, a file
    those it names)."""
    if tierwise_config is None:
        return {}
    if isinstance(tierwise_config, Config):
        return tierwise_config.to_dict()
    if isinstance(tierwise_config, dict):
        return dict(tierwise_config)
    Config.from_any(tierwise_config)  # a missing or invalid file: the Config's own error
    return _file_fields(tierwise_config)


def _file_fields(path: str | os.PathLike) -> dict[str, Any]:
    """The fields a .toml/.json file sets itself (so a default precision is not 'given')."""
    file = Path(path)
    if file.suffix == ".json":
        data = json.loads(file.read_text())
    else:
        import tomllib

        data = tomllib.loads(file.read_text())
        data = data.get("tierwise", data)
    return dict(data)


class TierwiseTrainer(Trainer):
    """A ``transformers.Trainer`` whose model lives in tierwise chunks across device, host and
    NVMe. Takes Trainer's arguments plus ``tierwise_config`` (a ``tierwise.Config``, a dict or a
    .toml/.json path; precision and device follow TrainingArguments unless it sets them) and
    ``save_dtype`` ("fp32" masters, or "bf16") for ``save_model``."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        *trainer_args: Any,
        tierwise_config: Config | dict | str | os.PathLike | None = None,
        save_dtype: str = "fp32",
        **trainer_kwargs: Any,
    ):
        if trainer_args:
            raise TypeError("TierwiseTrainer: pass Trainer's arguments after `args` by keyword")
        _check_class_order(type(self))
        composed = self.__dict__.pop("_composed_options", None)  # [Note: TRL's trainers
        if composed is not None:  # through tierwise] (integrations/trl.py)
            tierwise_config, save_dtype = composed
        model_init = trainer_kwargs.pop("model_init", None)
        if (model is None) == (model_init is None):
            raise TierwiseTrainerError(
                "TierwiseTrainer needs `model` (a module, or the path of a Hugging Face "
                "checkpoint) or `model_init` (called once, here: tierwise sets the model up once)"
            )
        weights = None
        if isinstance(model, (str, os.PathLike)):  # [Note: loading pretrained weights]
            weights = model
            model = build_on_meta(model).train()
        elif model is None:
            model = model_init()
        if trainer_kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise TierwiseTrainerError(
                "TierwiseTrainer: optimizer_cls_and_kwargs is not supported; tierwise runs its own "
                "AdamW (set learning_rate, weight_decay, adam_* in TrainingArguments)"
            )
        if save_dtype not in DTYPES:
            raise TierwiseTrainerError(
                f"TierwiseTrainer: save_dtype={save_dtype!r}; choose one of {', '.join(DTYPES)}"
            )
        if args is None:
            args = transformers.TrainingArguments(output_dir="tmp_trainer")
        check_args(args)
        given = config_dict(tierwise_config)
        try:
            config = Config.from_any(
                given,
                precision=precision_of(args, given),
                device=given.get("device") or str(args.device),  # args.device sets up torchrun
                # in-backward updates run in the last micro-batch: [Note: speculative updates]
                accumulation_steps=given.get("accumulation_steps")
                or args.gradient_accumulation_steps,
                # checkpoints and save_model stream the model out through the save buffers
                # (a PEFT model's adapters do not): checked at setup unless told otherwise
                saves_weights=given.get("saves_weights", not _is_peft(model)),
            )
        except ConfigError as err:
            raise TierwiseTrainerError(f"TierwiseTrainer: tierwise_config: {err}") from None
        optimizer, scheduler = trainer_kwargs.pop("optimizers", (None, None))
        if optimizer is None:
            optimizer = self._adamw(model, args)
        # accelerate registers the model as prepared: it neither wraps it (DDP), nor moves it,
        # nor patches its forward with autocast ([Note: accelerate and a managed model])
        model._is_accelerate_prepared = True
        self.save_dtype = save_dtype
        caller_rng = rng_states()  # [Note: the Trainer's example batch]
        super().__init__(
            model=model, args=args, optimizers=(optimizer, scheduler), **trainer_kwargs
        )
        trainer_rng = rng_states()
        batch = first_train_batch(self)
        example_batch = None if batch is None else self._model_inputs(batch)
        set_rng_states(caller_rng)
        try:
            model, optimizer = api.setup(
                model, optimizer, config, weights=weights, example_batch=example_batch
            )
        finally:
            set_rng_states(trainer_rng)
        self.optimizer = self.callback_handler.optimizer = optimizer
        self.accelerator.no_sync = self._no_sync

    def _model_inputs(self, batch: Any) -> Any:
        """What the model is called with for a collated ``batch`` (``compute_loss``: all of it)."""
        return batch

    # [Note: accelerate and a managed model]
    # Trainer reaches the model through accelerate: ``prepare`` (DDP wrapping, ``.to(device)``,
    # autocast), ``no_sync`` (DDP's), ``clip_grad_norm_`` (over ``param.grad``, which tierwise
    # keeps None) and AcceleratedOptimizer (which moves optimizer state to the device). The model
    # is marked prepared, the accelerator is built without mixed precision and device placement,
    # ``no_sync`` is tierwise's, clipping is tierwise's (``_clip_grad_norm``), and
    # ``_move_model_to_device`` does nothing: the model's data stays where the plan put it.

    def _adamw(self, model: torch.nn.Module, args: Any) -> torch.optim.AdamW:
        """Trainer's own AdamW (decay / no-decay groups, lr, betas, eps) for tierwise to take."""
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        kwargs.pop("fused", None)  # tierwise's chunked update is the fused kernel
        return torch.optim.AdamW([g for g in groups if g["params"]], **kwargs)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # tierwise owns precision and fp16 loss scaling
        args["device_placement"] = False
        return args

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """Never: the plan decides where the model's data lives."""

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader=None):
        return model  # no DataParallel / DDP: tierwise reduces gradients itself

    @contextlib.contextmanager
    def _no_sync(self, model: torch.nn.Module | None = None):
        with api.no_sync(self.model):
            yield

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return api.clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm=None):
        if grad_norm is None:  # max_grad_norm = 0: the norm only (a factor of 1.0 is exact)
            grad_norm = api.clip_grad_norm_(self.model, float("inf"))
        return grad_norm

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        engine = engine_of(self.model)
        if (
            engine.scaler is not None
            and not isinstance(scheduler, _SkipsOverflowSteps)
            and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        ):
            self.lr_scheduler = _SkipsOverflowSteps(scheduler, engine.scaler)
        return self.lr_scheduler

    # -- checkpoints ------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(Path(output_dir) / TIERWISE_CHECKPOINT, self.model)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / "scheduler.pt")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = Path(checkpoint) / TIERWISE_CHECKPOINT
        if not folder.is_dir():
            raise TierwiseTrainerError(
                f"TierwiseTrainer: checkpoint {checkpoint} has no {TIERWISE_CHECKPOINT}/ folder "
                "(not written by TierwiseTrainer, or saved with save_only_model=True); resume from "
                "a TierwiseTrainer checkpoint"
            )
        load_checkpoint(folder, self.model)
        scheduler_file = Path(checkpoint) / "scheduler.pt"
        if scheduler_file.is_file():
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's fp32 masters, from its tierwise folder
        (PEFT's load_adapter would replace the adapters' parameters behind tierwise's back)."""
        folder = Path(self.state.best_model_checkpoint) / TIERWISE_CHECKPOINT
        if folder.is_dir():
            load_checkpoint(folder, self.model)
        else:
            super()._load_best_model()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if (Path(resume_from_checkpoint) / TIERWISE_CHECKPOINT).is_dir():
            return  # the tierwise checkpoint holds the fp32 masters: loaded with the optimizer
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Every rank gathers the whole model (a collective); the main process writes it."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if state_dict is None and not _is_peft(self.model):  # [Note: streaming a model out]
            save_pretrained(
                self.model,
                output_dir,
                dtype=DTYPES[self.save_dtype],
                max_shard_size=MAX_SHARD_SIZE,
                is_main_process=self.args.should_save,
            )
            if self.args.should_save:
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
            return
        if state_dict is None:  # a PEFT model: adapters only, never the whole base
            engine = engine_of(self.model)
            state_dict = full_state(engine, engine.patterns, trainable_only=True)
        elif state_dict is None:
            state_dict = self.model.state_dict()
        dtype = DTYPES[self.save_dtype]
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        if _is_peft(self.model):
            self.model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=True)
        else:
            self.model.save_pretrained(
                output_dir,
                state_dict=state_dict,
                max_shard_size=MAX_SHARD_SIZE,
                is_main_process=True,
            )
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


def _check_class_order(cls: type) -> None:
    """A trainer class deriving from ``TierwiseTrainer`` ahead of a TRL trainer would set the
    model up before TRL prepares it (PEFT, reference adapters): refused, naming the class to use
    ([Note: TRL's trainers through tierwise])."""
    mro = cls.__mro__
    after = mro[mro.index(TierwiseTrainer) + 1 :]
    trl_trainer = next((c for c in after if c.__module__.split(".")[0] == "trl"), None)
    if trl_trainer is not None:
        name = trl_trainer.__name__
        raise TierwiseTrainerError(
            f"{cls.__name__} puts TierwiseTrainer before TRL's {name}, which would prepare the "
            f"model after tierwise set it up; use tierwise.integrations.trl.Tierwise{name} "
            f"(or class {cls.__name__}({name}, TierwiseTrainer))"
        )


def _is_peft(model: torch.nn.Module) -> bool:
    """A PEFT model (saves adapter files); checked without importing peft."""
    return any(cls.__module__.startswith("peft") for cls in type(model).__mro__)


class _SkipsOverflowSteps:
    """fp16: the LR schedule advances only on steps the optimizer took, as Trainer does with
    GradScaler. tierwise's own loss scaler skips overflowing steps where accelerate cannot see
    them (``optimizer_step_was_skipped``), so the scheduler checks the scaler's count instead.
    Everything else is the wrapped scheduler's."""

    def __init__(self, scheduler, scaler):
        self.scheduler = scheduler
        self.scaler = scaler
        self.skipped_seen = scaler.skipped_steps

    def step(self, *args, **kwargs):
        if self.scaler.skipped_steps != self.skipped_seen:  # this step was skipped
            self.skipped_seen = self.scaler.skipped_steps
            return None
        return self.scheduler.step(*args, **kwargs)

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        self.skipped_seen = self.scaler.skipped_steps  # resumed: the scaler's count was loaded

    def __getattr__(self, name):
        return getattr(self.scheduler, name)
