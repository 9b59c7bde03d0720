"""StepRecorder: watches one training step (forward + backward) op by op.

Module hooks give the call structure; a ``TorchDispatchMode`` sees every aten op with its
arguments and outputs. From those it records:

- parameter call order at module granularity, the way a chunk runtime fetches them: when a
  module starts (its forward pre-hook, also during a checkpoint re-forward in backward) its
  direct parameters are appended, in registration order; a parameter an op uses outside every
  module that owns it (a functional use) is appended on its own at that op;
- in backward, a module's direct parameters are appended when a gradient reaches one of its
  outputs (a tensor hook registered in forward: a pre-backward hook), and a parameter an op
  touches outside that (as an argument, or through its gradient being accumulated) appends its
  module's parameters (see [Note: backward order]);
- forward FLOPs and saved activations per innermost module, and live non-parameter bytes over
  the whole step (:mod:`tierwise_profiler.live_memory`);
- per module, the bytes of the tensors its first forward call was handed (what a checkpoint of
  it keeps; a storage handed to an earlier module of the same class, such as the attention mask
  and rotary tables every transformer layer gets, counts only there) and the most live bytes
  while backward was in it ([Note: backward peaks by module]).

[Note: backward peaks by module] Backward is "in" the module whose parameters it reached last (the
module of the current backward group, see [Note: backward order]; "" before any: the loss and the
head's ops above the first module with parameters). After each backward op the live bytes are
compared with that module's figure. A planner turns these into a block's working set: the most
bytes while backward is inside the block, less the saved activations of the blocks before it
(untouched until their own backward), is what the block needs on top of what those earlier blocks
hold, whatever a policy does with them (``tierwise.planning.activation_peak``).

[Note: backward order] Touches of parameters already in the current module group are not
appended again; a touch outside it starts a new group. So a Linear appends [weight, bias] once
(its pre-backward hook, its matmul and its bias gradient are one group), and a tied embedding
used by two modules appears once per module, as in forward. Checkpoint re-forwards append
like forward and leave the current group alone, so the order matches what a runtime's module
hooks see with either kind of checkpoint (non-reentrant: a module's pre-backward hook fires
before the re-forward its saved tensors trigger; reentrant: after it).

[Note: checkpoint blocks] A module whose forward starts during backward with no module running
is an outer module of a checkpoint re-forward (torch.utils.checkpoint, reentrant or not, and
Hugging Face checkpointing all re-run the block's function; Hugging Face re-runs the layer's
``forward``, not ``__call__``, so the outer modules are the layer's children). Outer modules
re-run one after another belong to one block until a backward op runs (an op in backward with
grad mode off; re-forwards run with it on). A block is every parameter its outer modules touched
in the forward pass (so an early-stopped re-forward still counts the whole block), plus anything
the re-forward touched.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tierwise_profiler.fake_fixes import run_op
from tierwise_profiler.flops import counts_flops, op_flops
from tierwise_profiler.live_memory import LiveBytes, op_tensors, storage_keys
from tierwise_profiler.op_timing import OpLog

ROOT = ""
"""Owner name of ops run by the top-level module or outside every module."""


@dataclass
class _Frame:
    """One running module call."""

    name: str
    touched: set[str] = field(default_factory=set)
    inclusive: dict[str, None] = field(default_factory=dict)


@dataclass(kw_only=True)
class StepRecord:
    """What one recorded step produced (fields mean what the ``tierwise.profile.Profile``
    fields of the same names mean)."""

    forward_order: list[str]
    backward_order: list[str]
    module_params: dict[str, list[str]]
    checkpoint_blocks: list[list[str]]
    layer_flops: dict[str, float]
    layer_ops: dict[str, dict[str, list[list[float]]]]
    layer_activation_bytes: dict[str, int]
    """Bytes alive at the end of forward, by the module whose op allocated them."""
    peak_bytes: int
    """Peak live non-parameter bytes over forward and backward."""
    module_input_bytes: dict[str, int]
    """Bytes of the distinct tensor storages each module's first forward call was handed
    (parameters and buffers excluded)."""
    backward_peak_bytes: dict[str, int]
    """Most live bytes while backward was in each module ([Note: backward peaks by module])."""


class StepRecorder(TorchDispatchMode):
    """Record one step of ``model``. Use as a context manager around forward and backward and
    call :meth:`begin_backward` in between.

    ``params`` maps each distinct parameter's canonical name to the tensor the step uses;
    ``direct_params`` maps a module name to the canonical names of its direct parameters.
    Gradients are dropped as soon as they are accumulated: a chunk runtime moves them into
    parameter chunks, so they are model data, not activation memory.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        params: dict[str, torch.Tensor],
        direct_params: dict[str, list[str]],
        op_log: OpLog | None = None,
    ) -> None:
        super().__init__()
        self._model = model
        self._params_by_id = {id(t): name for name, t in params.items()}
        self._params_by_storage = {id(t.untyped_storage()): name for name, t in params.items()}
        self._direct = direct_params
        self._first_owner: dict[str, str] = {}
        for module_name, names in direct_params.items():
            for name in names:
                self._first_owner.setdefault(name, module_name)
        self._module_names = {id(module): name for name, module in model.named_modules()}
        self._params = list(params.values())
        self.live = LiveBytes()
        self.phase = "forward"
        self.failed_op: Any = None
        self._frames: list[_Frame] = []
        self._forward_order: list[str] = []
        self._backward_order: list[str] = []
        self._module_params: dict[str, list[str]] = {}
        self._inclusive: dict[str, dict[str, None]] = {}
        self._blocks: list[dict[str, None]] = []
        self._block: dict[str, None] | None = None  # the checkpoint block being re-run
        self._group: set[str] = set()
        self._flops: dict[str, float] = {}
        self._ops: dict[str, dict[tuple[str, float, float], int]] = {}
        self._attention: list[float] | None = None  # FLOPs inside a fused attention call
        self._attention_calls = _AttentionCalls(self)
        self._saved: dict[str, int] = {}
        self._input_bytes: dict[str, int] = {}
        # storages handed to a class's modules, weakly: a dead storage's id can come back
        self._inputs_by_class: dict[type, dict[int, weakref.ref]] = {}
        self._backward_peak: dict[str, int] = {}
        self._backward_module = ROOT  # [Note: backward peaks by module]
        self._handles: list[Any] = []
        self.op_log = op_log
        """When given, every forward op is logged in it by layer (see [Note: layer timing])."""

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self):
        for module in self._model.modules():
            self._handles.append(
                module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        for p in self._params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self._attention_calls.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._attention_calls.__exit__(*exc)
        return super().__exit__(*exc)

    def begin_backward(self) -> None:
        """Mark the end of forward: snapshot what stays alive for backward."""
        saved: dict[str, int] = {}
        for entry in self.live.alive():
            saved[entry.owner] = saved.get(entry.owner, 0) + entry.nbytes
        self._saved = saved
        self._frames.clear()
        self.phase = "backward"

    def result(self) -> StepRecord:
        record = StepRecord(
            forward_order=self._forward_order,
            backward_order=self._backward_order,
            module_params=self._module_params,
            checkpoint_blocks=[list(block) for block in self._blocks],
            layer_flops=self._flops,
            layer_ops={layer: _by_class(counts) for layer, counts in self._ops.items()},
            layer_activation_bytes=self._saved,
            peak_bytes=self.live.peak_bytes,
            module_input_bytes=self._input_bytes,
            backward_peak_bytes=self._backward_peak,
        )
        self.live.close()
        return record

    # -- module hooks -------------------------------------------------------------------------
    def _order(self) -> list[str]:
        return self._forward_order if self.phase == "forward" else self._backward_order

    def _pre_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        name = self._module_names.get(id(module), type(module).__name__)
        if self.phase == "forward" and name not in self._input_bytes:
            seen = self._inputs_by_class.setdefault(type(module), {})
            self._input_bytes[name] = self._new_tensor_bytes(seen, args, kwargs.values())
        if self.phase == "backward":
            if not self._frames:  # [Note: checkpoint blocks]
                if self._block is None:
                    self._block = {}
                    self._blocks.append(self._block)
                self._block.update(self._inclusive.get(name, {}))
        frame = _Frame(name)
        self._frames.append(frame)
        direct = self._direct.get(name)
        if direct:
            self._touch_in_frames(direct, frame)

    def _post_forward(self, module: torch.nn.Module, _args: Any, output: Any) -> None:
        if not self._frames:
            return
        frame = self._frames.pop()
        if self.phase == "forward":
            self._inclusive.setdefault(frame.name, {}).update(frame.inclusive)
            if self._frames:
                self._frames[-1].inclusive.update(frame.inclusive)
        direct = self._direct.get(frame.name)
        if direct:  # its backward starts when a gradient reaches one of its outputs
            for tensor in _output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(partial(self._backward_starts, direct))

    def _new_tensor_bytes(self, seen: dict[int, weakref.ref], *groups: Any) -> int:
        """Bytes of the non-parameter storages among ``groups`` (as ``op_tensors``) not in
        ``seen``, which they are added to."""
        total = 0
        for tensor in op_tensors(*groups):
            storage = tensor.untyped_storage()
            key = id(storage)
            known = seen.get(key)
            if (known is not None and known() is storage) or key in self._params_by_storage:
                continue
            seen[key] = weakref.ref(storage)
            total += storage.nbytes()
        return total

    def _backward_starts(self, group: list[str], _grad: torch.Tensor) -> None:
        if self.phase == "backward":
            self._emit_backward_group(group)

    def _grad_ready(self, param: torch.Tensor) -> None:
        name = self._params_by_id.get(id(param))
        if name is not None and self.phase == "backward":
            self._touch_in_backward(name)
        param.grad = None  # the runtime moves it into its chunk: model data, not activations

    # -- parameter touches --------------------------------------------------------------------
    def _touch_in_frames(self, names: list[str], frame: _Frame) -> None:
        self._order().extend(names)
        frame.touched.update(names)
        frame.inclusive.update(dict.fromkeys(names))
        if self._block is not None:
            self._block.update(dict.fromkeys(names))
        if self.phase == "forward":
            listed = self._module_params.setdefault(frame.name, [])
            listed.extend(n for n in names if n not in listed)

    def _touch_in_backward(self, name: str) -> None:
        if name in self._group:  # [Note: backward order]
            return
        owner = self._first_owner.get(name)
        self._emit_backward_group(self._direct[owner] if owner is not None else [name])

    def _emit_backward_group(self, group: list[str]) -> None:
        if self._group == set(group):
            return
        self._backward_order.extend(group)
        self._group = set(group)
        self._backward_module = self._first_owner.get(group[0], ROOT)

    def _param_used(self, name: str) -> None:
        if self._frames:
            if any(name in frame.touched for frame in self._frames):
                return
            self._touch_in_frames([name], self._frames[-1])
        elif self.phase == "forward":
            self._forward_order.append(name)
            listed = self._module_params.setdefault(ROOT, [])
            if name not in listed:
                listed.append(name)
        else:
            self._touch_in_backward(name)
            if self._block is not None:
                self._block[name] = None

    # -- the dispatch mode ----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_OPS:  # fake tensors ask for their device through dispatch
            return func(*args, **kwargs)
        owner = self._frames[-1].name if self._frames else ROOT
        if self.op_log is not None and self.phase == "forward":
            self.op_log.add(owner, func, args, kwargs)
        self.failed_op = func
        out = run_op(func, args, kwargs)
        self.failed_op = None
        if self.phase == "backward" and not self._frames and not torch.is_grad_enabled():
            self._block = None  # a backward op: any checkpoint re-forward is over
        input_keys = storage_keys(op_tensors(args, kwargs.values()))
        for key in input_keys:
            name = self._params_by_storage.get(key)
            if name is not None:
                self._param_used(name)
        if self.phase == "forward":
            flops = float(op_flops(func, args, kwargs, out)) if counts_flops(func) else 0.0
            if flops:
                self._flops[owner] = self._flops.get(owner, 0.0) + flops
            self._count_op(owner, func, flops, args, kwargs, out)
        self.live.add_outputs(input_keys, op_tensors((out,)), owner=owner)
        if self.phase == "backward":  # [Note: backward peaks by module]
            module = self._backward_module
            self._backward_peak[module] = max(
                self._backward_peak.get(module, 0), self.live.live_bytes
            )
        return out

    def _count_op(self, owner: str, func, flops: float, args, kwargs, out) -> None:
        """One forward op in its class, with the bytes it reads and writes (views and in-place
        results count what they touch: their size, not their storage)."""
        tensors = list(op_tensors(args, kwargs.values())) + list(op_tensors((out,)))
        nbytes = float(sum(t.numel() * t.element_size() for t in tensors))
        if not flops and not nbytes:
            return
        if self._attention is not None:  # [Note: fused attention]
            self._attention[0] += flops
            return
        kind = op_class(func, flops)
        if kind == "memory" and func in _VIEW_OPS:
            return  # no data moves
        counts = self._ops.setdefault(owner, {})
        key = (kind, flops, nbytes)
        counts[key] = counts.get(key, 0) + 1

    def attention(self, call, args, kwargs):
        """Run one ``scaled_dot_product_attention`` call as one "attention" op."""
        if self.phase != "forward" or self._attention is not None:
            return call(*args, **kwargs)
        self._attention = [0.0]
        try:
            out = call(*args, **kwargs)
        finally:
            flops = self._attention[0]
            self._attention = None
        owner = self._frames[-1].name if self._frames else ROOT
        tensors = [*op_tensors(args, kwargs.values()), *op_tensors((out,))]
        nbytes = float(sum(t.numel() * t.element_size() for t in tensors))
        counts = self._ops.setdefault(owner, {})
        key = ("attention", flops, nbytes)
        counts[key] = counts.get(key, 0) + 1
        return out


class _AttentionCalls(TorchFunctionMode):
    """[Note: fused attention] ``scaled_dot_product_attention`` reaches the dispatcher as its
    math decomposition on fake tensors (scores, softmax, dropout and two batched products, the
    s x s scores in memory), while a real GPU runs one fused kernel that never writes the scores
    (flash / memory-efficient attention). So the op classes take the call as one "attention"
    op: the FLOPs of its products, the bytes of its inputs and output. FLOPs per layer, saved
    activations and the peak still come from the ops it decomposes into."""

    def __init__(self, recorder: StepRecorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return self._recorder.attention(func, args, kwargs)
        return func(*args, **kwargs)


_METADATA_OPS = {torch.ops.prim.device.default}
_ATTENTION_NAMES = ("attention", "flash", "efficient_attention", "cudnn_attention")


def op_class(func, flops: float) -> str:
    """ "attention" (fused attention kernels), "matmul" (other ops that count FLOPs) or
    "memory" (element-wise, norms, softmax, copies: bound by memory bandwidth)."""
    name = str(func.overloadpacket).lower()
    if any(part in name for part in _ATTENTION_NAMES):
        return "attention"
    return "matmul" if flops else "memory"


def _view_ops() -> set:
    aten = torch.ops.aten
    names = (
        "view",
        "_unsafe_view",
        "reshape",
        "expand",
        "permute",
        "transpose",
        "t",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "as_strided",
        "alias",
        "detach",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "narrow",
        "lift_fresh",
        "_reshape_alias",
        "view_as",
    )
    ops = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, overload) for overload in packet.overloads())
    return ops


_VIEW_OPS = _view_ops()


def _by_class(counts: dict[tuple[str, float, float], int]) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {}
    for (kind, flops, nbytes), count in counts.items():
        out.setdefault(kind, []).append([flops, nbytes, float(count)])
    return out


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """Tensors a module returned: itself, or the tensors in its tuple, list or dict."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [item for item in output if isinstance(item, torch.Tensor)]
    return []
