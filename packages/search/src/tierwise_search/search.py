"""The plan search: chunk size, rCache blocks, per-chunk tiers and activation policy.

1. Allowed device memory U = F_alloc * (capacity - buffers - F_frag * peak activations).
2. Chunk size: candidates from the largest parameter upward that waste little padding
   (core's [Note: chunk padding]); for each, pack every chunk group
   (core's packing) and simulate Belady over the profiled step with an rCache of the blocks U
   affords; keep the size that moves the fewest bytes, ties by padding.
3. Placement at that size: greedy from the minimum plan (``tierwise_search.placement``).
4. Activation policy: per layer keep / recompute / swap (``tierwise_search.activations``).
Settings the user forced in Config (not "auto") are taken exactly as given.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
from tierwise.chunks.payload import PayloadSpec
from tierwise.config import Config
from tierwise.hardware import Hardware
from tierwise.plan import (
    Plan,
    PlanError,
    io_buffer_bytes,
    load_buffer_minimum,
    save_buffer_bytes,
)
from tierwise.planning.activation_peak import activation_peak
from tierwise.planning.chunk_size import grid_sizes, lean_sizes
from tierwise.planning.host_minimum import least_host_budget, restated
from tierwise.planning.host_share import in_node_units, rank_config, rank_host_share
from tierwise.planning.planner import (
    REDUCTION_BLOCKS,
    may_recompute,
    profile_min_blocks,
    receive_block_numel,
)
from tierwise.precision import param_bytes
from tierwise.profile import Profile
from tierwise.units import format_bytes, format_gib

from tierwise_search.activations import (
    ActivationChoice,
    activation_choices,
    best_split,
    block_reasons,
    traffic_for,
)
from tierwise_search.compute import BACKWARD_OVER_FORWARD, layer_times
from tierwise_search.cost import (
    DEVICE,
    TIERS,
    ActivationTraffic,
    CostModel,
    Prediction,
    Setting,
    storage_host_bytes,
)
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

MIN_CHUNK_SIZE = 1024
"""Core's engine refuses smaller chunks (``tierwise.runtime.setup.planning.MIN_CHUNK_SIZE``)."""
MAX_CANDIDATES = 32
"""Chunk sizes tried between the largest parameter and the largest useful size (the grid of
``tierwise.planning.chunk_size.grid_sizes`` has as many)."""
# [Note: chunk size choice] The candidates waste little padding ([Note: chunk padding]): sizes
# padding more than ``PADDING_LIMIT`` of the parameters are tried only when no size is under it,
# or when none of those fits the budgets (a smaller, padded size needs smaller rCache blocks and
# NVMe staging): a plan that fits comes before bytes per parameter.
# Every chunk size that fits gets a full placement, and the fastest
# prediction wins (ties: fewer moved bytes, then less padding). Moved bytes alone ignore what
# padding costs the optimizer and gradient traffic, and the size moving the fewest bytes changes
# with the budget; taking the best over a candidate set that only grows with the budget keeps a
# bigger device from ever getting a slower plan. Moved bytes still order the candidates and
# explain the choice.


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
    """Feasible chunk sizes, fewest moved bytes first; ``sizes[0]`` is the chosen one."""
    rejected: list[tuple[SizeScore, Prediction]]
    """Other shortlisted chunk sizes with their full-placement predictions."""


def _tier_index(placement: str) -> int | None:
    return None if placement == "auto" else TIERS.index(placement)


def chunk_size_candidates(profile: Profile, world: int) -> list[int]:
    """From the largest parameter (at least core's minimum chunk) up to the largest group's
    size (one chunk per group), multiples of 64 elements per rank (1024 for big models): those
    of an even grid and of the sizes a run of parameters fills that waste at most
    ``PADDING_LIMIT`` of the parameters in padding ([Note: chunk padding] in
    tierwise.planning.chunk_size), at most ``MAX_CANDIDATES`` spread over them; the grid when
    none does."""
    return _candidates(profile, world)[0]


def _candidates(profile: Profile, world: int) -> list[list[int]]:
    """[``chunk_size_candidates``, the grid sizes padding more]: the second are tried only
    when none of the first fits the budgets ([Note: chunk size choice])."""
    align = world * (1024 if largest_param(profile) >= 1 << 20 else 64)
    low = math.ceil(max(largest_param(profile), MIN_CHUNK_SIZE) / align) * align
    totals: Counter[str] = Counter()
    for info in profile.params:
        totals[info.group or str(info.requires_grad)] += info.numel
    high = max(low, math.ceil(max(totals.values(), default=low) / align) * align)
    high = min(high, max(8 * low, low + 64 * align))
    if high == low:
        return [[low]]
    grid = grid_sizes(low, high, align)
    groups = [
        [slot.numel for spec in specs for slot in spec.slots]
        for specs in build_chunks(profile, low).groups.values()
    ]
    lean = lean_sizes(groups, low, high, align)
    if not lean:
        return [grid]
    picks = min(MAX_CANDIDATES, len(lean))
    spread = {lean[round(i * (len(lean) - 1) / max(picks - 1, 1))] for i in range(picks)}
    return [sorted(spread), sorted(set(grid) - spread)]


def _allowed(capacity: int, profile: Profile, activation_bytes: int, config: Config) -> int:
    usable = capacity - profile.buffer_bytes - config.frag_factor * activation_bytes
    return int(config.alloc_fraction * usable)


def _capacity_for(allowed: int, profile: Profile, activation_bytes: int, config: Config) -> int:
    """Inverse of ``_allowed``: the device capacity giving ``allowed`` bytes."""
    return math.ceil(
        allowed / config.alloc_fraction
        + profile.buffer_bytes
        + config.frag_factor * activation_bytes
    )


GRADIENT_STAGING = ("engine", "streaming")
"""How multi-rank gradients reach their shards: "engine" = core's path, a fixed pool of
``REDUCTION_BLOCKS`` device blocks whatever the model and world size (core's [Note: bounded
gradient blocks]; ``no_sync`` sums are uploaded into them: [Note: no_sync buffers]), one more
with ``reduce_order="rank"`` ([Note: reduction in rank order]);
"streaming" = reduce-scatter each chunk as soon as its gradients are complete (Elixir,
PatrickStar), two staging buffers."""


class _Search:
    def __init__(
        self,
        profile: Profile,
        hardware: Hardware,
        config: Config,
        gradient_staging: str,
        *,
        clipping: bool = False,
        rollback_rate: float = 0.0,
    ):
        if gradient_staging not in GRADIENT_STAGING:
            raise ValueError(
                f"gradient_staging {gradient_staging!r}: choose one of {GRADIENT_STAGING}"
            )
        # [Note: a rank's host share]: a rank plans with its share of the node's host_memory,
        # and the storage tiers' host pools are sized against that share, as at run time
        self.profile, self.hardware = profile, hardware
        self.config = rank_config(config, hardware.ranks_per_node)
        self.gradient_staging = gradient_staging
        if not 0.0 <= rollback_rate <= 1.0:
            raise ValueError(f"rollback_rate {rollback_rate!r}: give a share of steps in [0, 1]")
        self.clipping, self.rollback_rate = clipping, rollback_rate
        self.reasons: list[str] = []
        self.rates: Rates = resolve_rates(hardware)
        self.param_bytes = param_bytes(config.precision)
        world = self.rates.world_size
        self.shard = world if (config.shard and world > 1) else 1
        self.times = layer_times(profile, self.rates.compute)
        self.reasons.append(self.times.source)
        # [Note: shared per node]: host memory and NVMe space are the node's, split by its ranks
        per_node = self.rates.ranks_per_node
        node_host = config.host_memory if config.host_memory is not None else hardware.host_memory
        self.host_capacity = rank_host_share(node_host, per_node)
        self.nvme_capacity = None if hardware.nvme_free is None else hardware.nvme_free // per_node
        if per_node > 1:
            self.reasons.append(
                f"{per_node} ranks per node share its host memory, host CPU (Adam) and NVMe: "
                "each rank plans with 1/" + f"{per_node} of them; PCIe is per GPU"
            )
        if config.device_memory is not None:
            self.reasons.append(
                f"device_memory {format_bytes(config.device_memory)} is the model-data budget "
                "(activations are outside it)"
            )
        elif hardware.device_memory is None:
            self.reasons.append("device memory unknown: planning the minimum device footprint")
        if self.host_capacity is None:
            self.reasons.append("host memory unknown: assumed it holds all offloaded model data")
        if config.nvme_path is not None and hardware.nvme_free is None:
            self.reasons.append(
                "NVMe space unknown: assumed it holds all model data placed there (give "
                "nvme_free in a --hardware JSON file, or plan on the machine itself)"
            )
        self.forced = Forced(
            param_tier=_tier_index(config.param_placement),
            optim_tier=_tier_index(config.optimizer_placement),
            n_blocks=config.cache_blocks if isinstance(config.cache_blocks, int) else None,
        )
        self._layouts: dict[int, tuple[ChunkTable, object]] = {}
        # core's engine updates NVMe optimizer states during the last backward of a step, with
        # any number of ranks, under clipping and fp16 (speculatively: core's [Note: speculative
        # updates]); "auto" from the second step: the steady state is what the plan is for
        self.optimizer_in_backward = config.optimizer_overlap in ("auto", "in-backward")
        self.grads_in_device_home = False
        """Plan the 14-byte device home (core's [Note: the 14-byte device home])."""
        self.grads_in_nvme_home = False
        """Plan the 14-byte NVMe home (core's [Note: the 14-byte NVMe home])."""

    # -- pieces ---------------------------------------------------------------------------
    def allowed(self, choice: ActivationChoice) -> int | None:
        """Device bytes for model data (U), or None when the device's memory is unknown."""
        if self.config.device_memory is not None:
            return self.config.device_memory
        if self.hardware.device_memory is None:
            return None
        return _allowed(self.hardware.device_memory, self.profile, choice.device_bytes, self.config)

    def activation_room(self, device_data: int) -> int | None:
        """The most activation bytes the device holds beside ``device_data`` bytes of model
        data (``_allowed`` inverted); None: unbounded (no device capacity known, or
        ``device_memory`` budgets model data only)."""
        if self.config.device_memory is not None or self.hardware.device_memory is None:
            return None
        usable = (
            self.hardware.device_memory
            - self.profile.buffer_bytes
            - device_data / self.config.alloc_fraction
        )
        return int(usable / self.config.frag_factor)

    def layout(self, chunk_size: int):
        if chunk_size not in self._layouts:
            table = build_chunks(self.profile, chunk_size)
            trace = build_trace(self.profile, table, checkpointing=may_recompute(self.config))
            self._layouts[chunk_size] = (table, trace)
        return self._layouts[chunk_size]

    def min_blocks(self, table: ChunkTable, cached: np.ndarray | None = None) -> int:
        """[Note: the rCache minimum], computed as setup checks it (chunks where ``cached``)."""
        chunk_of = {n: c for n, c in table.chunk_of_param.items() if cached is None or cached[c]}
        return profile_min_blocks(self.profile, chunk_of, recompute=may_recompute(self.config))

    def io_bytes(self, table: ChunkTable) -> int:
        """``Plan.io_buffer_bytes`` at this layout, as setup computes it after layout (the
        largest parameter, the largest chunk)."""
        largest = largest_param(self.profile)
        return io_buffer_bytes(largest, max(int(table.capacity.max(initial=0)), largest))

    def budgets(self, allowed: int | None, table: ChunkTable) -> Budgets:
        return Budgets(
            device=allowed if allowed is not None else 0,
            host=self.host_capacity,
            nvme=self.nvme_capacity if self.config.nvme_path else None,
            nvme_allowed=self.config.nvme_path is not None,
            io_bytes=self.io_bytes(table),
            load_room=max(  # a save takes the whole buffers (Config.saves_weights)
                load_buffer_minimum(
                    self.io_bytes(table), largest_param(self.profile), self.param_bytes
                ),
                save_buffer_bytes(self.io_bytes(table)) if self.config.saves_weights else 0,
            ),
        )

    def model(self, chunk_size: int, choice: ActivationChoice) -> CostModel:
        """The cost model at one chunk size, every leaving layer recomputed, from inputs swapped
        out for a choice that does so (the swap/recompute split comes after placement)."""
        table, trace = self.layout(chunk_size)
        world = self.rates.world_size
        receive = 0
        if world == 1:
            staging = 0
        elif self.gradient_staging == "engine":
            staging = REDUCTION_BLOCKS
            if self.config.reduce_order == "rank":  # [Note: reduction in rank order]
                receive = receive_block_numel([(int(table.capacity.max(initial=0)), world)])
        else:
            staging = 2
        traffic = replace(
            traffic_for(
                self.profile, self.times.layers, (), choice.leaving, choice.target, choice.recompute
            ),
            host_bytes=choice.host_reserve,
        )
        io_bytes = pipeline_bytes = 0
        if self.config.nvme_path:  # [Note: storage tiers' host buffers]
            shard_bytes = 4 * int(-(-table.capacity.max(initial=0) // self.shard))
            chunk_bytes = 4 * int(table.capacity.max(initial=0))  # the bounce buffers' size
            per_node = self.hardware.ranks_per_node  # rank_config's share, as at setup
            io_bytes = storage_host_bytes(
                "nvme", self.config, transfer_bytes=chunk_bytes, ranks_per_node=per_node
            )
            pipeline_bytes = (
                storage_host_bytes(
                    "nvme",
                    self.config,
                    shard_bytes,
                    transfer_bytes=chunk_bytes,
                    ranks_per_node=per_node,
                )
                - io_bytes
            )
        return CostModel(
            Setting(
                table=table,
                trace=trace,
                rates=self.rates,
                payload=PayloadSpec(
                    precision=self.config.precision,
                    optimizer_states=self.config.optimizer_states,
                ),
                forward_s=self.times.forward_s,
                backward_s=self.times.backward,
                shard=self.shard,
                prefetch=self.config.prefetch,
                min_blocks=self.min_blocks(table),
                staging_blocks=staging,
                receive_block_numel=receive,
                optimizer_in_backward=self.optimizer_in_backward,
                activations=traffic,
                nvme_io_host_bytes=io_bytes,
                nvme_pipeline_host_bytes=pipeline_bytes,
                # [Note: speculation pricing]: what the engine adds around in-backward updates
                keep_grads_for_redo=(
                    self.clipping or self.rollback_rate > 0 or self.config.precision == "fp16"
                ),
                accumulation_steps=self.config.accumulation_steps or 1,
                rollback_rate=self.rollback_rate,
                # core's engine: host states in backward when the compute device is not the
                # CPU, or forced ([Note: host updates in backward])
                host_in_backward=self.optimizer_in_backward,
                host_budget=self.host_capacity,
                grads_in_device_home=self.grads_in_device_home,
                grads_in_nvme_home=self.grads_in_nvme_home,
            )
        )

    def score_sizes(self, choice: ActivationChoice, allowed: int | None):
        """Moved bytes per feasible chunk size (best first), and the least device bytes any
        candidate's minimum plan needs: of the lean candidates, or when none of them fits the
        budgets, of the grid sizes that pad more ([Note: chunk size choice])."""
        if isinstance(self.config.chunk_size, int):
            groups = [[self.config.chunk_size]]
        else:
            groups = _candidates(self.profile, self.rates.world_size)
        scores, least, too_few, host_errors, tried = [], None, [], [], 0
        for candidates in groups:
            if scores:
                break  # a lean size fits: padded ones are not tried
            tried += len(candidates)
            for size in candidates:
                model = self.model(size, choice)
                budgets = self.budgets(allowed, model.setting.table)
                try:
                    start = minimum_placement(model, budgets, self.forced)
                except PlacementError as err:  # the host budget cannot hold this minimum
                    host_errors.append(err)
                    continue
                s = model.setting
                cached = s.uses_rcache(start.param_tier)
                if cached.any() and start.n_blocks < self.min_blocks(s.table, cached):
                    too_few.append(self.min_blocks(s.table, cached))
                    continue
                need = model.memory(start).device
                least = need if least is None else min(least, need)
                if allowed is not None and need > allowed:
                    continue
                blocks = start.n_blocks
                if cached.any() and self.forced.n_blocks is None and allowed is not None:
                    block_bytes = s.block_numel * s.param_bytes
                    blocks = min(blocks + (allowed - need) // block_bytes, int(cached.sum()))
                fetches = model.fetches(start.with_blocks(blocks))
                moved = float((fetches * s.table.capacity).sum() * s.param_bytes)
                scores.append(SizeScore(size, moved, s.table.padding, int(blocks)))
        if len(host_errors) == tried:
            raise min(host_errors, key=lambda err: err.need - err.limit)
        if too_few and len(too_few) + len(host_errors) == tried:
            raise PlanError(
                f"cache_blocks={self.forced.n_blocks} is below this model's minimum of "
                f"{min(too_few)} rCache blocks (the most chunks in use at one moment of a step): "
                f'set cache_blocks >= {min(too_few)}, or leave it on "auto"'
            )
        scores.sort(key=lambda s: (s.moved_bytes, s.padding, s.chunk_size))
        return scores, least or 0

    def place(self, size: int, choice: ActivationChoice, allowed: int | None) -> tuple[Step, dict]:
        model = self.model(size, choice)
        budgets = self.budgets(allowed, model.setting.table)
        start = minimum_placement(model, budgets, self.forced)
        if allowed is None:
            budgets = replace(budgets, device=model.memory(start).device)
        final = greedy(model, start, budgets, self.forced)[-1]

        def evaluate(traffic: ActivationTraffic) -> Prediction:
            model.setting = replace(model.setting, activations=traffic)
            return model.predict(final.placement)

        room = self.activation_room(model.memory(final.placement).device)
        policy, traffic, prediction = best_split(
            self.profile, self.times.layers, choice, evaluate, room
        )
        model.setting = replace(model.setting, activations=traffic)
        return Step(final.placement, model.memory(final.placement), prediction, final.move), policy

    # -- one activation choice --------------------------------------------------------------
    def outcome(self, choice: ActivationChoice) -> Outcome:
        allowed = self.allowed(choice)
        try:
            scores, least = self.score_sizes(choice, allowed)
        except PlacementError as err:  # the host budget cannot hold even the minimum
            raise PlanError(str(err), tier=err.tier, need=err.need, limit=err.limit) from None
        if not scores:
            self._too_small(allowed, least, choice)
        tried = []
        for score in scores:  # see [Note: chunk size choice]
            step, policy = self.place(score.chunk_size, choice, allowed)
            tried.append((step.prediction.total, score.moved_bytes, score, step, policy))
        tried.sort(key=lambda t: (t[0], t[1]))
        _, _, score, step, policy = tried[0]
        ordered = [score] + [s for s in scores if s is not score]
        rejected = [(t[2], t[3].prediction) for t in tried[1:]]
        table, _ = self.layout(score.chunk_size)
        return Outcome(
            choice, table, step, step.prediction, policy, allowed or 0, ordered, rejected
        )

    def _too_small(self, allowed: int, least: int, choice: ActivationChoice):
        forced = [
            f"{name}={getattr(self.config, name)!r}"
            for name in ("param_placement", "optimizer_placement", "cache_blocks", "chunk_size")
            if getattr(self.config, name) != "auto"
        ]
        plan = f"the smallest plan{' with ' + ', '.join(forced) if forced else ''}"
        if self.config.device_memory is not None:
            raise PlanError(
                f"device memory binds: {plan} needs {format_gib(least)} of model data on the "
                f"device (rCache blocks for the widest module or checkpoint block, and whatever "
                f"is forced there), device_memory allows {format_gib(allowed)}: "
                f"{format_gib(least - allowed)} short; raise device_memory"
                + (" or relax the forced settings" if forced else " or use a smaller chunk_size"),
                tier="device",
                need=least,
                limit=allowed,
            )
        capacity = _capacity_for(least, self.profile, choice.device_bytes, self.config)
        have = self.hardware.device_memory
        raise PlanError(
            f"device memory binds: {plan} needs a device of {format_gib(capacity)} ("
            f"{format_gib(least)} of model data / F_alloc {self.config.alloc_fraction} + buffers "
            f"{format_gib(self.profile.buffer_bytes)} + {self.config.frag_factor} x activations "
            f"{format_gib(choice.device_bytes)} {_activations_at(choice)}), the device has "
            f"{format_gib(have)}: "
            f"{format_gib(capacity - have)} short; use a larger device or more of them, or shrink "
            "activations (batch, sequence length, activation checkpointing or offload)",
            tier="device",
            need=capacity,
            limit=have,
        )


def _activations_at(choice: ActivationChoice) -> str:
    """Which policy the activations are counted under and the moment they peak."""
    peak = choice.peak
    return f"({choice.name}: peak at {peak.moment})"


def _counts(tiers: list[str]) -> str:
    return ", ".join(f"{n}x{t}" for t, n in Counter(tiers).items())


def search_plan(
    profile: Profile,
    hardware: Hardware,
    config: Config,
    *,
    gradient_staging: str = "engine",
    clipping: bool = False,
    rollback_rate: float = 0.0,
) -> Plan:
    """The plan the search predicts fastest (see the module docstring). ``clipping``: the run
    clips gradients (in-backward NVMe updates then keep their gradients on disk for a redo);
    ``rollback_rate``: the expected share of steps whose speculative updates are rolled back
    (core's ``SpeculationPolicy`` keeps it low; [Note: speculation pricing]). A host refusal
    names the least host budget that plans ([Note: the stated host minimum is a fixed point])."""
    options = dict(
        gradient_staging=gradient_staging, clipping=clipping, rollback_rate=rollback_rate
    )
    search = _Search(profile, hardware, config, **options)
    try:
        return _search_plan(search)
    except PlanError as err:
        if err.tier != "host" or err.need is None or config.host_memory is None:
            raise
        per_node = search.rates.ranks_per_node  # the budget is the node's, the need a rank's
        budget = least_host_budget(
            lambda need: _search_plan(
                _Search(profile, hardware, replace(config, host_memory=need * per_node), **options)
            ),
            err.need,
        )
        # [Note: a rank's host share]: the refusal names the node's budget
        raise in_node_units(restated(err, budget), config.host_memory, per_node) from None


def _search_plan(search: _Search) -> Plan:
    """``search_plan`` at ``search``'s budgets, its refusals as the search states them."""
    profile, config = search.profile, search.config
    choices = activation_choices(
        profile,
        search.times.layers,
        offload=config.activation_offload,
        checkpointing=config.activation_checkpointing,
        nvme=config.nvme_path is not None,
    )
    outcomes, errors = _outcomes(search, choices)
    if _device_home_variant_may_help(search, outcomes):
        # [Note: the 14-byte device home]: the 16-byte plan keeps model data off the device
        # (or fits nowhere); the variant is searched the same way and kept when predicted faster
        variant = copy.copy(search)
        variant.grads_in_device_home, variant.reasons = True, list(search.reasons)
        in_home, in_home_errors = _outcomes(variant, choices)
        if in_home and (not outcomes or in_home[0].prediction.total < outcomes[0].prediction.total):
            variant.reasons.append(
                "gradients kept in the device homes (14 bytes per element): "
                + (
                    "the 16-byte plan does not fit"
                    if not outcomes
                    else f"predicted {in_home[0].prediction.total:.4g} s vs "
                    f"{outcomes[0].prediction.total:.4g} s with 16 bytes per element"
                )
            )
            search, outcomes = variant, in_home
        errors += in_home_errors
    if not outcomes and config.precision != "fp32" and config.nvme_path is not None:
        # [Note: the 14-byte NVMe home]: no 16-byte plan fits; NVMe homes over host states
        # keep their gradients (2 host bytes per element fewer), searched the same way
        variant = copy.copy(search)
        variant.grads_in_nvme_home, variant.reasons = True, list(search.reasons)
        outcomes, nvme_home_errors = _outcomes(variant, choices)
        if outcomes:
            search = variant
            search.reasons.append(
                "gradients kept in the NVMe homes over host states (14 bytes per element): the "
                "16-byte plan does not fit"
            )
        errors += nvme_home_errors
    if not outcomes:
        # the smallest plan is that of the activation choice needing least: swapping and
        # recomputing are ways to fit, so a refusal quotes the one that comes closest
        raise min(errors, key=_shortfall)
    return _to_plan(search, outcomes[0], outcomes[1:])


def _outcomes(search: _Search, choices) -> tuple[list[Outcome], list[PlanError]]:
    """The outcome of each activation choice that fits (fastest first), the others' errors."""
    outcomes: list[Outcome] = []
    errors: list[PlanError] = []
    for choice in choices:
        try:
            outcomes.append(search.outcome(choice))
        except PlanError as err:
            errors.append(err)
    outcomes.sort(key=lambda o: o.prediction.total)
    return outcomes, errors


def _device_home_variant_may_help(search: _Search, outcomes: list[Outcome]) -> bool:
    """One rank in bf16/fp16 whose best 16-byte plan leaves model data off the device."""
    if search.config.precision == "fp32" or search.rates.world_size > 1:
        return False
    if not outcomes:
        return True
    placement, trainable = outcomes[0].step.placement, outcomes[0].table.trainable
    return bool(
        (placement.param_tier != DEVICE).any() or (placement.optim_tier[trainable] != DEVICE).any()
    )


def _shortfall(err: PlanError) -> float:
    """How far a refused choice is from fitting, as a share of its binding tier's limit."""
    if err.need is None or not err.limit:
        return float("inf")
    return (err.need - err.limit) / err.limit


def _host_update_reasons(search: _Search, best: Outcome) -> list[str]:
    """Where host-resident optimizer updates run, and why ([Note: speculation pricing])."""
    model = search.model(best.table.chunk_size, best.choice)
    placement = best.step.placement
    s = model.setting
    host = s.table.trainable & (placement.optim_tier == TIERS.index("host"))
    if not (host.any() and s.host_in_backward and not s.rates.device_is_host):
        return []
    early = model.host_early(placement)
    copies = sum(s.payload.state_bytes(int(n)) for n in s.shard_sizes[early])
    if early.all() or early[host].all():
        return [
            f"host optimizer updates: all {int(host.sum())} chunks in backward (undo copies "
            f"{format_bytes(copies)} fit in host memory)"
        ]
    return [
        f"host optimizer updates: {int(early.sum())} of {int(host.sum())} chunks in backward, "
        "the others after backward: host_memory has no room for their undo copies (undo "
        f"copies held: {format_bytes(copies)})"
    ]


def _to_plan(search: _Search, best: Outcome, other: list[Outcome]) -> Plan:
    config, table, placement = search.config, best.table, best.step.placement
    param_tiers: dict[str, list[str]] = {}
    optim_tiers: dict[str, list[str]] = {}
    for chunk, group in enumerate(table.group_of_chunk):
        param_tiers.setdefault(group, []).append(TIERS[placement.param_tier[chunk]])
        if table.trainable[chunk]:  # a frozen chunk has no optimizer states
            optim_tiers.setdefault(group, []).append(TIERS[placement.optim_tier[chunk]])
    all_params = [t for tiers in param_tiers.values() for t in tiers]
    all_optims = [t for tiers in optim_tiers.values() for t in tiers]
    n_device = all_params.count("device")
    memory = best.step.memory
    uses_rcache = search.shard > 1 or n_device < table.n_chunks or search.grads_in_device_home
    # [Note: one source] the explanation quotes the values the Plan carries (the table prints
    # the same fields): cache_blocks and the bytes moved by the final placement, never the
    # intermediate figures the chunk-size scoring saw
    cache_blocks = int(placement.n_blocks) if uses_rcache else 0
    moved = float((best.prediction.fetches * table.capacity).sum() * search.param_bytes)
    how = (
        "forced"
        if isinstance(config.chunk_size, int)
        else f"fastest of {len(best.sizes)} sizes that fit, each placed in full"
    )
    reasons = [
        f"allowed device memory U = {format_bytes(best.allowed_device)} "
        f"(F_alloc={config.alloc_fraction}, F_frag={config.frag_factor}, activations "
        f"{format_bytes(best.choice.device_bytes)}, buffers {format_bytes(search.profile.buffer_bytes)})",
        f"chunk size {table.chunk_size:,} ({how}), padding {best.sizes[0].padding:,} elements",
        f"{cache_blocks} rCache blocks, {n_device}/{table.n_chunks} chunks on the device, "
        f"{format_bytes(moved)} fetched into the rCache per step; params {_counts(all_params)}; "
        f"optimizer {_counts(all_optims)}",
        f"model data per rank: device {format_bytes(memory.device)}, host "
        f"{format_bytes(memory.host)}, nvme {format_bytes(memory.nvme)}; per node "
        f"({search.rates.ranks_per_node} ranks): device {format_bytes(memory.device * search.rates.ranks_per_node)}, "
        f"host {format_bytes(memory.host * search.rates.ranks_per_node)}, nvme "
        f"{format_bytes(memory.nvme * search.rates.ranks_per_node)}; host also holds "
        f"{format_bytes(search.io_bytes(table))} of load/save buffers while weights load or save",
        f"activations: {best.choice.name}; {_counts(list(best.policy.values())) or 'no blocks profiled'}",
    ]
    reasons += _host_update_reasons(search, best)
    reasons += block_reasons(search.profile, search.times.layers, best.choice, best.policy)
    used = {
        "h2d_bandwidth",
        "d2h_bandwidth",
        "device_adam_velocity",
        "host_adam_velocity",
        "device_flops",
    }
    if not search.profile.layer_forward_s:  # measured times need no rates
        used |= {"matmul_efficiency", "device_memory_bandwidth"}
    if config.nvme_path:
        used |= {"nvme_read_bandwidth", "nvme_write_bandwidth"}
    if search.rates.world_size > 1:
        used.add("interconnect_bandwidth")
    reasons += [line for name, line in search.rates.fallbacks.items() if name in used]
    reasons += search.reasons
    alternatives = []
    for score, prediction in best.rejected[:3]:
        alternatives.append(
            {
                "summary": f"chunk size {score.chunk_size:,}",
                "predicted_s": prediction.total,
                "why": f"predicted {prediction.total:.4g} s vs {best.prediction.total:.4g} s",
            }
        )
    for outcome in other:
        alternatives.append(
            {
                "summary": f"activations: {outcome.choice.name}",
                "predicted_s": outcome.prediction.total,
                "why": f"predicted {outcome.prediction.total:.4g} s vs {best.prediction.total:.4g} s",
            }
        )
    total_s = best.prediction.total
    predicted_s = best.prediction.seconds
    if search.times.forward_s <= 0 and search.profile.source == "static":
        # setup() without an example batch: no compute known, a step time would be made up
        predicted_s, total_s = {}, 0.0
        reasons.append(
            "no step-time prediction: the profile has no batch shape (setup() got no "
            "example_batch); setup(model, optimizer, example_batch=batch) profiles one step and "
            "predicts it"
        )
    step_flops = (1 + BACKWARD_OVER_FORWARD) * sum(search.profile.layer_flops.values())
    tokens = (search.profile.batch_size or 0) * (search.profile.seq_len or 0)
    return Plan(
        chunk_size=table.chunk_size,
        cache_blocks=cache_blocks,
        prefetch=config.prefetch,
        param_tier=Counter(all_params).most_common(1)[0][0] if all_params else "device",
        optim_tier=Counter(all_optims).most_common(1)[0][0] if all_optims else "device",
        param_tiers=param_tiers,
        optim_tiers=optim_tiers,
        shard=config.shard,
        grads_in_device_home=search.grads_in_device_home,
        grads_in_nvme_home=search.grads_in_nvme_home
        and bool(
            (
                table.trainable
                & (placement.param_tier == TIERS.index("nvme"))
                & (placement.optim_tier == TIERS.index("host"))
            ).any()
        ),
        activation_checkpointing=config.activation_checkpointing,
        activation_policy=best.policy,
        activation_allowance=(
            int(config.frag_factor * activation_peak(search.profile, best.policy).peak_bytes)
            if config.device_memory is None
            and search.hardware.device_memory is not None
            and search.profile.peak_activation_bytes > 0  # activations profiled
            else None
        ),
        predicted_step_s=predicted_s,
        predicted_bytes=best.prediction.bytes,
        predicted_tflops=step_flops / total_s / 1e12 if step_flops and total_s > 0 else None,
        predicted_tokens_per_s=(
            tokens * search.rates.world_size / total_s if tokens and total_s > 0 else None
        ),
        device_allowance=int(memory.device),
        host_need=int(memory.host),
        io_buffer_bytes=search.io_bytes(table),
        planner="search",
        reasons=reasons,
        alternatives=alternatives,
    )


__all__ = ["GRADIENT_STAGING", "chunk_size_candidates", "search_plan"]
