"""Profile: what a model does in one training step (the planner's input).

Produced before runtime by a profiler plugin (tierwise-profiler, meta device) or, without one,
by core's warm-up trace of the first step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierwise.jsonable import JsonDataclass


@dataclass(kw_only=True)
class ParamInfo(JsonDataclass):
    """One parameter (tied parameters appear once, under their first name)."""

    name: str
    """Qualified name of the parameter's first occurrence in ``model.named_parameters()``."""
    shape: tuple[int, ...]
    """Parameter shape."""
    numel: int
    """Number of elements."""
    requires_grad: bool = True
    """False for frozen parameters (no gradient, no optimizer state)."""
    aliases: tuple[str, ...] = ()
    """Other names under which the same tensor is registered (tied weights)."""
    group: str = ""
    """Chunk group name (pattern/param group/trainable), filled by the engine before planning."""
    dp_size: int | None = None
    """Ranks in the data-parallel group its chunk group is reduced (and sharded) over, filled by
    the engine with ``group``; None means the whole world (expert/tensor parallel groups are
    smaller)."""


@dataclass(kw_only=True)
class Profile(JsonDataclass):
    """Call order, memory and compute of one training step."""

    params: list[ParamInfo] = field(default_factory=list)
    """Every distinct parameter, in ``named_parameters()`` order."""
    forward_order: list[str] = field(default_factory=list)
    """Parameter names in the order forward touches them (a parameter used twice appears twice)."""
    backward_order: list[str] = field(default_factory=list)
    """Parameter names in the order backward touches them (including checkpoint re-forward)."""
    module_params: dict[str, list[str]] = field(default_factory=dict)
    """Module name -> parameters it touches directly."""
    checkpoint_blocks: list[list[str]] = field(default_factory=list)
    """Parameters touched by each activation-checkpoint block (one coarse operator each)."""
    multi_use: list[str] = field(default_factory=list)
    """Parameters touched more than once per forward (tied or reused)."""
    layer_activation_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of activations saved for backward, per layer (module name)."""
    layer_flops: dict[str, float] = field(default_factory=dict)
    """Forward FLOPs per layer (module name)."""
    layer_forward_s: dict[str, float] = field(default_factory=dict)
    """Measured forward time per layer on the compute device, seconds (empty when unknown)."""
    layer_matmul_s: dict[str, float] = field(default_factory=dict)
    """Of ``layer_forward_s``, the seconds of matrix products and attention kernels (whose
    backward runs two products per forward one; the rest is memory-bound)."""
    layer_backward_s: dict[str, float] = field(default_factory=dict)
    """Measured backward time per layer on the compute device, seconds: autograd's backward of
    each of its forward ops (empty when unknown: the search then prices backward from the
    forward)."""
    layer_ops: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    """Forward ops per layer by op class ("matmul", "attention", "memory": element-wise, norms,
    softmax, copies): ``[flops, bytes, count]`` per distinct shape, bytes being what the op reads
    and writes. The search turns them into seconds for hardware it cannot time (the roofline of
    [Note: achievable compute] in tierwise_search.compute); empty when unknown."""
    peak_activation_bytes: int = 0
    """Peak non-model (activation + temporaries) memory over the step, bytes."""
    checkpointed: bool = False
    """The step was profiled with activation checkpointing (blocks re-ran in backward): each
    block's ``layer_activation_bytes`` are what its checkpoint keeps."""
    module_input_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of the tensors each module's forward is handed (what recomputing it keeps), per
    module name; empty when unknown."""
    backward_peak_bytes: dict[str, int] = field(default_factory=dict)
    """Most non-model bytes live while backward was in each module (the one whose parameters it
    reached last; "" before any), per module name; empty when unknown. See
    ``tierwise.planning.activation_peak``."""
    buffer_bytes: int = 0
    """Bytes of module buffers (not managed in chunks)."""
    batch_size: int | None = None
    """Batch size the profile was taken at."""
    seq_len: int | None = None
    """Sequence length the profile was taken at."""
    source: str = "unknown"
    """Who made it: "meta" (pre-runtime profiler) or "runtime" (core warm-up trace)."""
    seconds: float = 0.0
    """Time the profiling took."""

    @property
    def total_numel(self) -> int:
        return sum(p.numel for p in self.params)

    def param(self, name: str) -> ParamInfo:
        for info in self.params:
            if info.name == name or name in info.aliases:
                return info
        raise KeyError(name)


def activation_blocks(profile: Profile) -> dict[str, list[str]]:
    """Transformer blocks of a profile and the layers (``layer_activation_bytes`` keys) inside
    each, in profile order: the runtime swaps or recomputes whole blocks, never a lone layer.

    A block is the longest common module prefix of a checkpoint block's parameters; without
    checkpoint blocks, the numbered entry of a module list (``model.layers.3`` of
    ``model.layers.3.mlp``), which is what ``tierwise.runtime.activations.policy.find_blocks`` finds.
    Layers outside every block (embeddings, the LM head) are not listed. Every checkpoint block
    is a block, also one none of whose layers saves anything (the tensors a checkpointed block
    keeps, its input, belong to the layer that made them: the block before it)."""
    import re

    names: list[str] = []
    for block in profile.checkpoint_blocks:
        parts = [name.split(".")[:-1] for name in block]
        common = []
        for pieces in zip(*parts, strict=False):  # the shortest name bounds the prefix
            if len(set(pieces)) > 1:
                break
            common.append(pieces[0])
        if common:
            names.append(".".join(common))
    if not names:
        numbered = re.compile(r"^(.+?\.\d+)(?=\.|$)")
        for layer in profile.layer_activation_bytes:
            match = numbered.match(layer)
            if match and match.group(1) not in names:
                names.append(match.group(1))
    blocks: dict[str, list[str]] = {name: [] for name in names}
    for layer in profile.layer_activation_bytes:
        for name in names:
            if layer == name or layer.startswith(name + "."):
                blocks[name].append(layer)
                break
    return blocks
