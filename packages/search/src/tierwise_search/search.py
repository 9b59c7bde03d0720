"""The plan search: chunk size, rCache blocks, per-chunk tiers and activation policy.

1. Allowed device memory U = F_alloc * (capacity - buffers - F_frag * peak activations).
2. Chunk size: candidates from the largest parameter upward; for each, pack every chunk group
   (core's packing) and simulate Belady over the profiled step with an rCache of the blocks U
   affords; keep the size that moves the fewest bytes, ties by padding.
3. Placement at that size: greedy from the minimum plan (``tierwise_search.placement``).
4. Activation policy: per layer keep / recompute / swap (``tierwise_search.activations``).
Settings the user forced in Config (not "auto") are taken exactly as given.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
from tierwise.config import Config
from tierwise.hardware import Hardware
from tierwise.plan import Plan, PlanError
from tierwise.profile import Profile
from tierwise.units import format_bytes

from tierwise_search.activations import ActivationChoice, activation_choices, best_split, traffic_for
from tierwise_search.belady import simulate
from tierwise_search.cost import TIERS, ActivationTraffic, CostModel, Placement, Prediction, Setting
from tierwise_search.layout import ChunkTable, build_chunks, build_trace, largest_param
from tierwise_search.placement import (
    Budgets,
    Forced,
    PlacementError,
    Step,
    greedy,
    minimum_placement,
)
from tierwise_search.rates import Rates, resolve_rates

PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MAX_CANDIDATES = 48
"""Chunk sizes tried between the largest parameter and the largest useful size."""


@dataclass(frozen=True)
class SizeScore:
    chunk_size: int
    moved_bytes: float
    padding: int
    blocks: int


@dataclass
class Outcome:
    """The best plan under one activation choice."""

    choice: ActivationChoice
    table: ChunkTable
    step: Step
    prediction: Prediction
    policy: dict[str, str]
    allowed_device: int
    sizes: list[SizeScore]
    runner_up: tuple[SizeScore, Prediction] | None


def _tier_index(placement: str) -> int | None:
    return None if placement == "auto" else TIERS.index(placement)


def _forward_flops(profile: Profile, reasons: list[str]) -> float:
    if profile.layer_flops:
        return float(sum(profile.layer_flops.values()))
    if profile.batch_size and profile.seq_len:
        tokens = profile.batch_size * profile.seq_len
        reasons.append(
            f"profile has no layer FLOPs: estimated forward FLOPs as 2 x parameters x {tokens} tokens"
        )
        return 2.0 * profile.total_numel * tokens
    reasons.append("profile has neither layer FLOPs nor batch shape: compute time taken as 0")
    return 0.0


def chunk_size_candidates(profile: Profile, world: int) -> list[int]:
    """From the largest parameter up to the largest group's size (one chunk per group)."""
    align = world * (1024 if largest_param(profile) >= 1 << 20 else 1)
    low = math.ceil(largest_param(profile) / align) * align
    totals: Counter[str] = Counter()
    for info in profile.params:
        totals[info.group or str(info.requires_grad)] += info.numel
    high = max(low, math.ceil(max(totals.values(), default=low) / align) * align)
    high = min(high, max(8 * low, low + 64 * align))
    if high == low:
        return [low]
    count = min(MAX_CANDIDATES, (high - low) // align + 1)
    sizes = {low + round(i * (high - low) / (count - 1) / align) * align for i in range(count)}
    return sorted(sizes)


def _allowed(capacity: int, profile: Profile, activation_bytes: int, config: Config) -> int:
    usable = capacity - profile.buffer_bytes - config.frag_factor * activation_bytes
    return int(config.alloc_fraction * usable)


def _capacity_for(allowed: int, profile: Profile, activation_bytes: int, config: Config) -> int:
    """Inverse of ``_allowed``: the device capacity giving ``allowed`` bytes."""
    return math.ceil(allowed / config.alloc_fraction + profile.buffer_bytes + config.frag_factor * activation_bytes)


class _Search:
    def __init__(self, profile: Profile, hardware: Hardware, config: Config):
        self.profile, self.hardware, self.config = profile, hardware, config
        self.reasons: list[str] = []
        self.rates: Rates = resolve_rates(hardware)
        self.param_bytes = PARAM_BYTES[config.precision]
        world = self.rates.world_size
        self.shard = world if (config.shard and world > 1) else 1
        self.forward_flops = _forward_flops(profile, self.reasons)
        self.device_capacity = config.device_memory if config.device_memory is not None else hardware.device_memory
        self.host_capacity = config.host_memory if config.host_memory is not None else hardware.host_memory
        if self.device_capacity is None:
            self.reasons.append("device memory unknown: planning the minimum device footprint")
        if self.host_capacity is None:
            self.reasons.append("host memory unknown: assumed it holds all offloaded model data")
        self.forced = Forced(
            param_tier=_tier_index(config.param_placement),
            optim_tier=_tier_index(config.optimizer_placement),
            n_blocks=config.cache_blocks if isinstance(config.cache_blocks, int) else None,
        )
        self._traces: dict[int, tuple[ChunkTable, object]] = {}

    # -- pieces ---------------------------------------------------------------------------
    def layout(self, chunk_size: int):
        if chunk_size not in self._traces:
            table = build_chunks(self.profile, chunk_size)
            trace = build_trace(self.profile, table, checkpointing=self.config.activation_checkpointing)
            self._traces[chunk_size] = (table, trace)
        return self._traces[chunk_size]

    def budgets(self, allowed: int | None, choice: ActivationChoice) -> Budgets:
        host = None if self.host_capacity is None else self.host_capacity
        nvme_free = self.hardware.nvme_free if self.config.nvme_path else None
        return Budgets(
            device=allowed if allowed is not None else 0,
            host=host,
            nvme=nvme_free,
            nvme_allowed=self.config.nvme_path is not None,
        )

    def setting(self, chunk_size: int, traffic: ActivationTraffic) -> Setting:
        table, trace = self.layout(chunk_size)
        return Setting(
            table=table,
            trace=trace,
            rates=self.rates,
            param_bytes=self.param_bytes,
            forward_flops=self.forward_flops,
            shard=self.shard,
            prefetch=self.config.prefetch,
            min_blocks=max(trace.widest_step(), 0),
            activations=traffic,
        )

    def score_sizes(self, allowed: int | None) -> tuple[list[SizeScore], int]:
        """Moved bytes per candidate chunk size; also the least rCache bytes any size needs."""
        if isinstance(self.config.chunk_size, int):
            candidates = [self.config.chunk_size]
        else:
            candidates = chunk_size_candidates(self.profile, self.rates.world_size)
        no_rcache = self.forced.param_tier == 0 and self.shard == 1
        scores, least, widest_all = [], None, 0
        for size in candidates:
            table, trace = self.layout(size)
            widest = 0 if no_rcache else trace.widest_step()
            widest_all = max(widest_all, widest)
            need = widest * size * self.param_bytes
            least = need if least is None else min(least, need)
            if self.forced.n_blocks is not None:
                blocks = self.forced.n_blocks
            elif allowed is None:
                blocks = widest
            else:
                blocks = min(allowed // (size * self.param_bytes), table.n_chunks)
            if blocks < widest:
                continue
            if no_rcache:
                scores.append(SizeScore(size, 0.0, table.padding, 0))
                continue
            fetches = simulate(trace, blocks).fetches
            moved = float((fetches * table.capacity).sum() * self.param_bytes)
            scores.append(SizeScore(size, moved, table.padding, int(blocks)))
        if not scores and self.forced.n_blocks is not None:
            raise PlanError(
                f"cache_blocks={self.forced.n_blocks} is too few: the widest module or checkpoint "
                f"block needs {widest_all} chunks resident at once at chunk_size "
                f"{candidates[-1]:,}; use cache_blocks >= {widest_all} or \"auto\""
            )
        scores.sort(key=lambda s: (s.moved_bytes, s.padding, s.chunk_size))
        return scores, least or 0

    def place(self, size: int, choice: ActivationChoice, allowed: int | None):
        # placement is searched with every leaving layer recomputed (the split comes after)
        base = replace(traffic_for(self.profile, (), choice.leaving, None), host_bytes=choice.host_reserve)
        model = CostModel(self.setting(size, base))
        budgets = self.budgets(allowed, choice)
        start = minimum_placement(model, budgets, self.forced)
        if allowed is None:
            budgets = replace(budgets, device=model.memory(start).device)
        steps = greedy(model, start, budgets, self.forced)
        final = steps[-1]

        def evaluate(traffic: ActivationTraffic) -> Prediction:
            model.setting = replace(model.setting, activations=traffic)
            return model.predict(final.placement)

        policy, traffic, prediction = best_split(self.profile, choice, evaluate)
        model.setting = replace(model.setting, activations=traffic)
        final = Step(final.placement, model.memory(final.placement), prediction, final.move)
        return final, policy, steps

    # -- one activation choice --------------------------------------------------------------
    def outcome(self, choice: ActivationChoice) -> Outcome:
        allowed = None
        if self.device_capacity is not None:
            allowed = _allowed(self.device_capacity, self.profile, choice.device_bytes, self.config)
        scores, least = self.score_sizes(allowed)
        if not scores:
            self._too_small(allowed, least, choice)
        try:
            step, policy, _ = self.place(scores[0].chunk_size, choice, allowed)
        except PlacementError as err:
            self._placement_failed(err, scores[0].chunk_size, allowed, choice)
        runner_up = None
        if len(scores) > 1:
            try:
                alt_step, _, _ = self.place(scores[1].chunk_size, choice, allowed)
                runner_up = (scores[1], alt_step.prediction)
            except PlacementError:
                runner_up = None
        table, _ = self.layout(scores[0].chunk_size)
        return Outcome(choice, table, step, step.prediction, policy, allowed or 0, scores, runner_up)

    def _too_small(self, allowed, least: int, choice: ActivationChoice):
        need = _capacity_for(least, self.profile, choice.device_bytes, self.config)
        raise PlanError(
            f"device_memory {format_bytes(self.device_capacity)} leaves "
            f"{format_bytes(max(allowed, 0))} for model data (U = {self.config.alloc_fraction} x "
            f"(capacity - buffers {format_bytes(self.profile.buffer_bytes)} - "
            f"{self.config.frag_factor} x activations {format_bytes(choice.device_bytes)})), but the "
            f"minimum plan needs {format_bytes(least)} (rCache blocks for the widest module or "
            f"checkpoint block); the minimum device_memory is {format_bytes(need)} ({need} bytes): "
            "raise device_memory, or shrink activations (batch, sequence, activation_checkpointing)"
        )

    def _placement_failed(self, err: PlacementError, size: int, allowed, choice):
        if "host_memory" in str(err):
            raise PlanError(str(err)) from None
        model = CostModel(self.setting(size, ActivationTraffic()))
        budgets = replace(self.budgets(allowed, choice), device=1 << 62)
        need = model.memory(minimum_placement(model, budgets, self.forced)).device
        capacity = _capacity_for(need, self.profile, choice.device_bytes, self.config)
        forced = [
            f"{name}={getattr(self.config, name)!r}"
            for name in ("param_placement", "optimizer_placement", "cache_blocks", "chunk_size")
            if getattr(self.config, name) != "auto"
        ]
        what = f" with {', '.join(forced)}" if forced else ""
        raise PlanError(
            f"device_memory {format_bytes(self.device_capacity)} leaves "
            f"{format_bytes(max(allowed or 0, 0))} for model data, but the minimum plan{what} "
            f"needs {format_bytes(need)}; the minimum device_memory is {format_bytes(capacity)} "
            f"({capacity} bytes): raise device_memory or relax the forced settings"
        ) from None


def _counts(tiers: list[str]) -> str:
    return ", ".join(f"{n}x{t}" for t, n in Counter(tiers).items())


def search_plan(profile: Profile, hardware: Hardware, config: Config) -> Plan:
    """The plan the search predicts fastest (see the module docstring)."""
    search = _Search(profile, hardware, config)
    choices = activation_choices(
        profile,
        offload=config.activation_offload,
        checkpointing=config.activation_checkpointing,
        nvme=config.nvme_path is not None,
    )
    outcomes: list[Outcome] = []
    errors: list[PlanError] = []
    for choice in choices:
        try:
            outcomes.append(search.outcome(choice))
        except PlanError as err:
            errors.append(err)
    if not outcomes:
        raise errors[0]
    outcomes.sort(key=lambda o: o.prediction.total)
    best = outcomes[0]
    return _to_plan(search, best, outcomes[1:])


def _to_plan(search: _Search, best: Outcome, other: list[Outcome]) -> Plan:
    config, table, placement = search.config, best.table, best.step.placement
    param_tiers: dict[str, list[str]] = {}
    optim_tiers: dict[str, list[str]] = {}
    for chunk, group in enumerate(table.group_of_chunk):
        param_tiers.setdefault(group, []).append(TIERS[placement.param_tier[chunk]])
        optim_tiers.setdefault(group, []).append(TIERS[placement.optim_tier[chunk]])
    all_params = [t for tiers in param_tiers.values() for t in tiers]
    all_optims = [t for tiers in optim_tiers.values() for t in tiers]
    n_device = all_params.count("device")
    memory = best.step.memory
    size = best.sizes[0]
    reasons = [
        f"allowed device memory U = {format_bytes(best.allowed_device)} "
        f"(F_alloc={config.alloc_fraction}, F_frag={config.frag_factor}, activations "
        f"{format_bytes(best.choice.device_bytes)}, buffers {format_bytes(search.profile.buffer_bytes)})",
        f"chunk size {table.chunk_size:,}: moves {format_bytes(size.moved_bytes)} per step through "
        f"{size.blocks} rCache blocks, padding {size.padding:,} elements "
        f"({'forced' if isinstance(config.chunk_size, int) else f'best of {len(best.sizes)} sizes'})",
        f"{placement.n_blocks} rCache blocks, {n_device}/{table.n_chunks} chunks on the device; "
        f"params {_counts(all_params)}; optimizer {_counts(all_optims)}",
        f"model data: device {format_bytes(memory.device)}, host {format_bytes(memory.host)}, "
        f"nvme {format_bytes(memory.nvme)}",
        f"activations: {best.choice.name}; {_counts(list(best.policy.values())) or 'no layers profiled'}",
    ]
    used = {"h2d_bandwidth", "d2h_bandwidth", "device_adam_velocity", "host_adam_velocity", "device_flops"}
    if config.nvme_path:
        used |= {"nvme_read_bandwidth", "nvme_write_bandwidth"}
    if search.rates.world_size > 1:
        used.add("interconnect_bandwidth")
    reasons += [line for name, line in search.rates.fallbacks.items() if name in used]
    reasons += search.reasons
    alternatives = []
    if best.runner_up is not None:
        score, prediction = best.runner_up
        alternatives.append({
            "summary": f"chunk size {score.chunk_size:,}",
            "predicted_s": prediction.total,
            "why": f"moves {format_bytes(score.moved_bytes)} per step vs "
            f"{format_bytes(size.moved_bytes)}",
        })
    for outcome in other:
        alternatives.append({
            "summary": f"activations: {outcome.choice.name}",
            "predicted_s": outcome.prediction.total,
            "why": f"predicted {outcome.prediction.total:.4g} s vs {best.prediction.total:.4g} s",
        })
    return Plan(
        chunk_size=table.chunk_size,
        cache_blocks=int(placement.n_blocks),
        prefetch=config.prefetch,
        param_tier=Counter(all_params).most_common(1)[0][0] if all_params else "device",
        optim_tier=Counter(all_optims).most_common(1)[0][0] if all_optims else "device",
        param_tiers=param_tiers,
        optim_tiers=optim_tiers,
        shard=config.shard,
        activation_checkpointing=config.activation_checkpointing,
        activation_policy=best.policy,
        predicted_step_s=best.prediction.seconds,
        device_allowance=int(memory.device),
        planner="search",
        reasons=reasons,
        alternatives=alternatives,
    )


__all__ = ["chunk_size_candidates", "search_plan"]
