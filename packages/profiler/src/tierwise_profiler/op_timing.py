"""Measured forward time per layer: the fake step's forward ops, each distinct one run for real.

[Note: layer timing] FLOPs over a peak matmul rate badly underestimate a step on a CPU (and on
small GPU kernels): layer norms, softmax, element-wise ops and memory-bound matmuls do not run
at the peak. So the recorder logs every forward op with the shapes, strides and dtypes of its
tensor arguments and the layer (innermost module, the keys of ``Profile.layer_flops``) that ran
it. After the fake step every distinct op signature gets made-up inputs of those shapes on the
compute device (random floats, zero integers: valid indices and targets), and the distinct ops
run in forward order for one warm-up round and ``ROUNDS`` timed rounds (fewer once
``MAX_SECONDS`` have passed); each round keeps its outputs alive until it ends, so ops write
fresh memory as a forward saving its activations does. An op's time is its median over the
rounds: on a shared machine a burst of load slows one round, not the estimate; it is kept for
the rest of the process (another profile of the same shapes reuses it). Transformer
blocks repeat the same signatures, so a round costs about one block's forward (plus the
embedding, head and loss). A layer's forward time is the sum over its ops.

[Note: backward timing] A layer's backward is timed the same way, not taken as a multiple of its
forward: each distinct op runs again with the floating inputs that required a gradient in the
step (``TensorSpec.requires_grad``: a frozen weight gets none) as leaves, and autograd's own
backward of that op (``torch.autograd.grad``) is timed. The ratio is far from the textbook 2x
on some devices: on an AVX2 CPU without bf16 instructions a bf16 matmul's input gradient ran
7x its forward (bench/results/cpu-2026-11-27b), and a frozen weight's missing product is ~1x.

No times (an empty dict) when the compute device is not the one fake tensors stood in for (a
CUDA profile on a CPU-only machine), when the made-up inputs would exceed ``REPLAY_MAX_BYTES``
(a model too large to time cheaply), or when an op cannot run on made-up values. Python and
autograd overhead of the real forward are not in the sum (a few percent on small models).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

ROUNDS = 5
"""Timed rounds over the distinct ops (after one warm-up round) ..."""
MAX_SECONDS = 2.0
"""... or fewer, once this long has passed (at least one)."""
REPLAY_MAX_BYTES = 1 << 30
"""Most bytes of made-up inputs (all distinct ops together); a model needing more is not timed."""

CLOCK = time.perf_counter
"""What op times are read with: wall time. A reference measured on a shared machine may set
``time.process_time`` with one thread, the time of an idle core (tests/search/fixtures)."""

_MEASURED: dict[str, float] = {}
"""Op signature -> seconds, measured once per process: profiling the same model again (another
``setup`` in this process) reuses the figures rather than drawing new noise."""


@dataclass(frozen=True)
class TensorSpec:
    """What a real stand-in for a tensor argument needs."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = field(default=False, repr=False)
    """The tensor needed a gradient in the step ([Note: backward timing]); not part of the
    forward signature (the forward runs the same whether or not it did)."""

    @property
    def storage_numel(self) -> int:
        """Elements the strided view reaches (0 for an empty tensor)."""
        if any(size == 0 for size in self.shape):
            return 0
        return 1 + sum(
            (size - 1) * step for size, step in zip(self.shape, self.stride, strict=True)
        )

    @property
    def nbytes(self) -> int:
        return self.storage_numel * self.dtype.itemsize

    def make(self) -> torch.Tensor:
        numel = max(self.storage_numel, 1)
        if self.dtype.is_floating_point or self.dtype.is_complex:
            base = torch.rand(numel, device=self.device).to(self.dtype)
        else:
            base = torch.zeros(numel, dtype=self.dtype, device=self.device)
        return base.as_strided(self.shape, self.stride)


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return TensorSpec(
            tuple(x.shape), tuple(x.stride()), x.dtype, x.device, bool(x.requires_grad)
        )
    return x


class OpLog:
    """Forward ops by layer: how often each distinct signature ran in each layer."""

    def __init__(self) -> None:
        self.calls: dict[str, dict[str, int]] = {}
        """Layer -> signature key -> calls."""
        self.ops: dict[str, tuple[Any, Any, Any]] = {}
        """Signature key -> (op, args, kwargs) with tensors as TensorSpecs."""
        self.forward_key: dict[str, str] = {}
        """Signature key -> its forward signature (without which inputs needed a gradient)."""

    def add(self, layer: str, func: Any, args: tuple, kwargs: dict) -> None:
        specs = tree_map(_spec, (args, kwargs))
        forward_key = f"{func}{specs!r}"
        needs = [x.requires_grad for x in tree_flatten(specs)[0] if isinstance(x, TensorSpec)]
        key = forward_key + "|grad:" + "".join("1" if need else "0" for need in needs)
        if key not in self.ops:
            self.ops[key] = (func, *specs)
            self.forward_key[key] = forward_key
        counts = self.calls.setdefault(layer, {})
        counts[key] = counts.get(key, 0) + 1


def _op_bytes(args: Any, kwargs: Any) -> int:
    leaves, _ = tree_flatten((args, kwargs))
    return sum(leaf.nbytes for leaf in leaves if isinstance(leaf, TensorSpec))


def _ready_call(func: Any, args: Any, kwargs: Any) -> Callable[[], Any]:
    """``func`` bound to made-up inputs of the recorded shapes (waits for CUDA to finish)."""
    real_args, real_kwargs = tree_map(
        lambda x: x.make() if isinstance(x, TensorSpec) else x, (args, kwargs)
    )
    leaves = tree_flatten((real_args, real_kwargs))[0]
    cuda = {x.device for x in leaves if isinstance(x, torch.Tensor) and x.device.type == "cuda"}

    def call() -> Any:
        out = func(*real_args, **real_kwargs)
        for device in cuda:
            torch.cuda.synchronize(device)
        return out

    return call


def _enough(times: dict[str, list[float]], round_index: int, elapsed: float) -> bool:
    """Whether to stop after round ``round_index`` (0: the warm-up). Past ``MAX_SECONDS`` the
    timed rounds so far are kept; a warm-up round that alone took that long is the measurement
    (another round would double a long profile for little), otherwise it is dropped."""
    if elapsed > MAX_SECONDS:
        return True
    if round_index == 0:
        for values in times.values():
            values.clear()
    return False


def layer_forward_seconds(log: OpLog) -> dict[str, float]:
    """Seconds of each layer's forward ops on the devices the ops named (see
    [Note: layer timing]); the caller checks that those are the compute device."""
    if sum(_op_bytes(args, kwargs) for _, args, kwargs in log.ops.values()) > REPLAY_MAX_BYTES:
        return {}
    todo = {}
    for key, op in log.ops.items():
        if log.forward_key[key] not in _MEASURED:
            todo.setdefault(log.forward_key[key], op)
    times: dict[str, list[float]] = {key: [] for key in todo}
    try:
        calls = {key: _ready_call(*op) for key, op in todo.items()}
        started = CLOCK()
        with torch.no_grad():
            for round_index in range(1 + ROUNDS):  # the first round warms up
                outputs = []  # alive until the round ends, as a forward keeps its activations
                for key, call in calls.items():
                    begin = CLOCK()
                    outputs.append(call())
                    times[key].append(CLOCK() - begin)
                del outputs
                if _enough(times, round_index, CLOCK() - started):
                    break
    except Exception:  # noqa: BLE001 - an op that needs real values: no measurement at all
        return {}
    _MEASURED.update({key: statistics.median(values) for key, values in times.items()})
    return {
        layer: sum(_MEASURED[log.forward_key[key]] * calls for key, calls in counts.items())
        for layer, counts in log.calls.items()
    }


_MEASURED_BACKWARD: dict[str, float] = {}
"""Op signature -> seconds of its backward, measured once per process."""


def _ready_backward(func: Any, args: Any, kwargs: Any) -> Callable[[], Any] | None:
    """A call that runs ``func`` forward on made-up inputs, untimed, and returns the timed part:
    autograd's backward of it (None when no input needs a gradient)."""
    specs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, TensorSpec)]
    if not any(x.requires_grad and x.dtype.is_floating_point for x in specs):
        return None

    def make(x: Any) -> Any:
        if not isinstance(x, TensorSpec):
            return x
        tensor = x.make()
        if x.requires_grad and x.dtype.is_floating_point:
            tensor = tensor.detach().requires_grad_()
        return tensor

    real_args, real_kwargs = tree_map(make, (args, kwargs))
    leaves = [x for x in tree_flatten((real_args, real_kwargs))[0] if isinstance(x, torch.Tensor)]
    inputs = [x for x in leaves if x.requires_grad]
    cuda = {x.device for x in leaves if x.device.type == "cuda"}

    def forward() -> Callable[[], Any] | None:
        with torch.enable_grad():
            out = func(*real_args, **real_kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs:
            return None
        grads = [torch.rand_like(t) for t in outs]

        def backward() -> Any:
            result = torch.autograd.grad(outs, inputs, grads, allow_unused=True)
            for device in cuda:
                torch.cuda.synchronize(device)
            return result

        return backward

    return forward


def layer_backward_seconds(log: OpLog) -> dict[str, float]:
    """Seconds of each layer's backward: autograd's backward of each of its forward ops ([Note:
    backward timing]); empty when the forward was not timed or an op cannot be replayed."""
    if sum(_op_bytes(args, kwargs) for _, args, kwargs in log.ops.values()) > REPLAY_MAX_BYTES:
        return {}
    todo = {key: op for key, op in log.ops.items() if key not in _MEASURED_BACKWARD}
    times: dict[str, list[float]] = {key: [] for key in todo}
    try:
        forwards = {key: _ready_backward(*op) for key, op in todo.items()}
        started = CLOCK()
        for round_index in range(1 + ROUNDS):  # the first round warms up
            outputs = []
            for key, forward in forwards.items():
                backward = forward() if forward is not None else None
                if backward is None:
                    continue
                begin = CLOCK()
                outputs.append(backward())
                times[key].append(CLOCK() - begin)
            del outputs
            if _enough(times, round_index, CLOCK() - started):
                break
    except Exception:  # noqa: BLE001 - an op that needs real values: no measurement at all
        return {}
    _MEASURED_BACKWARD.update(
        {key: statistics.median(values) if values else 0.0 for key, values in times.items()}
    )
    return {
        layer: sum(_MEASURED_BACKWARD[key] * calls for key, calls in counts.items())
        for layer, counts in log.calls.items()
    }


def layer_matmul_seconds(log: OpLog, measured: dict[str, float]) -> dict[str, float]:
    """Of the layers' measured seconds (``layer_forward_seconds``), those of matmuls and
    attention kernels (ops that count FLOPs)."""
    from tierwise_profiler.flops import counts_flops

    if not measured:
        return {}
    return {
        layer: sum(
            _MEASURED[log.forward_key[key]] * calls
            for key, calls in counts.items()
            if log.forward_key[key] in _MEASURED and counts_flops(log.ops[key][0])
        )
        for layer, counts in log.calls.items()
    }


__all__ = [
    "MAX_SECONDS",
    "REPLAY_MAX_BYTES",
    "ROUNDS",
    "OpLog",
    "TensorSpec",
    "layer_backward_seconds",
    "layer_forward_seconds",
    "layer_matmul_seconds",
]
