"""Config: what the user wants, validated up front with messages that say what to change.

``Config`` is flat for its users (every field is a ``tierwise.setup`` keyword, a ``Config(...)``
argument, a TOML/JSON key and an attribute: ``config.chunk_size``), and made of policies, one per
concern, each a frozen kw-only dataclass that declares its fields and validates them:
:class:`PrecisionPolicy`, :class:`PlacementPolicy`, :class:`MemoryPolicy`,
:class:`ActivationsPolicy`, :class:`ParallelPolicy`, :class:`OverlapPolicy`, and
:class:`PluginSettings` (keys that plugins own and validate). ``Config`` inherits them all, so it
*is* each policy; ``config.placement`` (and the others) hands out one policy alone. A policy built
with its defaults is the base behaviour: nothing offloaded, overlapped or parallel that the plan
does not choose.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from tierwise.plan import check_policy_entries, swap_target
from tierwise.precision import PRECISIONS, STATE_PRECISIONS
from tierwise.units import parse_bytes

PLACEMENTS = ("auto", "device", "host", "nvme")
REDUCE_ORDERS = ("fast", "rank")
ACTIVATION_OFFLOADS = ("none", "host", "nvme", "auto")
OPTIMIZER_OVERLAPS = ("auto", "in-backward", "after-backward")
OWNER = "owner"
"""Key of a :class:`PluginSettings` field's metadata: the distribution that owns the setting."""


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ConfigError(ValueError):
    """A Config field has a value tierwise cannot use; the message says what to change."""

    @classmethod
    def for_field(cls, name: str, value: Any, message: str) -> ConfigError:
        """The error for one field: ``Config.<name>=<value>: <what to change>`` (every policy's
        field, a plugin's setting included, is a Config field to the user)."""
        return cls(f"Config.{name}={value!r}: {message}")


def _refuse(policy: Any, name: str, message: str) -> NoReturn:
    raise ConfigError.for_field(name, getattr(policy, name), message)


def _is_count(value: Any, *, least: int) -> bool:
    """An int (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """Number formats: of compute, of the model's inputs at the root, of the Adam moments."""

    precision: str = "bf16"
    """Compute precision of parameters and gradients: "bf16" (default), "fp16" (with dynamic
    loss scaling) or "fp32". Master weights and Adam states are always fp32."""

    cast_forward_inputs: bool = True
    """Cast floating-point tensors among the model's forward inputs to the compute precision
    (bf16/fp16) at the root module, as FSDP2's ``MixedPrecisionPolicy`` does by default, so a
    float32 input (``inputs_embeds``, pixel values) meets bf16/fp16 weights. Integer inputs
    (token ids, masks) are left alone; with "fp32" nothing is cast. False passes inputs as given."""

    optimizer_states: str = "fp32"
    """Precision the Adam moments (exp_avg, exp_avg_sq) are stored in: "fp32" (default, the
    same values as torch's AdamW), "bf16" (half the bytes), or "int8" (8-bit codes with a
    scale per 256-element block, as torchao's AdamW8bit: about a quarter). The fp32 master
    copy stays fp32; updates run in fp32 ([Note: low-bit optimizer states])."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            _refuse(self, "precision", f"choose one of {', '.join(PRECISIONS)}")
        if not isinstance(self.cast_forward_inputs, bool):
            _refuse(self, "cast_forward_inputs", "give True or False")
        if self.optimizer_states not in STATE_PRECISIONS:
            _refuse(self, "optimizer_states", f"choose one of {', '.join(STATE_PRECISIONS)}")


@dataclass(frozen=True, kw_only=True)
class PlacementPolicy:
    """Where model data lives and how it is cut: the device, chunks, rCache, home tiers."""

    device: str = field(default_factory=_default_device)
    """The compute device ("cuda", "cuda:1", "cpu"). Default: cuda if available, else cpu."""

    chunk_size: int | str = "auto"
    """Elements per chunk, or "auto" (the planner chooses)."""

    cache_blocks: int | str = "auto"
    """Number of rCache blocks on the device for chunks whose home is a lower tier, or "auto"."""

    param_placement: str = "auto"
    """Home tier of parameter chunks: "auto" | "device" | "host" | "nvme"."""

    optimizer_placement: str = "auto"
    """Tier holding fp32 master weights and Adam states: "auto" | "device" | "host" | "nvme"."""

    prefetch: int = 2
    """How many chunks to fetch ahead of use, following the recorded access order."""

    def __post_init__(self) -> None:
        try:
            import torch

            torch.device(self.device)
        except (RuntimeError, TypeError):
            _refuse(self, "device", "not a torch device; use e.g. 'cuda', 'cuda:0' or 'cpu'")
        if self.chunk_size != "auto" and not _is_count(self.chunk_size, least=1):
            _refuse(self, "chunk_size", 'give a positive number of elements or "auto"')
        if self.cache_blocks != "auto" and not _is_count(self.cache_blocks, least=0):
            _refuse(self, "cache_blocks", 'give a number of blocks ≥ 0 or "auto"')
        for name in ("param_placement", "optimizer_placement"):
            if getattr(self, name) not in PLACEMENTS:
                _refuse(self, name, f"choose one of {', '.join(PLACEMENTS)}")
        if not _is_count(self.prefetch, least=0):
            _refuse(self, "prefetch", "give a number of chunks ≥ 0")


@dataclass(frozen=True, kw_only=True)
class MemoryPolicy:
    """Byte budgets, and the planner's margins against what the device has."""

    device_memory: int | str | None = None
    """Byte budget for model data on the compute device (int or "8GiB"); None = what it has."""

    host_memory: int | str | None = None
    """Byte budget for model data in host RAM (int or "64GiB"); None = what the machine has.
    The node's: its ranks share it. Each rank plans and runs with ``host_memory //
    ranks_per_node`` (its host tier's budget; the storage tiers' host pools are sized against
    it), and a host refusal names the node's budget ([Note: a rank's host share] in
    tierwise.planning.host_share)."""

    pinned_memory: int | str | None = None
    """Bytes of page-locked host memory (int or "1GiB") for the activation swaps' host buffers on
    CUDA, each rank's, counted in its share of ``host_memory`` (only copies from page-locked memory overlap compute; a
    swap that finds the budget full goes through pageable memory, whose copies block, and says
    so once). None: 1 GiB. Without CUDA nothing is pinned and this is not used. The host tier's
    own slabs are page-locked on CUDA too, each counted at its exact size."""

    alloc_fraction: float = 0.95
    """F_alloc: fraction of free device memory the planner may use for model data."""

    frag_factor: float = 1.25
    """F_frag: activation memory is multiplied by this to account for fragmentation."""

    saves_weights: bool = False
    """The run calls ``save_pretrained``: setup then refuses, before any model data is built, a
    ``host_memory`` without room for the save buffers beside what the plan holds in host memory
    ([Note: the weight load checked at plan time]). Without it the save checks at its call.
    TierwiseTrainer sets it unless told otherwise (a Trainer's checkpoints and ``save_model``
    call ``save_pretrained``)."""

    def __post_init__(self) -> None:
        for name in ("device_memory", "host_memory", "pinned_memory"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                object.__setattr__(self, name, parse_bytes(value, what=name))
            except ValueError as err:
                raise ConfigError(f"Config.{err}") from None
            if getattr(self, name) == 0:
                where = "the device" if name == "device_memory" else "host RAM"
                _refuse(
                    self,
                    name,
                    f"a budget of 0 bytes leaves no room for model data in {where}; give "
                    'a size such as 64MiB, or None ("all" on the command line) for what '
                    "the machine has",
                )
        if not 0 < self.alloc_fraction <= 1:
            _refuse(self, "alloc_fraction", "must be in (0, 1]")
        if self.frag_factor < 1:
            _refuse(self, "frag_factor", "must be ≥ 1")
        if not isinstance(self.saves_weights, bool):
            _refuse(self, "saves_weights", "must be True or False")


@dataclass(frozen=True, kw_only=True)
class ActivationsPolicy:
    """What happens to the tensors forward saves for backward: kept, recomputed or swapped."""

    activation_checkpointing: bool = False
    """Recompute activations of each transformer block in backward (HF models: enabled via
    ``gradient_checkpointing_enable``)."""

    activation_offload: str = "none"
    """Where saved activations go: "none" | "host" | "nvme" | "auto" (planner decides)."""

    activation_policy: dict[str, str] | None = None
    """Per transformer block, what happens to its saved activations: a dict of block name or
    fnmatch pattern (e.g. "model.layers.*") to "keep" | "recompute" | "host" | "nvme" |
    "recompute_host" | "recompute_nvme" (re-run the block in backward from its inputs, which are
    swapped to the host or nvme tier between its forward and its backward: LoHan's scheme). It wins
    over ``activation_offload`` and ``activation_checkpointing`` for the blocks it matches (a
    later entry over an earlier one); a pattern matching no block is an error."""

    def __post_init__(self) -> None:
        if self.activation_policy is not None:
            problem = check_policy_entries(self.activation_policy)
            if problem:
                _refuse(self, "activation_policy", problem)
            object.__setattr__(self, "activation_policy", dict(self.activation_policy))
        if self.activation_offload not in ACTIVATION_OFFLOADS:
            _refuse(self, "activation_offload", f"choose one of {', '.join(ACTIVATION_OFFLOADS)}")


@dataclass(frozen=True, kw_only=True)
class ParallelPolicy:
    """How data-parallel ranks share and sum, and the model-parallel sizes."""

    shard: bool = True
    """Shard chunks across data-parallel ranks (ZeRO). False keeps full replicas (DDP-like)."""

    reduce_order: str = "fast"
    """How gradients are summed across data-parallel ranks. "fast" (default): the backend's
    reduce-scatter / all-reduce of each chunk, whose summation order over 3 or more ranks
    depends on an element's position in the buffer and the buffer's size (so results change,
    in the last bits, with the chunk size the plan picked). "rank": every element is summed in
    rank order, ((g0 + g1) + g2) + g3, on every rank, whatever the chunk size, the plan or the
    device budget: results do not depend on the plan, and equal DDP's with a communication hook
    doing the same sum. It exchanges each chunk with an all-to-all (two with ``shard=False``)
    and holds one more device block of the largest chunk while a reduction is in flight
    ([Note: reduction in rank order] in tierwise.runtime.grads.reduce.reducer)."""

    parallel: dict[str, int] | None = None
    """Model-parallel sizes by pattern name, e.g. {"expert": 2} or {"tensor": 2}."""

    def __post_init__(self) -> None:
        if self.reduce_order not in REDUCE_ORDERS:
            _refuse(self, "reduce_order", f"choose one of {', '.join(REDUCE_ORDERS)}")
        if self.parallel is not None and not (
            isinstance(self.parallel, dict)
            and all(
                isinstance(k, str) and isinstance(v, int) and v >= 1
                for k, v in self.parallel.items()
            )
        ):
            _refuse(self, "parallel", 'give a dict of pattern name to size, e.g. {"expert": 2}')


@dataclass(frozen=True, kw_only=True)
class OverlapPolicy:
    """When optimizer updates run relative to backward."""

    optimizer_overlap: str = "auto"
    """When optimizer states live on a storage tier (NVMe) or in host memory (with a compute
    device other than the CPU): "in-backward" updates each chunk as
    soon as its gradients are final (LoHan), speculatively when clipping or fp16 scaling may
    change them (rolled back and redone exactly when they do); "after-backward" only prefetches
    its states during backward and updates at ``step``; "auto" updates in the last backward of
    a step from the second step on, unless the recent gradient norms come near ``max_norm``
    (see README, "Optimizer overlap")."""

    accumulation_steps: int | None = None
    """Backward passes per optimizer step, when known (``tierwise train`` and TierwiseTrainer
    pass it): in-backward updates run in the last one. None: the last is the first backward
    outside ``tierwise.no_sync``, or, without it, a step's only backward."""

    def __post_init__(self) -> None:
        if self.optimizer_overlap not in OPTIMIZER_OVERLAPS:
            _refuse(self, "optimizer_overlap", f"choose one of {', '.join(OPTIMIZER_OVERLAPS)}")
        if self.accumulation_steps is not None and not _is_count(self.accumulation_steps, least=1):
            _refuse(
                self,
                "accumulation_steps",
                "give a positive number of micro-batches per step, or None",
            )


# [Note: plugin-owned settings] A plugin's settings are Config keys like any other (the names are
# the contract: keywords, TOML keys, ``config.nvme_path``), so they are declared here, each with
# the distribution that owns it in its metadata. Their values are the plugin's to check: a set
# value is handed to the settings class the plugin registers (hook ``tierwise_register_settings``),
# which refuses it with a ConfigError or returns it normalised. The plugin host sits above this
# module, so the tierwise package hands Config the registered classes as a callable
# (``read_plugin_settings_from``). Without the owning plugin a value is kept as given (a path as a
# str): nothing in core uses it beyond checking that it is set.
_plugin_settings_classes: Callable[[], Iterable[type]] = tuple


def read_plugin_settings_from(source: Callable[[], Iterable[type]]) -> None:
    """Where :class:`PluginSettings` finds the plugins' settings classes: ``source()`` returns
    them (the plugin host's ``settings_classes().values()``), called only when a plugin-owned
    key is set. See [Note: plugin-owned settings]."""
    global _plugin_settings_classes
    _plugin_settings_classes = source


@dataclass(frozen=True, kw_only=True)
class PluginSettings:
    """Config keys that plugins own and validate ([Note: plugin-owned settings])."""

    nvme_path: str | None = field(default=None, metadata={OWNER: "tierwise-nvme"})
    """Directory on a fast disk for the NVMe tier (needs the tierwise-nvme plugin)."""

    expert_capacity_factor: float | None = field(default=None, metadata={OWNER: "tierwise-moe"})
    """Expert parallel (tierwise-moe): None routes exactly (no token dropped); a factor f caps
    each expert at ceil(f · routed pairs / experts) rows per rank and drops the rest."""

    def __post_init__(self) -> None:
        given = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(PluginSettings)
            if getattr(self, f.name) != f.default
        }
        if not given:
            return
        for name, value in given.items():  # plain data, owner or not (run dirs write it as JSON)
            if isinstance(value, os.PathLike):
                given[name] = os.fspath(value)
                object.__setattr__(self, name, given[name])
        for settings_class in _plugin_settings_classes():
            owned = [f.name for f in dataclasses.fields(settings_class) if f.name in given]
            if owned:
                checked = settings_class(**{name: given[name] for name in owned})
                for name in owned:
                    object.__setattr__(self, name, getattr(checked, name))


POLICIES: tuple[type, ...] = (
    PrecisionPolicy,
    PlacementPolicy,
    MemoryPolicy,
    ActivationsPolicy,
    ParallelPolicy,
    OverlapPolicy,
    PluginSettings,
)
"""The policies Config is made of, in the order their fields are validated."""

Policy = TypeVar("Policy")


@dataclass(frozen=True, kw_only=True)
class Config(
    PluginSettings,
    OverlapPolicy,
    ParallelPolicy,
    ActivationsPolicy,
    MemoryPolicy,
    PlacementPolicy,
    PrecisionPolicy,
):
    """User intent for one training run. Every field can be given to ``tierwise.setup``.

    The fields are declared, documented and validated by the policies this class inherits (its
    fields read in their order: precision, placement, memory, activations, parallel, overlap,
    plugin settings); ``config.placement`` etc. give one policy alone."""

    def __post_init__(self) -> None:
        for policy in POLICIES[:-1]:
            policy.__post_init__(self)  # type: ignore[arg-type]
        self._check_nvme_has_a_path()
        PluginSettings.__post_init__(self)

    def _check_nvme_has_a_path(self) -> None:
        """Across policies: asking for the "nvme" placement or swap target needs nvme_path."""
        swaps_to_nvme = any(
            swap_target(action) == "nvme" for action in (self.activation_policy or {}).values()
        )
        if swaps_to_nvme and not self.nvme_path:
            _refuse(
                self,
                "activation_policy",
                "swapping activations to nvme needs nvme_path set to a "
                "directory on a fast disk (and the tierwise-nvme plugin)",
            )
        asks_nvme = [
            name
            for name in ("param_placement", "optimizer_placement", "activation_offload")
            if getattr(self, name) == "nvme"
        ]
        if asks_nvme and not self.nvme_path:
            _refuse(
                self,
                "nvme_path" if self.nvme_path is not None else asks_nvme[0],
                "an NVMe placement needs nvme_path set to a directory on a fast disk (and the "
                "tierwise-nvme plugin)",
            )

    # -- one policy alone ---------------------------------------------------------------------
    def policy(self, kind: type[Policy]) -> Policy:
        """The policy ``kind`` (one of :data:`POLICIES`) with this config's values."""
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    @property
    def mixed_precision(self) -> PrecisionPolicy:
        return self.policy(PrecisionPolicy)

    @property
    def placement(self) -> PlacementPolicy:
        return self.policy(PlacementPolicy)

    @property
    def memory(self) -> MemoryPolicy:
        return self.policy(MemoryPolicy)

    @property
    def activations(self) -> ActivationsPolicy:
        return self.policy(ActivationsPolicy)

    @property
    def parallelism(self) -> ParallelPolicy:
        return self.policy(ParallelPolicy)

    @property
    def overlap(self) -> OverlapPolicy:
        return self.policy(OverlapPolicy)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_any(cls, config: Config | dict | str | os.PathLike | None, **overrides) -> Config:
        """Build from a Config, a dict, a .toml/.json path or None, then apply overrides."""
        if config is None:
            base: dict[str, Any] = {}
        elif isinstance(config, Config):
            base = config.to_dict()
        elif isinstance(config, dict):
            base = dict(config)
        elif isinstance(config, (str, os.PathLike)):
            base = _read_file(Path(config))
        else:
            raise ConfigError(
                f"config must be a tierwise.Config, a dict or a path to .toml/.json, "
                f"got {type(config).__name__}"
            )
        base.update(overrides)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(base) - known)
        if unknown:
            raise ConfigError(
                f"unknown Config field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}"
            )
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.suffix == ".json":
        data = json.loads(path.read_text())
    elif path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(path.read_text())
        data = data.get("tierwise", data)
    else:
        raise ConfigError(f"config file {path}: use a .toml or .json file")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table/object of Config fields")
    return data


def name_flags(message: str, flags: dict[str, str]) -> str:
    """``message`` with the Config fields it names (``host_memory``, ``Config.nvme_path``) put as
    the command's flags (``flags``: field -> flag, e.g. "nvme_path" -> "--nvme-path"): errors
    written for ``setup()`` callers, shown to a command-line user."""
    for name, flag in flags.items():
        message = re.sub(rf"(?<![\w-])(?:Config\.)?{name}(?![\w-])", flag, message)
    return message


def config_flags(fields) -> dict[str, str]:
    """field -> ``--field-name`` for the Config ``fields`` a command takes as flags."""
    return {name: "--" + name.replace("_", "-") for name in fields}
