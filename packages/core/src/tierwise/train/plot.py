"""The run folder's pictures.

memory.png: where model data and activations live over one step, and what moves. Three panels:
(1) model data per tier and activations over the traced step, with the device budget; (2) bytes
moved so far in that step, per direction; (3) bytes moved per step over the whole run, per
direction, with what each held-out evaluation moved ([Note: the step after an eval moves less]).

training.png: train and held-out loss, and tokens/s, over the run (:func:`plot_training`).

matplotlib is optional (``pip install 'tierwise[plot]'``); without it the functions return a
note instead of a file.

[Note: the step after an eval moves less]
A held-out evaluation between two steps runs forwards through the rCache: it loads the newest
parameters into the device blocks, and nothing invalidates them before the next step (only an
optimizer step does). The next step's forward finds them there, so its host->device bytes are
lower, down to 0 when the rCache holds every chunk. The bytes were moved during the eval, not
skipped: eval lines of metrics.jsonl carry them, and panel (3) draws them at the eval's step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tierwise.train.trace import StepTrace

MIB = 1024 * 1024
PHASE_COLOURS = {"forward": "#e8f1fb", "backward": "#fdf0e6", "optimizer": "#ecf7ec"}
LEGEND = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
"""Legends sit right of the axes, where they hide no data."""
TIER_COLOURS = {"device": "tab:blue", "host": "tab:orange", "nvme": "tab:green"}


def load_pyplot():
    """matplotlib's pyplot on the file-only backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_training(path: Path, lines: Sequence[Mapping[str, Any]], *, title: str) -> str | None:
    """training.png: train loss and held-out loss (top), tokens/s (bottom) per optimizer step,
    from metrics.jsonl's ``lines``; return None, or a note saying why it was skipped."""
    plt = load_pyplot()
    if plt is None:
        return f"{path.name} skipped: matplotlib is not installed (pip install 'tierwise[plot]')"
    train = [line for line in lines if line["kind"] == "train"]
    evals = [line for line in lines if line["kind"] == "eval"]
    if not train:
        return f"{path.name} skipped: no training step was logged"
    fig, (loss_ax, speed_ax) = plt.subplots(
        2, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    fig.suptitle(title, fontsize=11)
    steps = [line["step"] for line in train]
    marker = "." if len(steps) < 50 else None
    loss_ax.plot(steps, [line["loss"] for line in train], marker=marker, label="train loss")
    if evals:
        loss_ax.plot(
            [line["step"] for line in evals],
            [line["eval_loss"] for line in evals],
            marker="o",
            label="held-out loss",
        )
    loss_ax.set_title("Loss per optimizer step", fontsize=10)
    loss_ax.set_ylabel("loss (nats per token)")
    loss_ax.legend(**LEGEND)
    loss_ax.grid(alpha=0.3)
    speeds = [(line["step"], line.get("tokens_per_s")) for line in train]
    speeds = [(step, value) for step, value in speeds if value]
    speed_ax.plot([s for s, _ in speeds], [v for _, v in speeds], marker=marker, color="tab:green")
    speed_ax.set_title("Training throughput (the first steps include the warm-up)", fontsize=10)
    speed_ax.set_xlabel("optimizer step")
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_ylim(bottom=0)
    speed_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def plot_memory(
    path: Path,
    trace: StepTrace | None,
    train_lines: Sequence[Mapping[str, Any]],
    *,
    title: str,
    eval_lines: Sequence[Mapping[str, Any]] = (),
) -> str | None:
    """Write the figure to ``path``; return None, or a note saying why it was skipped."""
    plt = load_pyplot()
    if plt is None:
        return "memory.png skipped: matplotlib is not installed (pip install 'tierwise[plot]')"
    if trace is None or not trace.samples:
        return "memory.png skipped: no step was traced"

    fig, (memory_ax, step_moved_ax, run_moved_ax) = plt.subplots(
        3, 1, figsize=(13, 11), gridspec_kw={"height_ratios": [3, 2, 2]}
    )
    fig.suptitle(title, fontsize=11)
    times_ms = [s.t * 1e3 for s in trace.samples]

    # (1) memory over the step
    _shade_phases(memory_ax, trace)
    tiers = sorted({t for s in trace.samples for t in s.bytes_by_tier}, key=_tier_key)
    for tier in tiers:
        values = [s.bytes_by_tier.get(tier, 0) / MIB for s in trace.samples]
        memory_ax.step(
            times_ms,
            values,
            where="post",
            label=f"model data on {tier}",
            color=TIER_COLOURS.get(tier),
            linewidth=2,
        )
    memory_ax.step(
        times_ms,
        [s.activation_bytes / MIB for s in trace.samples],
        where="post",
        label="activations (saved for backward)",
        color="tab:purple",
        linestyle="-.",
    )
    swapped_to = sorted({t for s in trace.samples for t in s.swapped_bytes})
    for tier in swapped_to:
        memory_ax.step(
            times_ms,
            [s.swapped_bytes.get(tier, 0) / MIB for s in trace.samples],
            where="post",
            label=f"activations swapped to {tier}",
            color=TIER_COLOURS.get(tier),
            linestyle="--",
        )
    for tier, budget in trace.budgets.items():
        if budget:
            memory_ax.axhline(
                budget / MIB,
                color=TIER_COLOURS.get(tier, "grey"),
                linestyle=":",
                label=f"{tier} budget for model data ({budget / MIB:.1f} MiB)",
            )
    memory_ax.set_title(f"Memory over one training step (step {trace.step})", fontsize=10)
    memory_ax.set_xlabel("time since the step started (ms)")
    memory_ax.set_ylabel("MiB")
    memory_ax.set_ylim(bottom=0)
    memory_ax.legend(**LEGEND)
    memory_ax.grid(alpha=0.3)

    # (2) moved within the step
    _shade_phases(step_moved_ax, trace)
    directions = sorted({d for s in trace.samples for d in s.moved_bytes})
    for direction in directions:
        values = [s.moved_bytes.get(direction, 0) / MIB for s in trace.samples]
        step_moved_ax.step(times_ms, values, where="post", label=direction, linewidth=2)
    step_moved_ax.set_title(f"Bytes moved so far in step {trace.step}, per direction", fontsize=10)
    step_moved_ax.set_xlabel("time since the step started (ms)")
    step_moved_ax.set_ylabel("MiB (cumulative)")
    step_moved_ax.set_ylim(bottom=0)
    if directions:
        step_moved_ax.legend(**LEGEND)
    else:
        step_moved_ax.text(
            0.5, 0.5, "nothing moved in this step", ha="center", transform=step_moved_ax.transAxes
        )
    step_moved_ax.grid(alpha=0.3)

    # (3) moved per step over the run ([Note: the step after an eval moves less])
    steps = [line["step"] for line in train_lines]
    directions = sorted({d for line in train_lines for d in line.get("moved_bytes", {})})
    colours = {}
    for direction in directions:
        values = [line.get("moved_bytes", {}).get(direction, 0) / MIB for line in train_lines]
        (curve,) = run_moved_ax.plot(
            steps, values, marker="." if len(steps) < 50 else None, label=direction
        )
        colours[direction] = curve.get_color()
    evals = [line for line in eval_lines if line.get("moved_bytes")]
    moved_in_evals = {d for line in evals for d, n in line["moved_bytes"].items() if n}
    for direction in sorted(moved_in_evals):
        run_moved_ax.scatter(
            [line["step"] for line in evals],
            [line["moved_bytes"].get(direction, 0) / MIB for line in evals],
            marker="x",
            color=colours.get(direction, "grey"),
            label=f"{direction} during the held-out eval after that step",
        )
    run_moved_ax.set_title(
        "Bytes moved per training step over the run, per direction (a step right after an eval "
        "moves less: the eval already loaded the parameters)",
        fontsize=10,
    )
    run_moved_ax.set_xlabel("optimizer step")
    run_moved_ax.set_ylabel("MiB per step")
    run_moved_ax.set_ylim(bottom=0)
    if directions:
        run_moved_ax.legend(**LEGEND)
    run_moved_ax.grid(alpha=0.3)

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _tier_key(tier: str) -> tuple[int, str]:
    order = list(TIER_COLOURS)
    return (order.index(tier) if tier in order else len(order), tier)


def _shade_phases(ax, trace: StepTrace) -> None:
    """Light background bands for forward, backward and optimizer, labelled once."""
    samples = trace.samples
    start = 0.0
    for i, sample in enumerate(samples):
        is_last = i + 1 == len(samples) or samples[i + 1].phase != sample.phase
        if is_last:
            end = sample.t * 1e3
            ax.axvspan(start, end, color=PHASE_COLOURS.get(sample.phase, "white"), zorder=0)
            ax.text(
                (start + end) / 2,
                0.98,
                sample.phase,
                ha="center",
                va="top",
                fontsize=8,
                color="dimgrey",
                transform=ax.get_xaxis_transform(),
            )
            start = end
