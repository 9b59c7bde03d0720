"""Everything a `tierwise train` run does before its first step: read the data, build the model
(a preset, a config file or a checkpoint; LoRA adapters), size the device budget, say what it is
running, and set the model and its optimizer up under tierwise. Every input is checked here,
before the run directory is written."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tierwise
from tierwise import model_presets
from tierwise.config import Config, config_flags, name_flags
from tierwise.plan import PlanError
from tierwise.planning import totals
from tierwise.plugins import get_plugin_host
from tierwise.tiers import TierBudgetError
from tierwise.tiers.ledger import keep_large_blocks_off_the_heap, process_memory
from tierwise.train import blocks, lora, presets, token_cache
from tierwise.train.data import read_documents
from tierwise.train.distributed import World
from tierwise.train.errors import TrainError
from tierwise.train.options import TrainOptions
from tierwise.train.plot import load_pyplot
from tierwise.train.report import Console
from tierwise.train.request import Request
from tierwise.train.schedule import warmup_cosine
from tierwise.train.summary import FixedMemory, ledger_host_bytes
from tierwise.train.tokenizers import Tokenizer, load_tokenizer
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
    tokenizer: Tokenizer
    """What encodes the data and decodes the sample."""
    corpus: blocks.Corpus
    """Training and held-out rows."""
    config: Config
    """The engine's Config as the run uses it (this rank's device, the device budget)."""
    model_name: str
    """How the summary names the model."""
    n_params: int
    """Parameters of the model (LoRA adapters included)."""
    n_trainable: int
    """Parameters that train (all of them, or the LoRA adapters)."""
    fixed_memory: FixedMemory | None = None
    """The process's RAM besides the ledger ([Note: the process RAM a run predicts])."""


def prepare_run(request: Request, world: World, console: Console) -> PreparedRun:
    """Read, build and set up what ``request`` asks for on this rank; nothing is written."""
    options = request.options
    keep_large_blocks_off_the_heap()  # [Note: large blocks off the heap]: RSS within budgets
    _quiet_transformers()
    tokenizer = load_tokenizer(_tokenizer_dir(options))
    model, model_name = _build_model(options, tokenizer)
    weights = options.from_pretrained  # [Note: loading pretrained weights]
    if options.lora:
        model, model_name, weights = _with_lora(model, model_name, weights, request)
    pack, pack_note = _packing(options, model)
    cache, cache_note = _token_cache(options, tokenizer, world)
    corpus = blocks.Corpus(
        cache,
        seq=options.seq,
        pack=pack,
        pad_id=tokenizer.pad_id,
        min_train_blocks=options.batch * world.size,
        max_eval_blocks=options.eval_batches * options.batch * world.size,
    )
    n_params = presets.count_parameters(model)
    n_trainable = presets.count_parameters(model, trainable_only=True)
    config, budget_note = _run_config(request, world, n_params, n_trainable)
    _note_model(console, model_name, n_params, n_trainable, config)
    _note_data(console, options, corpus, tokenizer, f"{pack_note}; {cache_note}")
    _note_device(console, world, config, budget_note)
    console.note("plugins: " + _plugin_line())
    load_pyplot()  # an import the summary counts as such, not as training memory
    before = process_memory()["rss"]
    model, optimizer = _set_up(model, options, config, corpus, weights)
    fixed = _fixed_memory(before, tierwise.engine_of(model))
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
        n_trainable=n_trainable,
        fixed_memory=fixed,
    )


def _fixed_memory(before: int | None, engine) -> FixedMemory | None:
    """[Note: the process RAM a run predicts] from the RSS before setup and now."""
    now = process_memory()
    if before is None or now["rss"] is None:
        return None
    held = ledger_host_bytes(engine.stats()["memory"], held=True)
    return FixedMemory(
        before_setup=before,
        setup_retained=max(0, now["rss"] - before - held),
        peak_through_setup=now["peak"],
    )


def model_data_bytes(
    n_params: int, precision: str, optimizer_states: str = "fp32", *, n_trainable: int | None = None
) -> int:
    """Model data before chunk padding, as ``planning.totals.model_data_bytes`` counts it
    (bf16/fp16 gradients in the parameter payload: [Note: gradients in the parameter
    payload]); frozen params (a LoRA base) in the compute precision alone."""
    trainable = n_params if n_trainable is None else n_trainable
    return totals.model_data_bytes(n_params, trainable, precision, optimizer_states)[-1][1]


def packs_apart(model: torch.nn.Module) -> bool:
    """Whether ``model`` keeps packed documents apart given per-document position ids: its
    Hugging Face modeling code builds the attention mask with ``transformers.masking_utils``
    and hands it the position ids, which then separate the documents ([Note: packed documents
    kept apart]). OPT, for one, builds its mask without them."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _mask_builder_reads_positions(type(base).__module__)


MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")


@functools.cache
def _mask_builder_reads_positions(module_name: str) -> bool:
    """Whether the module calls a masking_utils mask builder, always with ``position_ids=``."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    except (KeyError, OSError, TypeError, SyntaxError):
        return False
    builders = set(MASK_BUILDERS)  # and names bound to one (mixtral picks one of the two)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(n, ast.Name) and n.id in MASK_BUILDERS for n in ast.walk(node.value)
        ):
            builders |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) in builders
    ]
    return bool(calls) and all(
        any(k.arg == "position_ids" for k in call.keywords) for call in calls
    )


def _packing(options: TrainOptions, model: torch.nn.Module) -> tuple[bool, str]:
    """Whether rows pack several documents, and the note that says how."""
    if options.pack is False:
        return False, "one document per row (--no-pack)"
    if packs_apart(model):
        return True, "documents packed into rows, each attending only to itself"
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if options.pack:
        raise TrainError(
            f"--pack: the {kind} model builds its attention mask without reading position ids, "
            "so packed documents would attend to each other; leave --pack out (one document "
            "per row)"
        )
    return False, f"one document per row ({kind} cannot keep packed documents apart)"


def _token_cache(
    options: TrainOptions, tokenizer: Tokenizer, world: World
) -> tuple[token_cache.TokenCache, str]:
    """The data's token cache, built by rank 0 while the others wait ([Note: the token
    cache]); and the note that says where it is."""
    root = Path(options.token_cache) if options.token_cache else token_cache.default_cache_root()

    def open_or_build():
        return token_cache.open_or_build(
            options.data,
            tokenizer,
            train_on_prompt=options.train_on_prompt,
            root=root,
            documents=read_documents(options.data),
        )

    started = time.perf_counter()
    if world.size == 1:
        cache, reused = open_or_build()
    else:
        failure = None
        if world.is_main:
            try:
                cache, reused = open_or_build()
            except Exception as err:  # the others raise it too, instead of waiting
                failure = str(err)
                world.collectives.broadcast_object(failure)
                raise
        failure = world.collectives.broadcast_object(failure)
        if failure is not None:
            raise TrainError(failure)
        if not world.is_main:  # rank 0's cache, or this machine's own when it has none
            cache, reused = open_or_build()
    if reused:
        return cache, f"token cache {cache.path} (reused)"
    took = time.perf_counter() - started
    return cache, f"tokenised into {cache.path} in {took:.1f} s (reused by later runs)"


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
        _check_family(options.model, model.config, f"--from-pretrained {options.from_pretrained}")
        return model, f"{options.from_pretrained} ({model.config.model_type})"
    if options.model_config:
        config = model_presets.config_from_file(options.model_config)
        presets.check_vocab(config, tokenizer, f"--model-config {options.model_config}")
        _check_family(options.model, config, f"--model-config {options.model_config}")
        name = f"{options.model_config} ({config.model_type}, random init)"
    else:
        config = model_presets.preset_config(
            options.model,
            options.size,
            vocab_size=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            max_positions=max(options.seq, 256),
        )
        name = preset_name(options.model, options.size)
    return presets.build_random(config), name


def _check_family(family: str | None, config, where: str) -> None:
    """--model beside a checkpoint or config file must name its model type."""
    if family is not None and family != config.model_type:
        raise TrainError(
            f"--model {family}, but {where} is a {config.model_type} model: leave --model out "
            "(the checkpoint names the model)"
        )


def preset_name(family: str, size: str) -> str:
    """How the header names a preset: a published model's shape by its name; tierwise's own
    shapes (the default 0.86M "small" is not GPT-2 small) as such."""
    if size in model_presets.FAMILY_SIZES.get(family, {}):
        return f"{family} {size} (published shape, random init)"
    return f"{family}-architecture model of tierwise's own '{size}' shape (random init)"


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
    # the base is on the meta device (setup fills it from the checkpoint or initialises it),
    # the adapters take PEFT's init (B zero) here
    lora.materialise_adapters(model, seed=options.seed)
    if weights:
        weights = DirectoryWeights(weights, rename=lora.base_name, keep_initialised=True)
    return model, model_name, weights


def demo_budget(options: TrainOptions, device: str) -> bool:
    """Whether the run gets the demo's device budget (half the model data, so that host offload
    is exercised): a random-init model on the CPU. Fine-tunes, and every run on a GPU, get the
    whole device."""
    return torch.device(device).type == "cpu" and options.from_pretrained is None


def _run_config(
    request: Request, world: World, n_params: int, n_trainable: int
) -> tuple[Config, str]:
    """The Config on this rank's device, with the default device budget when none was given
    (and the note that says so)."""
    config = request.config.replace(device=world.device)
    if request.device_memory_given or not demo_budget(request.options, world.device):
        return config, ""
    data_bytes = model_data_bytes(
        n_params, config.precision, config.optimizer_states, n_trainable=n_trainable
    )
    return config.replace(device_memory=data_bytes // 2), (
        " (default: half the model data for a random-init model on the CPU, so the model does "
        "not fit and host offload is exercised; --device-memory all uses the whole device)"
    )


def _note_model(
    console: Console, model_name: str, n_params: int, n_trainable: int, config: Config
) -> None:
    precision, states = config.precision, config.optimizer_states
    data_bytes = model_data_bytes(n_params, precision, states, n_trainable=n_trainable)
    if n_trainable == n_params:
        what = (
            f"{precision} params (gradients reuse them), fp32 master weights, {states} Adam states"
        )
    else:
        frozen = model_data_bytes(n_params - n_trainable, precision, states, n_trainable=0)
        what = (
            f"frozen {n_params - n_trainable:,} in {precision} ≈ {format_bytes(frozen)}; "
            f"trainable {n_trainable:,} ≈ {format_bytes(data_bytes - frozen)}: {precision} "
            f"params (gradients reuse them), fp32 master weights, {states} Adam states"
        )
    console.note(
        f"model: {model_name}, {n_params:,} parameters, model data ≈ {format_bytes(data_bytes)} "
        f"({what})",
        parameters=n_params,
        trainable_parameters=n_trainable,
        model_data_bytes=data_bytes,
    )


def _note_data(
    console: Console, options: TrainOptions, corpus: blocks.Corpus, tokenizer, how: str
) -> None:
    console.note(
        f"data: {_data_name(options)}: {corpus.n_documents:,} documents, {corpus.n_tokens:,} "
        f"tokens ({tokenizer.name} tokenizer, vocabulary {tokenizer.vocab_size:,}); "
        f"{corpus.n_train:,} training rows of {options.seq}, {corpus.n_eval} held out; {how}",
    )


def _note_device(console: Console, world: World, config: Config, budget_note: str) -> None:
    budget_text = (
        "all it has" if config.device_memory is None else format_bytes(config.device_memory)
    )
    console.note(
        f"device: {world.device}, model data budget {budget_text}{budget_note}; host budget "
        f"{'all it has' if config.host_memory is None else format_bytes(config.host_memory)}"
        # [Note: a rank's host share]: the node's budget, each rank runs with its share
        + (f" (the node's, shared by its ranks); {world.size} ranks" if world.size > 1 else ""),
        device_memory=config.device_memory,
        host_memory=config.host_memory,
    )


def _set_up(model, options: TrainOptions, config: Config, corpus: blocks.Corpus, weights):
    """``tierwise.setup`` with AdamW; a plan that does not fit or unreadable weights become a
    TrainError."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay
    )
    # one batch as the loop passes it: a profiler plugin sizes activations from its shape
    example_batch = corpus.train_batch(np.arange(options.batch))
    presets.seed_init(options.seed)  # random init: setup initialises the meta-built model
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


__all__ = [
    "PLUGIN_ROLES",
    "PreparedRun",
    "demo_budget",
    "model_data_bytes",
    "packs_apart",
    "prepare_run",
]
