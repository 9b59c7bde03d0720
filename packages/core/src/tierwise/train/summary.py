"""The end of a `tierwise train` run: the summary table, and the commands that come next
(resume a run stopped early or by a failure, export the model)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierwise.plan import Plan
from tierwise.tiers.ledger import process_memory
from tierwise.train import checkpoints
from tierwise.train.lora import MODEL_FOLDER
from tierwise.train.options import TrainOptions
from tierwise.train.report import Console, overlap_row, summary_rows, table
from tierwise.train.request import (
    CONFIG_FILE,
    OPTIONS_FILE,
    PLAN_FILE,
    PLOT_FILE,
    TRAINING_PLOT_FILE,
)
from tierwise.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class FixedMemory:
    """[Note: the process RAM a run predicts]
    What a `tierwise train` process holds besides the ledger's entries, measured once before the
    first step: the summary predicts the peak RSS as ``before_setup + setup_retained`` plus every
    host ledger entry at its budget (or peak where it has none), or the peak already reached
    when setup ended where that is more (the first run's hardware probe: [Note: the probe is no
    training memory], about 140 MiB it gives back). Measured on the demo model
    (``bench/memory_ledger.py``), a run grows its RSS by ~165 MiB of lazy imports after the
    command starts (the model family's modelling code, the plugins, matplotlib), which the RSS
    at the start did not hold; with those imported first, setup grows it by ~78 MiB in the
    profiler plugin's run of the model (first-use state of kernels, freed working memory the
    allocator keeps) before any tier holds a byte, and the rest is the ledger's."""

    before_setup: int
    """RSS right before ``tierwise.setup``: the imports (the plot backend's included), the
    model's code and the tokenised data, bytes."""
    setup_retained: int
    """RSS setup added beyond what the ledger's host entries held at its end, bytes (>= 0)."""
    peak_through_setup: int
    """The process's peak RSS when setup ended, bytes."""


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """What the summary of a finished run reports (rank 0)."""

    options: TrainOptions
    """The run's options."""
    run_dir: Path
    """Where its outputs are."""
    first_step: int
    """The step this process started from."""
    step: int
    """The step it ended at."""
    train_lines: list[dict[str, Any]]
    """metrics.jsonl's train lines (every process of the run)."""
    evals: list[float]
    """Held-out losses, in order."""
    n_eval_blocks: int
    """Blocks each held-out loss is taken over."""
    step_seconds: list[float]
    """Wall time of each step this process ran."""
    tokens_per_step: int
    """Tokens one optimizer step trains on (every rank)."""
    elapsed_s: float
    """Wall time of this process's steps."""
    stats: dict[str, Any]
    """``engine.stats()`` at the end."""
    plan: Plan
    """The engine's plan."""
    budgets: dict[str, int | None]
    """Byte budgets per tier."""
    fixed_memory: FixedMemory | None = None
    """The process's RAM besides the ledger ([Note: the process RAM a run predicts]); None:
    not known on this system."""

    def show(self, console: Console) -> None:
        """The summary block: run and memory tables, the outputs, what to run next."""
        stats, run_dir, options, step = self.stats, self.run_dir, self.options, self.step
        rows = self._rows()
        memory_rows = summary_rows(
            peak_bytes_by_tier=stats.get("peak_bytes_by_tier", {}),
            budgets=self.budgets,
            moved_bytes=stats.get("moved_bytes", {}),
        )
        peak_rss = process_memory()["peak"]
        predicted = predicted_process_bytes(self.fixed_memory, stats.get("memory") or {})
        fixed = self.fixed_memory
        memory_rows.append(
            (
                "process RAM",
                f"{format_bytes(peak_rss)} peak RSS",
                f"plan predicts {format_bytes(predicted)}" if predicted is not None else "",
            )
        )
        console.block(
            "summary",
            table(rows) + "\n\n" + table(memory_rows) + f"\n\noutputs in {run_dir}/: "
            f"{OPTIONS_FILE}, {CONFIG_FILE}, {PLAN_FILE}, metrics.jsonl, checkpoints/, "
            f"{MODEL_FOLDER}/, {PLOT_FILE}, {TRAINING_PLOT_FILE}\n"
            + next_command(run_dir, options, step),
            steps=step,
            first_step=self.first_step,
            tokens_per_s=self.tokens_per_step / statistics.median(self._steady_seconds()),
            wall_s=self.elapsed_s,
            peak_bytes_by_tier=stats.get("peak_bytes_by_tier", {}),
            budgets=self.budgets,
            moved_bytes=stats.get("moved_bytes", {}),
            peak_rss_bytes=peak_rss,
            predicted_process_bytes=predicted,
            rss_before_setup_bytes=fixed.before_setup if fixed else None,
            setup_retained_bytes=fixed.setup_retained if fixed else None,
            peak_through_setup_bytes=fixed.peak_through_setup if fixed else None,
            memory=stats.get("memory"),
            activations=stats.get("activations"),
            run_dir=str(run_dir),
            export_command=export_command(run_dir, options),
            resume_command=resume_command(run_dir) if step < options.steps else None,
        )

    def _steady_seconds(self) -> list[float]:
        """Step times after the first (the engine's warm-up step)."""
        return self.step_seconds[1:] or self.step_seconds

    def _rows(self) -> list[tuple]:
        step, first_step, evals, plan = self.step, self.first_step, self.evals, self.plan
        this_run = self.train_lines[-(step - first_step) :]
        steady = self._steady_seconds()
        return [
            ("metric", "value", "note"),
            ("steps", f"{first_step} → {step} of {self.options.steps}", ""),
            (
                "loss",
                f"{this_run[0]['loss']:.4f} → {this_run[-1]['loss']:.4f}",
                "train, this process",
            ),
            (
                "held-out loss",
                f"{evals[0]:.4f} → {evals[-1]:.4f}" if evals else "-",
                f"{len(evals)} evals of {self.n_eval_blocks} blocks",
            ),
            (
                "throughput",
                f"{self.tokens_per_step / statistics.median(steady):,.0f} tokens/s",
                "median step after the first",
            ),
            ("wall time", f"{self.elapsed_s:.1f} s", f"{step - first_step} steps"),
            overlap_row(this_run, self.stats.get("optimizer_overlap") or {}),
            (
                "plan",
                f"{plan.planner}: chunk {plan.chunk_size:,} elements, "
                f"{plan.cache_blocks} rCache blocks",
                "",
            ),
        ]


def predicted_process_bytes(fixed: FixedMemory | None, memory: dict[str, dict]) -> int | None:
    """The process's RAM the plan predicts ([Note: the process RAM a run predicts]): what it
    held before setup and what setup kept besides the ledger, plus each ledger entry in host
    RAM that no other entry counts ([Note: the memory ledger]) at its budget (the tiers'
    budgets, the saved activations' allotment on a CPU device), or at its peak where it has none
    (an unbudgeted tier, reduction buffers, workspaces). None: no figures on this system."""
    if fixed is None:
        return None
    training = fixed.before_setup + fixed.setup_retained + ledger_host_bytes(memory, held=False)
    return max(fixed.peak_through_setup, training)


def ledger_host_bytes(memory: dict[str, dict], *, held: bool) -> int:
    """The host ledger entries no other entry counts: at their budget or peak (``held``
    False), or what they hold now (True)."""
    entries = [e for e in memory.values() if e["memory"] == "host" and e["within"] is None]
    if held:
        return sum(e["bytes"] for e in entries)
    return sum(e["peak_bytes"] if e["budget"] is None else e["budget"] for e in entries)


def resume_hint(run_dir: Path) -> str:
    """What a run stopped by a failure can do next (checkpoints are swapped in atomically, so
    the newest one is whole)."""
    latest = run_dir / checkpoints.CHECKPOINTS / checkpoints.LATEST
    if latest.is_file():
        return (
            f"the checkpoint of {latest.read_text().strip()} is intact: resume with: "
            f"tierwise train --resume {run_dir}"
        )
    return "no checkpoint was written yet: start the run again"


def next_command(run_dir: Path, options: TrainOptions, step: int) -> str:
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


def export_command(run_dir: Path, options: TrainOptions) -> str:
    """The `tierwise export` command for this run (LoRA runs merge their adapters)."""
    merge = " --merge-lora" if options.lora else ""
    return f"tierwise export {run_dir} {run_dir / 'hf-model'}{merge}"


__all__ = [
    "FixedMemory",
    "RunSummary",
    "ledger_host_bytes",
    "export_command",
    "predicted_process_bytes",
    "next_command",
    "resume_command",
    "resume_hint",
]
