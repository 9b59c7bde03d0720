"""Plan: where model data lives and how it moves. It never changes the arithmetic (Invariant 1)."""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tierwise.jsonable import JsonDataclass
from tierwise.units import format_bytes

ACTIVATION_ACTIONS = ("keep", "recompute", "host", "nvme", "recompute_host", "recompute_nvme")
"""What may happen to a transformer block's saved activations (``Config.activation_policy``):
kept, recomputed from its inputs kept on the device, swapped to the host or nvme tier, or
recomputed from its inputs swapped to the host or nvme tier (LoHan's scheme)."""
RECOMPUTE_ACTIONS = ("recompute", "recompute_host", "recompute_nvme")
"""The actions that re-run a block's forward in its backward."""


def swap_target(action: str) -> str | None:
    """The tier ``action`` swaps a block's saved tensors (or, recomputing, its inputs) to:
    "host", "nvme", or None for the actions that keep them on the device."""
    return {"host": "host", "nvme": "nvme", "recompute_host": "host", "recompute_nvme": "nvme"}.get(
        action
    )


def check_policy_entries(policy: Any) -> str | None:
    """What is wrong with a ``Config.activation_policy`` value, or None."""
    if not isinstance(policy, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in policy.items()
    ):
        return 'give a dict of block name or pattern to action, e.g. {"model.layers.*": "host"}'
    for pattern, action in policy.items():
        if action not in ACTIVATION_ACTIONS:
            return f"{pattern!r} -> {action!r}: choose one of {', '.join(ACTIVATION_ACTIONS)}"
    return None


class ActivationPolicyError(ValueError):
    """An activation policy names blocks that do not exist or an action that cannot run."""


def plan_action(block: str, plan_policy: dict[str, str]) -> str | None:
    """The plan's action for ``block``: its own entry, else the most common one among entries
    of modules inside it (a profile can be per innermost module)."""
    if block in plan_policy:
        return plan_policy[block]
    inner = [a for name, a in plan_policy.items() if name.startswith(block + ".")]
    return Counter(inner).most_common(1)[0][0] if inner else None


def resolve_policy(
    blocks: list[str],
    *,
    policy: dict[str, str] | None,
    offload: str,
    checkpointing: bool,
    plan_policy: dict[str, str] | None = None,
) -> dict[str, str]:
    """Action per block, in this order of precedence: ``policy`` (name or fnmatch pattern ->
    action; a later entry wins over an earlier one for the same block), then ``offload``
    "host"/"nvme" (every block), then ``checkpointing`` (every block recomputed), then for
    ``offload="auto"`` the plan's per-layer policy; anything left is kept."""
    if offload in ("host", "nvme"):
        default = {b: offload for b in blocks}
    elif checkpointing:
        default = {b: "recompute" for b in blocks}
    elif offload == "auto":
        default = {b: plan_action(b, plan_policy or {}) or "keep" for b in blocks}
    else:
        default = {b: "keep" for b in blocks}
    for pattern, action in (policy or {}).items():
        matched = [b for b in blocks if b == pattern or fnmatch.fnmatchcase(b, pattern)]
        if not matched:
            shown = ", ".join(blocks) if blocks else "none found"
            raise ActivationPolicyError(
                f"Config.activation_policy: {pattern!r} matches no transformer block; the blocks "
                f"are: {shown}"
            )
        for block in matched:
            default[block] = action
    return default


class PlanError(ValueError):
    """The requested plan cannot fit or is inconsistent; the message says the limit.

    When a memory tier is what binds, ``tier`` names it ("device", "host" or "nvme") and ``need``
    and ``limit`` are the bytes the smallest plan needs there and the bytes there are."""

    def __init__(
        self,
        message: str,
        *,
        tier: str | None = None,
        need: int | None = None,
        limit: int | None = None,
    ) -> None:
        super().__init__(message)
        self.tier, self.need, self.limit = tier, need, limit

    @property
    def shortfall(self) -> int | None:
        """Bytes missing on the binding tier (None when no tier binds)."""
        if self.need is None or self.limit is None:
            return None
        return max(0, self.need - self.limit)


LOAD_PIECE = 1 << 22
"""Elements converted and written at a time when filling chunks from pretrained weights
([Note: loading pretrained weights])."""


# [Note: load/save buffers are not held through training]
# Loading pretrained weights (setup) and ``save_pretrained`` take host buffers of
# ``Plan.io_buffer_bytes`` from the host tier while they run and give them back. A plan's host
# need is what training holds, so both planners check the model data alone against
# ``host_memory`` and report the buffers beside it; when the budget has no room for them beside
# the model data the plan says so in a reason. A run that loads weights, or says it saves
# (Config.saves_weights), is refused at plan time instead ([Note: the weight load checked at plan
# time]); an unannounced save that finds no room refuses at its call, before anything is written.


def io_buffer_bytes(largest_numel: int, chunk_numel: int) -> int:
    """``Plan.io_buffer_bytes`` for a model whose largest parameter has ``largest_numel``
    elements and whose largest chunk ``chunk_numel``: that parameter twice in fp32 (the buffer
    read, its conversion), two load pieces (fp32 and the compute copy) and one gathered chunk
    in fp32."""
    return 2 * largest_numel * 4 + min(LOAD_PIECE, largest_numel) * 8 + chunk_numel * 4


def load_buffer_minimum(
    wanted: int, largest_numel: int, itemsize: int, *, piece: int | None = None
) -> int:
    """The least host bytes loading pretrained weights runs in ([Note: load buffers fit the room
    left] in tierwise.runtime.setup.weight_fill): two pieces of ``piece`` elements of the
    largest parameter (``largest_numel``), each the values read, the fp32 master's copy and the
    home's copy at ``itemsize`` bytes, or the whole buffers (``wanted``, ``Plan.io_buffer_bytes``)
    when smaller. The loader and the plan-time check ([Note: the weight load checked at plan
    time] in tierwise.planning.host_minimum) both use this; ``piece`` None: LOAD_PIECE."""
    piece = LOAD_PIECE if piece is None else piece
    return min(wanted, 2 * min(piece, largest_numel) * (4 + 4 + itemsize))


def save_buffer_bytes(io_buffer_bytes: int | None) -> int:
    """Host bytes ``save_pretrained`` takes from the host tier while it runs: the whole load/save
    buffers (``io_buffer_bytes``, ``Plan.io_buffer_bytes``; it has no smaller mode, unlike the
    load). The saver reserves this and the plan-time check ([Note: the weight load checked at
    plan time] in tierwise.planning.host_minimum) counts it."""
    return io_buffer_bytes or 0


def fill_io_buffer_bytes(plan: Plan, profile) -> None:
    """Set ``plan.io_buffer_bytes`` from ``profile`` when the planner left it unset (an estimate:
    setup sets the exact figure after layout)."""
    if plan.io_buffer_bytes is None:
        largest = max((p.numel for p in profile.params), default=0)
        plan.io_buffer_bytes = io_buffer_bytes(largest, max(plan.chunk_size, largest))


@dataclass(kw_only=True)
class Plan(JsonDataclass):
    """A training plan. Chunk groups are named by ``ChunkGroup.name``; per-chunk tier lists are
    indexed like the group's chunks (missing entries take the defaults)."""

    chunk_size: int
    """Elements per chunk (a parameter larger than this gets a chunk of its own)."""
    cache_blocks: int
    """rCache blocks on the device for chunks whose home is a lower tier."""
    prefetch: int = 2
    """Chunks fetched ahead of use."""
    param_tier: str = "device"
    """Default home tier of parameter chunks."""
    optim_tier: str = "device"
    """Default tier of fp32 master and Adam states."""
    param_tiers: dict[str, list[str]] = field(default_factory=dict)
    """Per chunk group, the home tier of each parameter chunk (overrides ``param_tier``)."""
    optim_tiers: dict[str, list[str]] = field(default_factory=dict)
    """Per chunk group, the tier of each chunk's optimizer states (overrides ``optim_tier``)."""
    shard: bool = True
    """Shard chunks across data-parallel ranks (False: replicate, all-reduce gradients)."""
    grads_in_device_home: bool = False
    """bf16/fp16, unsharded chunks (one rank): a trainable chunk whose home is on the device
    keeps its gradients in that home and computes in an rCache block, 14 bytes per element
    instead of 16 ([Note: the 14-byte device home] in ``chunks/payload.py``). Planners choose it
    when the 16-byte plan does not fit the device."""
    grads_in_nvme_home: bool = False
    """bf16/fp16: a trainable chunk whose home is on a storage tier (NVMe) and whose optimizer
    states are in host memory keeps its gradients in that home, through the host gradient
    buffers, 14 bytes per element instead of 16 ([Note: the 14-byte NVMe home] in
    ``chunks/payload.py``). Planners choose it when the 16-byte plan does not fit host memory."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward."""
    activation_policy: dict[str, str] = field(default_factory=dict)
    """Per transformer block (or layer, or fnmatch pattern, as planners give it): one of
    ``ACTIVATION_ACTIONS``. After setup: the action each block runs with."""
    activation_allowance: int | None = None
    """Bytes of saved activations the plan lets stay on the compute device (Invariant 4: the
    warm-up forward measures them); None: not bounded by the plan."""
    predicted_step_s: dict[str, float] = field(default_factory=dict)
    """Predicted step-time breakdown in seconds (compute, h2d, d2h, nvme_read, nvme_write,
    optimizer, comm, total; compute split into forward, backward and recompute)."""
    predicted_bytes: dict[str, float] = field(default_factory=dict)
    """Predicted bytes one step moves per link (h2d, d2h, nvme_read, nvme_write, comm), for
    checking a plan against a measured step (``tierwise plan --validate``)."""
    predicted_tflops: float | None = None
    """Predicted model TFLOP/s per rank: forward and backward FLOPs of one step (recomputation
    not counted) over the predicted step time."""
    predicted_tokens_per_s: float | None = None
    """Predicted training tokens per second over all ranks."""
    device_allowance: int | None = None
    """Bytes of model data the compute tier may hold (Invariant 4)."""
    host_need: int | None = None
    """Host bytes the plan holds in the host tier through training: host model data, gradient
    buffers and the storage tiers' host buffers (the figure checked against ``host_memory``);
    None: the planner did not say."""
    io_buffer_bytes: int | None = None
    """Host bytes that loading pretrained weights into the chunks (``setup(weights=...)``) and
    streaming them out (``save_pretrained``) hold beside the tiers' data, reserved on the host
    tier while they run: the largest parameter read and converted (two fp32-sized copies),
    the conversion pieces, one gathered chunk in fp32. Set by setup after layout."""
    groups: dict[str, dict] = field(default_factory=dict)
    """Per chunk group, filled by the engine after layout: its parallel ``pattern``, ``dp_size``
    (ranks its chunks are sharded over), ``chunks`` and the tiers of its chunks."""
    planner: str = "core"
    """Which planner made it."""
    reasons: list[str] = field(default_factory=list)
    """Why the planner chose this, one line each."""
    alternatives: list[dict] = field(default_factory=list)
    """Runner-up plans the planner rejected: {"summary": ..., "predicted_s": ..., "why": ...}."""

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise PlanError(f"Plan.chunk_size={self.chunk_size}: must be positive")
        if self.cache_blocks < 0:
            raise PlanError(f"Plan.cache_blocks={self.cache_blocks}: must be ≥ 0")
        for tier in self.tier_names():
            if not isinstance(tier, str) or not tier:
                raise PlanError(f"Plan tier {tier!r}: give the name of a registered tier")
        for action in self.activation_policy.values():
            if action not in ACTIVATION_ACTIONS:
                raise PlanError(
                    f"activation action {action!r}: choose one of {', '.join(ACTIVATION_ACTIONS)}"
                )

    def tier_names(self) -> set[str]:
        """Every tier this plan names (defaults and per-chunk entries)."""
        names = {self.param_tier, self.optim_tier}
        for tiers in (*self.param_tiers.values(), *self.optim_tiers.values()):
            names.update(tiers)
        return names

    def check_tiers(self, registered) -> None:
        """Refuse a plan naming a tier no installed plugin registers (``registered``: the tier
        names of the plugin host), before anything is allocated: a plugin's tier may be a
        plan's default as well as any chunk's."""
        unknown = sorted(self.tier_names() - set(registered))
        if unknown:
            raise PlanError(
                f"the plan puts data on the {unknown[0]!r} tier, which no installed plugin "
                f"provides; registered tiers: {', '.join(sorted(registered))}"
                + (" (install tierwise-nvme for 'nvme')" if unknown[0] == "nvme" else "")
            )

    def param_tier_of(self, group: str, index: int) -> str:
        tiers = self.param_tiers.get(group, ())
        return tiers[index] if index < len(tiers) else self.param_tier

    def optim_tier_of(self, group: str, index: int) -> str:
        tiers = self.optim_tiers.get(group, ())
        return tiers[index] if index < len(tiers) else self.optim_tier

    def table(self) -> str:
        """A human-readable table of the plan."""
        rows = [
            ("planner", self.planner),
            ("chunk size", f"{self.chunk_size:,} elements"),
            ("rCache blocks", str(self.cache_blocks)),
            ("prefetch", str(self.prefetch)),
            ("params home (default)", self.param_tier),
            ("optimizer states (default)", self.optim_tier),
            ("shard across ranks", str(self.shard)),
            ("activation checkpointing", str(self.activation_checkpointing)),
        ]
        if self.grads_in_device_home:
            rows.append(("gradients in device homes", "yes (14 bytes per element)"))
        if self.grads_in_nvme_home:
            rows.append(("gradients in nvme homes", "yes (14 bytes per element)"))
        if self.device_allowance is not None:
            rows.append(("device allowance", format_bytes(self.device_allowance)))
        if self.io_buffer_bytes is not None:
            rows.append(("load/save buffers (host)", format_bytes(self.io_buffer_bytes)))
        for group in sorted(set(self.param_tiers) | set(self.optim_tiers) | set(self.groups)):
            info = self.groups.get(group, {})
            n = info.get("chunks", 0)
            p = self.param_tiers.get(group) or [self.param_tier] * n
            o = self.optim_tiers.get(group) or (
                [self.optim_tier] * n if info.get("trainable", True) else []
            )
            where = f"params {_count(p)} | optimizer {_count(o)}"
            if info:
                where = f"pattern {info['pattern']}, DP {info['dp_size']}, {n} chunks | {where}"
            rows.append((f"group {group}", where))
        if self.activation_policy:
            rows.append(("activations", _count(list(self.activation_policy.values()))))
            lines = [f"{name}\t{action}" for name, action in self.activation_policy.items()]
            for line in collapse_runs(lines):
                name, _, action = line.partition("\t")
                rows.append((f"  {name}", action))
        if self.activation_allowance is not None:
            rows.append(("activation allowance", format_bytes(self.activation_allowance)))
        for key, value in self.predicted_step_s.items():
            rows.append((f"predicted {key}", f"{value * 1e3:.4g} ms"))
        if not self.predicted_step_s and self.planner != "core":
            rows.append(("predicted step", "- (no batch shape: give setup() an example_batch)"))
        if self.predicted_tflops is not None:
            rows.append(("predicted TFLOPS per rank", f"{self.predicted_tflops:.1f}"))
        if self.predicted_tokens_per_s is not None:
            rows.append(("predicted tokens/s", f"{self.predicted_tokens_per_s:,.0f}"))
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines += [f"  why: {r}" for r in collapse_runs(self.reasons)]
        for alt in self.alternatives:
            lines.append(f"  rejected: {alt.get('summary', '?')} — {alt.get('why', '')}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def collapse_runs(lines: list[str]) -> list[str]:
    """Consecutive lines that differ only in one number counting up by one (the same text for
    ``model.layers.0`` .. ``model.layers.31``) as one line with the range: "model.layers.0–31
    keep". Lines differing in anything else stay apart."""
    runs: list[dict[str, Any]] = []
    for line in lines:
        parts, numbers = _NUMBER.split(line), _NUMBER.findall(line)
        run = runs[-1] if runs else None
        if run is not None and run["parts"] == parts and len(run["last"]) == len(numbers):
            differ = [
                i for i, (a, b) in enumerate(zip(run["last"], numbers, strict=True)) if a != b
            ]
            if (
                len(differ) == 1
                and run["index"] in (None, differ[0])
                and numbers[differ[0]].isdigit()
                and run["last"][differ[0]].isdigit()
                and int(numbers[differ[0]]) == int(run["last"][differ[0]]) + 1
            ):
                run.update(index=differ[0], last=numbers)
                continue
        runs.append(
            {"line": line, "parts": parts, "first": numbers, "last": numbers, "index": None}
        )
    out = []
    for run in runs:
        if run["index"] is None:
            out.append(run["line"])
            continue
        numbers = list(run["first"])
        numbers[run["index"]] += "–" + run["last"][run["index"]]
        out.append("".join(p + n for p, n in zip(run["parts"], [*numbers, ""], strict=True)))
    return out


def _count(tiers: list[str]) -> str:
    counts: dict[str, int] = {}
    for tier in tiers:
        counts[tier] = counts.get(tier, 0) + 1
    return ", ".join(f"{n}×{t}" for t, n in counts.items()) or "-"
