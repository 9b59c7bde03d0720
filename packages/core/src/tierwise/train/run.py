"""`tierwise train`: validate, build, plan, train in a plain PyTorch loop, report.

Nothing is written before every input has been checked and the engine has accepted the plan;
then the run directory gets options.json, config.json, plan.json, metrics.jsonl, checkpoints/
and memory.png.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import tierwise
from tierwise import model_presets
from tierwise.config import Config, ConfigError
from tierwise.model_presets import ModelError
from tierwise.plan import PlanError
from tierwise.plugins import get_plugin_host
from tierwise.precision import optim_bytes, param_bytes
from tierwise.tiers import TierBudgetError
from tierwise.train import checkpoints, data, lora, presets
from tierwise.train.distributed import (
    World,
    barrier,
    close_world,
    init_world,
    launched_by_torchrun,
    mean_over_ranks,
)
from tierwise.train.errors import RunFailed, TrainError
from tierwise.train.interrupts import Agreement, StopRequest, exit_status
from tierwise.train.metrics import MetricsLog, counter_delta, read_metrics, step_record
from tierwise.train.options import RUN_IDENTITY, TrainOptions
from tierwise.train.plot import plot_memory, plot_training
from tierwise.train.report import Console, overlap_row, summary_rows, table
from tierwise.train.sample import generate, printable
from tierwise.train.schedule import warmup_cosine
from tierwise.train.trace import StepTracer
from tierwise.units import format_bytes
from tierwise.weights import DirectoryWeights, WeightsError

OPTIONS_FILE = "options.json"
CONFIG_FILE = "config.json"
PLAN_FILE = "plan.json"
PLOT_FILE = "memory.png"
TRAINING_PLOT_FILE = "training.png"
NOT_PERSISTED = ("resume", "out", "stop_after", "json")
"""Options that belong to one invocation, not to the run."""
PLUGIN_ROLES = {
    "profiler": "pre-runtime profile (without it: core's warm-up trace of the first step)",
    "search": "plan search (without it: core's default planner)",
    "nvme": "NVMe tier (without it: device and host only)",
    "moe": "expert- and tensor-parallel patterns",
}


def main(train_given: dict[str, Any], config_given: dict[str, Any]) -> int:
    """Run `tierwise train` with the flags the user gave; return the exit code."""
    try:
        return train(train_given, config_given)
    except (TrainError, ModelError, ConfigError) as err:
        _print_error(err, every_rank=False)
        return 2
    except (RunFailed, OSError) as err:  # a disk failed under the run: one line, no traceback
        _print_error(err, every_rank=True)
        return 1
    except KeyboardInterrupt:  # outside the training loop ([Note: stopping between steps])
        print(
            "tierwise train: interrupted (outside the training steps; checkpoints written so "
            "far are kept)",
            file=sys.stderr,
        )
        return exit_status(signal.SIGINT)


def _print_error(err: BaseException, *, every_rank: bool) -> None:
    """One line on stderr.

    [Note: an error is printed once under torchrun]
    Every rank checks the same flags, files and plan, so a bad input fails on all of them with
    the same message: rank 0 alone prints it (torchrun still reports every rank's exit code). A
    failure of the run itself (a disk under the NVMe tier, a checkpoint write) belongs to the
    rank it happened on: each such rank prints it, naming itself.
    """
    rank = int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0
    if rank != 0 and not every_rank:
        return
    where = f" (rank {rank})" if rank else ""
    print(f"tierwise train: error{where}: {err}", file=sys.stderr)


# -- inputs -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Request:
    """The validated inputs of one invocation."""

    options: TrainOptions
    """What to train and how."""
    config: Config
    """The engine's Config (device budget still None when the default applies)."""
    device_memory_given: bool
    """Whether --device-memory (or a config file, or the resumed run) set the device budget."""
    run_dir: Path
    """Where outputs go (not created yet)."""
    resuming: bool
    """Continue the run in run_dir."""


def with_accumulation(config_given: dict[str, Any], options: TrainOptions) -> dict[str, Any]:
    """The config overrides, telling the engine how many backwards make a step: in-backward
    updates run in the last one ([Note: speculative updates])."""
    return {"accumulation_steps": options.grad_accum, **config_given}


def resolve(train_given: dict[str, Any], config_given: dict[str, Any]) -> Request:
    """Check every flag and file; raise TrainError/ConfigError with one line for people."""
    resume = train_given.get("resume")
    if resume is None:
        options = TrainOptions(**train_given)
        config = Config.from_any(options.config, **with_accumulation(config_given, options))
        run_dir = Path(options.out or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}")
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise TrainError(
                f"--out {run_dir} already exists and is not empty; pass --resume {run_dir} to "
                "continue that run, or choose another --out"
            )
        given_budget = "device_memory" in config_given or config.device_memory is not None
        return Request(
            options=options,
            config=config,
            device_memory_given=given_budget,
            run_dir=run_dir,
            resuming=False,
        )
    run_dir = Path(resume)
    if not (run_dir / OPTIONS_FILE).is_file():
        raise TrainError(
            f"--resume {run_dir}: not a tierwise train run directory (no {OPTIONS_FILE}); give "
            "the --out directory of an earlier run"
        )
    saved = json.loads((run_dir / OPTIONS_FILE).read_text())
    saved_config = json.loads((run_dir / CONFIG_FILE).read_text())
    for name in RUN_IDENTITY:
        if name in train_given and _plain(train_given[name]) != saved.get(name):
            if name == "steps":
                raise TrainError(
                    f"--resume {run_dir} cannot change --steps from {saved['steps']} to "
                    f"{train_given['steps']}: the learning-rate warmup and cosine decay span "
                    "--steps, so the steps already taken belong to another schedule; start a new "
                    f"run (--out) or resume with --steps {saved['steps']}"
                )
            flag = "--" + name.replace("_", "-")
            raise TrainError(
                f"--resume {run_dir} continues the run as it was started with {flag} "
                f"{saved.get(name)!r}; it cannot change it to {train_given[name]!r}: start a new "
                "run with another --out instead"
            )
    if config_given.get("precision", saved_config["precision"]) != saved_config["precision"]:
        raise TrainError(
            f"--resume {run_dir} continues a --precision {saved_config['precision']} run; start a "
            "new run with another --out to change the precision"
        )
    merged = {k: v for k, v in saved.items() if k not in NOT_PERSISTED}
    merged.update(train_given)
    merged["out"] = str(run_dir)
    options = TrainOptions(**merged)
    config = Config.from_any(saved_config, **config_given)
    return Request(
        options=options, config=config, device_memory_given=True, run_dir=run_dir, resuming=True
    )


def _plain(value: Any) -> Any:
    """A value as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def check_plugins(config: Config) -> None:
    """An NVMe placement needs the NVMe tier and an existing directory."""
    wants_nvme = config.nvme_path is not None or "nvme" in (
        config.param_placement,
        config.optimizer_placement,
        config.activation_offload,
    )
    if not wants_nvme:
        return
    if "nvme" not in get_plugin_host().tier_classes():
        raise TrainError(
            "--nvme-path needs the NVMe tier from the tierwise-nvme plugin, which is not installed "
            "(or is blocked by TIERWISE_DISABLE_PLUGINS): pip install tierwise-nvme "
            "(in this repo: pip install -e packages/offload-nvme)"
        )
    if Path(config.nvme_path).exists() and not Path(config.nvme_path).is_dir():
        raise TrainError(
            f"--nvme-path {config.nvme_path} is a file, not a directory: give a directory on a "
            "fast local disk"
        )
    if not Path(config.nvme_path).is_dir():
        raise TrainError(
            f"--nvme-path {config.nvme_path}: no such directory; create it on a fast local disk"
        )
    try:  # before the data and the model are read: a read-only mount fails in a second
        fd, probe = tempfile.mkstemp(prefix=".tierwise-write-probe-", dir=config.nvme_path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise TrainError(
            f"--nvme-path {config.nvme_path} is not writable ({err.strerror or err}): give a "
            "writable directory on a fast local disk, or remount it read-write / fix its "
            "permissions"
        ) from None


def model_data_bytes(n_params: int, precision: str, optimizer_states: str = "fp32") -> int:
    """Model data before chunk padding, counted as core's planner counts it: params and grads in
    the compute precision, fp32 master weights and two Adam states (``optimizer_states``)."""
    return int(n_params * (2 * param_bytes(precision) + optim_bytes(optimizer_states)))


# -- the run ------------------------------------------------------------------------------------
def train(train_given: dict[str, Any], config_given: dict[str, Any]) -> int:
    request = resolve(train_given, config_given)
    check_plugins(request.config)
    world = init_world(request.config.device)
    try:
        return _train(request, world)
    finally:
        close_world(world)


def _train(request: Request, world: World) -> int:
    options = request.options
    console = Console(enabled=world.is_main, json_mode=options.json)
    run_dir = _same_on_all_ranks(request.run_dir, world)
    device = torch.device(world.device)
    _quiet_transformers()

    # data and model (every input checked before anything is written)
    tokenizer_dir = options.tokenizer
    if (
        tokenizer_dir is None
        and options.from_pretrained
        and _has_tokenizer(options.from_pretrained)
    ):
        tokenizer_dir = options.from_pretrained
    tokenizer = data.load_tokenizer(tokenizer_dir)
    documents = data.read_documents(options.data)
    corpus = data.build_corpus(
        documents,
        tokenizer,
        seq=options.seq,
        min_train_blocks=options.batch * world.size,
        max_eval_blocks=options.eval_batches * options.batch * world.size,
    )
    model, model_name = _build_model(options, tokenizer)
    weights = options.from_pretrained  # [Note: loading pretrained weights]
    if options.lora:
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
    n_params = presets.count_parameters(model)
    config = request.config.replace(device=world.device)
    data_bytes = model_data_bytes(n_params, config.precision, config.optimizer_states)
    budget_note = ""
    if not request.device_memory_given:
        config = config.replace(device_memory=data_bytes // 2)
        budget_note = (
            " (default: half the model data, so the model does not fit and host offload is "
            "exercised; --device-memory all uses the whole device)"
        )
    console.note(
        f"model: {model_name}, {n_params:,} parameters, model data ≈ {format_bytes(data_bytes)} "
        f"({config.precision} params and grads, fp32 master weights, "
        f"{config.optimizer_states} Adam states)",
        parameters=n_params,
        model_data_bytes=data_bytes,
    )
    console.note(
        f"data: {_data_name(options)}: {corpus.n_documents:,} documents, {corpus.n_tokens:,} "
        f"tokens ({tokenizer.name} tokenizer, vocabulary {tokenizer.vocab_size:,}); "
        f"{len(corpus.train_blocks):,} training blocks of {options.seq}, "
        f"{len(corpus.eval_blocks)} held out",
    )
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
    console.note("plugins: " + _plugin_line())

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=options.weight_decay
    )
    # one batch as the loop passes it: a profiler plugin sizes activations from its shape
    example_batch = data.batch_of(corpus.train_blocks[: options.batch], torch.device("cpu"))
    try:
        model, optimizer = tierwise.setup(
            model, optimizer, config, example_batch=example_batch, weights=weights
        )
    except (PlanError, TierBudgetError) as err:
        raise TrainError(f"the plan does not fit: {err}") from None
    except WeightsError as err:
        raise TrainError(f"--from-pretrained {options.from_pretrained}: {err}") from None
    engine = tierwise.engine_of(model)
    scheduler = warmup_cosine(
        optimizer, warmup=options.warmup_steps, total=options.steps, floor=options.lr_floor
    )

    # from here on, the run directory is ours (once every rank has checked its inputs)
    barrier(world)
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / OPTIONS_FILE, options.to_dict())
        _write_json(run_dir / CONFIG_FILE, config.to_dict())
        engine.plan.to_json(run_dir / PLAN_FILE)
        lora.describe_model(run_dir, model, base_path=options.from_pretrained)
    console.block("plan", engine.plan.table(), plan=engine.plan.to_dict())

    step, micro_step = 0, 0
    if request.resuming:
        loaded, fallback = checkpoints.latest(run_dir, world)
        if fallback:
            console.note(fallback)
        state = checkpoints.load(loaded, model=model, optimizer=optimizer, world=world)
        scheduler.load_state_dict(state["scheduler"])
        step, micro_step = state["step"], state["micro_step"]
        console.note(f"resumed {run_dir} at step {step} from {loaded.name}", step=step)
    last_step = options.stop_after if options.stop_after is not None else options.steps
    if step >= last_step:
        console.note(f"nothing to do: the run is at step {step} of {last_step}")
        return 0

    sampler = data.BlockSampler(
        n_blocks=len(corpus.train_blocks),
        batch=options.batch,
        world=world.size,
        rank=world.rank,
        seed=options.seed,
    )
    metrics = MetricsLog(run_dir, keep_through=step) if world.is_main else None
    budgets = {"device": config.device_memory, "host": config.host_memory}
    trace_step = min(step + 2, last_step)  # after the engine's warm-up step
    first_step = step
    tokens_per_step = options.batch * options.seq * options.grad_accum * world.size
    step_seconds = []
    console.start_progress(start=step, total=last_step)
    started = time.perf_counter()
    model.train()
    agreement = Agreement(world, options.save_minutes)
    with StopRequest() as stop:
        try:
            step, micro_step, trace, stopped = _loop(
                options,
                model,
                optimizer,
                scheduler,
                engine,
                corpus,
                sampler,
                world,
                device,
                run_dir,
                metrics,
                console,
                budgets,
                agreement,
                stop,
                step=step,
                micro_step=micro_step,
                last_step=last_step,
                trace_step=trace_step,
                step_seconds=step_seconds,
                tokens_per_step=tokens_per_step,
            )
        except OSError as err:  # the NVMe tier or a checkpoint write: the run cannot go on
            console.stop_progress()
            raise RunFailed(f"{err}; {_resume_hint(run_dir)}") from None
    if stopped is not None:
        console.stop_progress()
        if metrics:
            metrics.close()
        if world.is_main:
            print(
                f"tierwise train: {signal.Signals(stopped).name} after step {step} of "
                f"{last_step}; checkpoint written; resume with: tierwise train --resume "
                f"{run_dir}",
                file=sys.stderr,
            )
        return exit_status(stopped)
    return _finish(
        options,
        model,
        engine,
        tokenizer,
        corpus,
        world,
        device,
        run_dir,
        metrics,
        console,
        budgets,
        trace,
        step,
        first_step,
        step_seconds,
        tokens_per_step,
        started,
        model_name,
        n_params,
    )


def _resume_hint(run_dir: Path) -> str:
    """What a run stopped by a failure can do next (checkpoints are swapped in atomically, so
    the newest one is whole)."""
    latest = run_dir / checkpoints.CHECKPOINTS / checkpoints.LATEST
    if latest.is_file():
        return (
            f"the checkpoint of {latest.read_text().strip()} is intact: resume with: "
            f"tierwise train --resume {run_dir}"
        )
    return "no checkpoint was written yet: start the run again"


def _loop(
    options,
    model,
    optimizer,
    scheduler,
    engine,
    corpus,
    sampler,
    world,
    device,
    run_dir,
    metrics,
    console,
    budgets,
    agreement,
    stop,
    *,
    step,
    micro_step,
    last_step,
    trace_step,
    step_seconds,
    tokens_per_step,
):
    """Steps until ``last_step`` or a stop request; returns (step, micro_step, trace, signal)."""
    tracer, trace = None, None
    while step < last_step:
        if world.is_main and step + 1 == trace_step:
            tracer = StepTracer(model, engine.stats, step=step + 1, budgets=budgets)
            tracer.mark("forward", "step starts")
        stats_before = engine.stats()
        times = {"data": 0.0, "forward": 0.0, "backward": 0.0}
        step_start = time.perf_counter()
        loss_sum = 0.0
        for _ in range(options.grad_accum):
            t0 = time.perf_counter()
            batch = data.batch_of(corpus.train_blocks[sampler.indices(micro_step)], device)
            micro_step += 1
            t1 = time.perf_counter()
            with tracer.forward() if tracer else contextlib.nullcontext():
                loss = model(**batch).loss
            t2 = time.perf_counter()
            (loss / options.grad_accum).backward()
            t3 = time.perf_counter()
            loss_sum += loss.item()
            times["data"] += t1 - t0
            times["forward"] += t2 - t1
            times["backward"] += t3 - t2
        if tracer:
            tracer.backward_finished()
        t4 = time.perf_counter()
        grad_norm = None
        if options.clip > 0:
            grad_norm = float(tierwise.clip_grad_norm_(model, options.clip))
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        times["optimizer"] = time.perf_counter() - t4
        times["total"] = time.perf_counter() - step_start
        step += 1
        if tracer:
            tracer.mark("optimizer", "optimizer step done")
        loss_value = mean_over_ranks(loss_sum / options.grad_accum, world)
        record = step_record(
            step=step,
            loss=loss_value,
            lr=lr,
            grad_norm=grad_norm,
            tokens=tokens_per_step,
            times=times,
            stats=engine.stats(),
            stats_before=stats_before,
        )
        step_seconds.append(times["total"])
        if metrics:
            metrics.write(record)
        console.progress(record, last=step == last_step)
        if tracer:
            trace, tracer = tracer.trace, None
        if step % options.eval_interval == 0 or step == last_step:
            before_eval = engine.stats()
            eval_loss = evaluate(model, corpus.eval_blocks, options.batch, world, device)
            if metrics:  # [Note: the step after an eval moves less]
                moved = counter_delta(
                    engine.stats().get("moved_bytes", {}), before_eval.get("moved_bytes", {})
                )
                metrics.write(
                    {"kind": "eval", "step": step, "eval_loss": eval_loss, "moved_bytes": moved}
                )
            console.note(
                f"step {step}: held-out loss {eval_loss:.4f}", step=step, eval_loss=eval_loss
            )
        stopped, time_due = agreement.after_step(stop)
        if step % options.checkpoint_interval == 0 or step == last_step or stopped or time_due:
            checkpoints.save(
                run_dir,
                step=step,
                model=model,
                optimizer=optimizer,
                world=world,
                loop_state={"micro_step": micro_step, "scheduler": scheduler.state_dict()},
            )
            agreement.saved()
        if stopped:
            return step, micro_step, trace, stopped
    return step, micro_step, trace, None


def _finish(
    options,
    model,
    engine,
    tokenizer,
    corpus,
    world,
    device,
    run_dir,
    metrics,
    console,
    budgets,
    trace,
    step,
    first_step,
    step_seconds,
    tokens_per_step,
    started,
    model_name,
    n_params,
) -> int:
    """The end of a run: sample, plot, summary."""
    console.stop_progress()
    elapsed = time.perf_counter() - started
    if metrics:
        metrics.close()

    # the end: sample, plot, summary
    if options.sample_tokens:
        ids = generate(
            model,
            list(tokenizer.encode(options.prompt)),
            new_tokens=options.sample_tokens,
            temperature=options.temperature,
            context=options.seq,
            seed=options.seed,
            device=device,
        )
        text = tokenizer.decode(ids)
        console.block("sample", printable(text), text=text, temperature=options.temperature)
    if not world.is_main:
        return 0
    all_lines = read_metrics(run_dir / "metrics.jsonl")
    lines = [line for line in all_lines if line["kind"] == "train"]
    evals = [line["eval_loss"] for line in all_lines if line["kind"] == "eval"]
    title = f"tierwise train: {model_name}, {n_params:,} parameters, device {world.device}"
    eval_lines = [line for line in all_lines if line["kind"] == "eval"]
    note = plot_memory(run_dir / PLOT_FILE, trace, lines, title=title, eval_lines=eval_lines)
    console.note(note or f"wrote {run_dir / PLOT_FILE}")
    note = plot_training(run_dir / TRAINING_PLOT_FILE, all_lines, title=title)
    console.note(note or f"wrote {run_dir / TRAINING_PLOT_FILE}")
    stats = engine.stats()
    this_run = lines[-(step - first_step) :]
    steady = step_seconds[1:] or step_seconds
    rows = [
        ("metric", "value", "note"),
        ("steps", f"{first_step} → {step} of {options.steps}", ""),
        ("loss", f"{this_run[0]['loss']:.4f} → {this_run[-1]['loss']:.4f}", "train, this process"),
        (
            "held-out loss",
            f"{evals[0]:.4f} → {evals[-1]:.4f}" if evals else "-",
            f"{len(evals)} evals of {len(corpus.eval_blocks)} blocks",
        ),
        (
            "throughput",
            f"{tokens_per_step / statistics.median(steady):,.0f} tokens/s",
            "median step after the first",
        ),
        ("wall time", f"{elapsed:.1f} s", f"{step - first_step} steps"),
        overlap_row(this_run, stats.get("optimizer_overlap") or {}),
        (
            "plan",
            f"{engine.plan.planner}: chunk {engine.plan.chunk_size:,} elements, "
            f"{engine.plan.cache_blocks} rCache blocks",
            "",
        ),
    ]
    memory_rows = summary_rows(
        peak_bytes_by_tier=stats.get("peak_bytes_by_tier", {}),
        budgets=budgets,
        moved_bytes=stats.get("moved_bytes", {}),
    )
    console.block(
        "summary",
        table(rows) + "\n\n" + table(memory_rows) + f"\n\noutputs in {run_dir}/: {OPTIONS_FILE}, "
        f"{CONFIG_FILE}, {PLAN_FILE}, metrics.jsonl, checkpoints/, {PLOT_FILE}, "
        f"{TRAINING_PLOT_FILE}\n" + _next_command(run_dir, options, step),
        steps=step,
        first_step=first_step,
        tokens_per_s=tokens_per_step / statistics.median(steady),
        wall_s=elapsed,
        peak_bytes_by_tier=stats.get("peak_bytes_by_tier", {}),
        budgets=budgets,
        moved_bytes=stats.get("moved_bytes", {}),
        run_dir=str(run_dir),
        export_command=export_command(run_dir, options),
        resume_command=resume_command(run_dir) if step < options.steps else None,
    )
    return 0


def _next_command(run_dir: Path, options: TrainOptions, step: int) -> str:
    """What to run next: the resume command when --stop-after ended the run early, else the
    export command."""
    if step < options.steps:
        return (
            f"stopped at step {step} of {options.steps} (--stop-after); resume the run with: "
            f"{resume_command(run_dir)}\n(export what it has so far: "
            f"{export_command(run_dir, options)})"
        )
    return f"export a Hugging Face model: {export_command(run_dir, options)}"


def resume_command(run_dir: Path) -> str:
    return f"tierwise train --resume {run_dir}"


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, blocks: torch.Tensor, batch: int, world: World, device: torch.device
) -> float:
    """Mean loss over the held-out blocks; every rank runs the same number of forwards."""
    per_rank = len(blocks) // world.size
    mine = blocks[world.rank * per_rank : (world.rank + 1) * per_rank]
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, len(mine), batch):
            part = mine[start : start + batch]
            total += model(**data.batch_of(part, device)).loss.item() * len(part)
            count += len(part)
    finally:
        model.train()
    return mean_over_ranks(total / count, world)


# -- helpers ------------------------------------------------------------------------------------
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


def export_command(run_dir: Path, options: TrainOptions) -> str:
    """The `tierwise export` command for this run (LoRA runs merge their adapters)."""
    merge = " --merge-lora" if options.lora else ""
    return f"tierwise export {run_dir} {run_dir / 'hf-model'}{merge}"


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


def _same_on_all_ranks(run_dir: Path, world: World) -> Path:
    """Rank 0's run directory name (a default name holds the time, which ranks may disagree on)."""
    if world.size == 1:
        return run_dir
    return Path(world.collectives.broadcast_object(str(run_dir)))


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")
