"""Everything a `tierwise train` run does before its first step: read the data, build the model
(a preset, a config file or a checkpoint; LoRA adapters), size the device budget, say what it is
running, and set the model and its optimizer up under tierwise. Every input is checked here,
before the run directory is written."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import tierwise
from tierwise import model_presets
from tierwise.config import Config, config_flags, name_flags
from tierwise.plan import PlanError
from tierwise.plugins import get_plugin_host
from tierwise.precision import optim_bytes, param_bytes
from tierwise.tiers import TierBudgetError
from tierwise.train import data, lora, presets
from tierwise.train.distributed import World
from tierwise.train.errors import TrainError
from tierwise.train.options import TrainOptions
from tierwise.train.report import Console
from tierwise.train.request import Request
from tierwise.train.schedule import warmup_cosine
from tierwise.units import format_bytes
from tierwise.weights import DirectoryWeights, WeightsError

PLUGIN_ROLES = {
    "profiler": "pre-runtime profile (without it: core's warm-up trace of the first step)",
    "search": "plan search (without it: core's default planner)",
    "nvme": "NVMe tier (without it: device and host only)",
    "moe": "expert- and tensor-parallel patterns",
}


@dataclass(frozen=True, kw_only=True)
class PreparedRun:
    """A model set up under tierwise with what trains it, before the first step."""

    model: torch.nn.Module
    """The model, its parameters views of tierwise's chunks."""
    optimizer: Any
    """The optimizer ``tierwise.setup`` returned."""
    scheduler: Any
    """The learning-rate schedule (warmup, then cosine decay to the floor)."""
    engine: Any
    """``tierwise.engine_of(model)``."""
    tokenizer: data.Tokenizer
    """What encodes the data and decodes the sample."""
    corpus: data.Corpus
    """Training and held-out blocks."""
    config: Config
    """The engine's Config as the run uses it (this rank's device, the device budget)."""
    model_name: str
    """How the summary names the model."""
    n_params: int
    """Parameters of the model (LoRA adapters included)."""


def prepare_run(request: Request, world: World, console: Console) -> PreparedRun:
    """Read, build and set up what ``request`` asks for on this rank; nothing is written."""
    options = request.options
    _quiet_transformers()
    tokenizer = data.load_tokenizer(_tokenizer_dir(options))
    corpus = data.build_corpus(
        data.read_documents(options.data),
        tokenizer,
        seq=options.seq,
        min_train_blocks=options.batch * world.size,
        max_eval_blocks=options.eval_batches * options.batch * world.size,
    )
    model, model_name = _build_model(options, tokenizer)
    weights = options.from_pretrained  # [Note: loading pretrained weights]
    if options.lora:
        model, model_name, weights = _with_lora(model, model_name, weights, request)
    n_params = presets.count_parameters(model)
    config, budget_note = _run_config(request, world, n_params)
    _note_model(console, model_name, n_params, config)
    _note_data(console, options, corpus, tokenizer)
    _note_device(console, world, config, budget_note)
    console.note("plugins: " + _plugin_line())
    model, optimizer = _set_up(model, options, config, corpus, weights)
    scheduler = warmup_cosine(
        optimizer, warmup=options.warmup_steps, total=options.steps, floor=options.lr_floor
    )
    return PreparedRun(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        engine=tierwise.engine_of(model),
        tokenizer=tokenizer,
        corpus=corpus,
        config=config,
        model_name=model_name,
        n_params=n_params,
    )


def model_data_bytes(n_params: int, precision: str, optimizer_states: str = "fp32") -> int:
    """Model data before chunk padding, counted as core's planner counts it: params and grads in
    the compute precision, fp32 master weights and two Adam states (``optimizer_states``)."""
    return int(n_params * (2 * param_bytes(precision) + optim_bytes(optimizer_states)))


def _tokenizer_dir(options: TrainOptions) -> str | None:
    """--tokenizer, else the checkpoint's own tokenizer when --from-pretrained has one."""
    if (
        options.tokenizer is None
        and options.from_pretrained
        and _has_tokenizer(options.from_pretrained)
    ):
        return options.from_pretrained
    return options.tokenizer


def _build_model(options: TrainOptions, tokenizer) -> tuple[torch.nn.Module, str]:
    if options.from_pretrained:
        model = presets.pretrained_on_meta(options.from_pretrained)
        presets.check_vocab(model.config, tokenizer, f"--from-pretrained {options.from_pretrained}")
        return model, f"{options.from_pretrained} ({model.config.model_type})"
    if options.model_config:
        config = model_presets.config_from_file(options.model_config)
        presets.check_vocab(config, tokenizer, f"--model-config {options.model_config}")
        name = f"{options.model_config} ({config.model_type}, random init)"
    else:
        config = model_presets.preset_config(
            options.model,
            options.size,
            vocab_size=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            max_positions=max(options.seq, 256),
        )
        name = f"{options.model} {options.size} (random init)"
    return presets.build_random(config, seed=options.seed), name


def _with_lora(model: torch.nn.Module, model_name: str, weights: Any, request: Request):
    """The model with LoRA adapters, its name saying so, and where its weights come from."""
    options = request.options
    model = lora.apply_lora(
        model, rank=options.lora, alpha=options.lora_alpha, targets=options.lora_targets
    )
    held = request.config.precision
    model_name += f", LoRA rank {options.lora} (base frozen, held in {held}" + (
        "; --precision fp32 holds it in fp32)" if held != "fp32" else ")"
    )
    if weights:  # the base comes from the checkpoint, the adapters from PEFT's init
        lora.materialise_adapters(model, seed=options.seed)
        weights = DirectoryWeights(weights, rename=lora.base_name, keep_initialised=True)
    return model, model_name, weights


def _run_config(request: Request, world: World, n_params: int) -> tuple[Config, str]:
    """The Config on this rank's device, with the default device budget when none was given
    (and the note that says so)."""
    config = request.config.replace(device=world.device)
    if request.device_memory_given:
        return config, ""
    data_bytes = model_data_bytes(n_params, config.precision, config.optimizer_states)
    return config.replace(device_memory=data_bytes // 2), (
        " (default: half the model data, so the model does not fit and host offload is "
        "exercised; --device-memory all uses the whole device)"
    )


def _note_model(console: Console, model_name: str, n_params: int, config: Config) -> None:
    data_bytes = model_data_bytes(n_params, config.precision, config.optimizer_states)
    console.note(
        f"model: {model_name}, {n_params:,} parameters, model data ≈ {format_bytes(data_bytes)} "
        f"({config.precision} params and grads, fp32 master weights, "
        f"{config.optimizer_states} Adam states)",
        parameters=n_params,
        model_data_bytes=data_bytes,
    )


def _note_data(console: Console, options: TrainOptions, corpus: data.Corpus, tokenizer) -> None:
    console.note(
        f"data: {_data_name(options)}: {corpus.n_documents:,} documents, {corpus.n_tokens:,} "
        f"tokens ({tokenizer.name} tokenizer, vocabulary {tokenizer.vocab_size:,}); "
        f"{len(corpus.train_blocks):,} training blocks of {options.seq}, "
        f"{len(corpus.eval_blocks)} held out",
    )


def _note_device(console: Console, world: World, config: Config, budget_note: str) -> None:
    budget_text = (
        "all it has" if config.device_memory is None else format_bytes(config.device_memory)
    )
    console.note(
        f"device: {world.device}, model data budget {budget_text}{budget_note}; host budget "
        f"{'all it has' if config.host_memory is None else format_bytes(config.host_memory)}"
        + (f"; {world.size} ranks" if world.size > 1 else ""),
        device_memory=config.device_memory,
        host_memory=config.host_memory,
    )


def _set_up(model, options: TrainOptions, config: Config, corpus: data.Corpus, weights):
    """``tierwise.setup`` with AdamW; a plan that does not fit or unreadable weights become a
    TrainError."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay
    )
    # one batch as the loop passes it: a profiler plugin sizes activations from its shape
    example_batch = data.batch_of(corpus.train_blocks[: options.batch], torch.device("cpu"))
    try:
        return tierwise.setup(
            model, optimizer, config, example_batch=example_batch, weights=weights
        )
    except (PlanError, TierBudgetError) as err:
        flags = config_flags(f.name for f in dataclasses.fields(Config) if "_" in f.name)
        raise TrainError(f"the plan does not fit: {name_flags(str(err), flags)}") from None
    except WeightsError as err:
        raise TrainError(f"--from-pretrained {options.from_pretrained}: {err}") from None


def _has_tokenizer(path: str) -> bool:
    return any(
        (Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    )


def _data_name(options: TrainOptions) -> str:
    if options.data:
        return ", ".join(options.data)
    return f"Python {sys.version_info.major}.{sys.version_info.minor} standard library source"


def _plugin_line() -> str:
    installed = {info.name for info in get_plugin_host().infos()}
    parts = []
    for name, role in PLUGIN_ROLES.items():
        parts.append(f"{name} {'✓' if name in installed else 'not installed'} ({role})")
    return "; ".join(parts)


def _quiet_transformers() -> None:
    with contextlib.suppress(ImportError):
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()


__all__ = ["PLUGIN_ROLES", "PreparedRun", "model_data_bytes", "prepare_run"]
