"""What would make a plan that does not fit fit: each remedy tried with the search itself.

``tierwise plan`` prints the binding tier and its shortfall (the PlanError), then one line per
remedy that applies: the flag to add or change and either the plan the search would then pick or
what still binds. Remedies: an NVMe tier, activation checkpointing, activation offload to host,
more GPUs, a smaller batch.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterator

from tierwise.hardware import Hardware
from tierwise.plan import Plan, PlanError
from tierwise.units import format_gib

NVME_PLACEHOLDER = "DIR"
"""The directory shown in ``--nvme-path DIR`` (only its presence changes the plan)."""
MAX_GPUS_FACTOR = 8
"""More GPUs are tried at 2x, 4x, ... up to this factor of --gpus."""


def candidates(args: argparse.Namespace, error: PlanError) -> Iterator[tuple[str, dict]]:
    """(flag as the user would type it, changed arguments) for each remedy that applies."""
    if not args.nvme and error.tier in ("host", None):
        yield f"--nvme-path {NVME_PLACEHOLDER}", {"nvme": NVME_PLACEHOLDER}
    if error.tier in ("device", None):
        if not args.checkpointing:
            yield "--checkpointing", {"checkpointing": True}
        if args.activation_offload == "none":
            yield "--activation-offload host", {"activation_offload": "host"}
    factor = 2
    while factor <= MAX_GPUS_FACTOR:
        yield f"--gpus {args.gpus * factor}", {"gpus": args.gpus * factor}
        factor *= 2
    if error.tier in ("device", None) and args.batch > 1:
        yield f"--batch {args.batch // 2}", {"batch": args.batch // 2}


def assumptions(plan: Plan, hardware: Hardware) -> str:
    """The hardware figures behind the plan's predicted step, where they came from: the NVMe
    rates when the plan uses NVMe, and any other figure the search had to assume
    (``tierwise_search.rates.FALLBACKS``)."""
    from tierwise_search.rates import resolve_rates

    rates = resolve_rates(hardware)
    tiers = plan.tier_names() | set(plan.activation_policy.values())
    parts = []
    if "nvme" in tiers:
        known = not {"nvme_read_bandwidth", "nvme_write_bandwidth"} & set(rates.fallbacks)
        parts.append(
            f"NVMe {rates.nvme_read / 1e9:.3g} GB/s read, {rates.nvme_write / 1e9:.3g} GB/s "
            + ("write" if known else "write assumed (not probed: tierwise probe --nvme-path DIR)")
        )
    assumed = {
        "h2d_bandwidth": ("host->device", rates.h2d / 1e9, "GB/s"),
        "host_adam_velocity": ("host Adam", rates.host_adam / 1e6, "M params/s"),
        "device_flops": ("device", rates.flops / 1e12, "TFLOP/s"),
    }
    for name, (what, value, unit) in assumed.items():
        if name in rates.fallbacks:
            parts.append(f"{what} {value:.3g} {unit} assumed")
    return "; ".join(parts)


def summary(plan: Plan, hardware: Hardware | None = None) -> str:
    """One line: the plan's chunk size, rCache, tiers and prediction (with the hardware figures
    the prediction assumes when ``hardware`` is given)."""
    params = Counter(t for tiers in plan.param_tiers.values() for t in tiers)
    optim = Counter(t for tiers in plan.optim_tiers.values() for t in tiers)
    parts = [
        f"chunk size {plan.chunk_size:,}",
        f"{plan.cache_blocks} rCache blocks",
        "params " + ", ".join(f"{n}x{t}" for t, n in params.items()),
        "optimizer " + ", ".join(f"{n}x{t}" for t, n in optim.items()),
    ]
    if plan.predicted_step_s:
        based = assumptions(plan, hardware) if hardware is not None else ""
        parts.append(
            f"step {plan.predicted_step_s['total']:.3g} s" + (f" (at {based})" if based else "")
        )
    if plan.predicted_tflops is not None:
        parts.append(f"{plan.predicted_tflops:.1f} TFLOPS/GPU")
    return ", ".join(parts)


class _Planner:
    """Runs the search for changed arguments, re-profiling only when the batch or
    checkpointing changed (the profile does not depend on the other remedies)."""

    def __init__(self, args: argparse.Namespace, hardware: Hardware):
        self.args, self.hardware = args, hardware
        self._profiles: dict[tuple, object] = {}

    def plan(self, changes: dict) -> Plan | PlanError:
        from dataclasses import replace

        from tierwise_search.cli import plan_config, plan_profile
        from tierwise_search.search import search_plan

        changed = argparse.Namespace(**{**vars(self.args), **changes})
        per_node = getattr(self.args, "gpus_per_node", None) or min(changed.gpus, 8)
        target = replace(self.hardware, world_size=changed.gpus, gpus_per_node=per_node)
        config = plan_config(changed, target.device_type)
        key = (changed.batch, changed.checkpointing)
        if key not in self._profiles:
            self._profiles[key] = plan_profile(changed, config)
        try:
            return search_plan(self._profiles[key], target, config)
        except PlanError as err:
            return err


def _outcome(result: Plan | PlanError, hardware: Hardware) -> str:
    if isinstance(result, Plan):
        return f"fits; the search would pick: {summary(result, hardware)}"
    if result.tier is None:
        return f"does not fit either ({str(result).split(';')[0]})"
    return f"still short: {result.tier} by {format_gib(result.shortfall)}"


def remedies(args: argparse.Namespace, hardware: Hardware, error: PlanError) -> list[str]:
    """Lines for the user: each remedy with its outcome (more GPUs stop at the first count that
    fits); when no single one fits, the remedies combined in the order the binding tiers ask
    for them."""
    planner = _Planner(args, hardware)
    lines, fits, gpus_fit = [], False, False
    for flag, changes in candidates(args, error):
        if "gpus" in changes and gpus_fit:
            continue
        result = planner.plan(changes)
        fits |= isinstance(result, Plan)
        gpus_fit |= "gpus" in changes and isinstance(result, Plan)
        if "gpus" in changes and not isinstance(result, Plan):
            continue  # only a GPU count that would fit is a remedy
        lines.append(f"{flag}: {_outcome(result, hardware)}")
    if not fits:  # combine: add the first remedy for whatever binds now, while one is left
        flags, changes, result = [], {}, error
        while isinstance(result, PlanError) and len(flags) < 4:
            step = next(
                (
                    (flag, change)
                    for flag, change in candidates(
                        argparse.Namespace(**{**vars(args), **changes}), result
                    )
                    if "gpus" not in change and "batch" not in change and flag not in flags
                ),
                None,
            )
            if step is None:
                break
            flags.append(step[0])
            changes.update(step[1])
            result = planner.plan(changes)
        if len(flags) > 1:
            lines.append(f"{' '.join(flags)}: {_outcome(result, hardware)}")
    return ["what would make it fit:", *(f"  {line}" for line in lines)] if lines else []


__all__ = ["candidates", "remedies", "summary"]
