"""The pre-runtime model profile: one training step on fake tensors, no model memory allocated.

Parameters and buffers are swapped, for the duration of the step, for ``FakeTensor``s of the
same shapes (floating parameters in the compute precision), so a 175B-parameter model built on
the meta device profiles in seconds and a few hundred MB of RAM. Fake rather than plain meta
tensors because model code guards its value-dependent checks with "is this a fake tensor"
(Hugging Face skips its padding check, for one) and because FakeTensorMode turns a value-dependent
op (``.item()``, ``nonzero``) into an error that names it.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tierwise.precision import PRECISIONS, compute_dtype
from tierwise.profile import ParamInfo, Profile
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from tierwise_profiler.op_timing import (
    OpLog,
    layer_backward_seconds,
    layer_forward_seconds,
    layer_matmul_seconds,
)
from tierwise_profiler.recorder import StepRecorder

DTYPES = {p: compute_dtype(p) for p in PRECISIONS}
"""Compute dtype per precision (``tierwise.precision``), by name for this plugin's callers."""

_OP_HINTS = {
    "_local_scalar_dense": "Tensor.item() / .tolist() / bool() / int() needs a tensor's value",
    "nonzero": "torch.nonzero / torch.where(cond) / boolean-mask indexing: the output shape "
    "depends on values",
    "masked_select": "boolean-mask indexing: the output shape depends on values",
    "unique": "torch.unique: the output shape depends on values",
    "repeat_interleave": "repeat_interleave with tensor repeats: the output shape depends on values",
}


class MetaProfileError(RuntimeError):
    """The model's step cannot run on fake tensors (most often: it needs tensor values); the
    message names the op and the model line that called it."""


def profile_model(
    model: torch.nn.Module,
    example_batch: Any,
    *,
    precision: str = "bf16",
    device: str | torch.device = "cpu",
    activation_checkpointing: bool = False,
    time_layers: bool = False,
) -> Profile:
    """Profile one training step (forward, loss, backward) of ``model`` on ``example_batch``.

    ``model`` may live on the meta device, the CPU or an accelerator; nothing of its size is
    allocated and it is left as it was (parameters, buffers, train/eval modes, checkpointing).
    ``example_batch`` is what the training loop passes: a dict (``model(**batch)``), a tuple or
    list (``model(*batch)``) or one tensor. The loss is ``output.loss`` when the model returns
    one, else the sum of its first tensor output; the output stays alive through backward, as in
    ``out = model(**batch); out.loss.backward()``. ``precision`` picks the dtype of floating
    parameters (and so of activations). ``activation_checkpointing`` turns on Hugging Face
    activation checkpointing for the step when the model supports it and has it off.
    ``time_layers`` also measures ``layer_forward_s`` on ``device`` by running each distinct
    forward op once for real (see [Note: layer timing]: about one block's forward), and
    ``layer_backward_s`` by running autograd's backward of each ([Note: backward timing]).

    Raises :class:`MetaProfileError` naming the op when the step cannot run on fake tensors
    (it needs tensor values, or the op has no fake implementation).
    """
    if precision not in DTYPES:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(DTYPES)}")
    started = time.perf_counter()
    infos, canonical = _param_infos(model)
    buffers = _distinct(t for _, t in model.named_buffers(remove_duplicate=False))
    fake_device = _fake_device(device)
    op_log = OpLog() if time_layers and fake_device.type == torch.device(device).type else None
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = _fake_like(
            _distinct(p for _, p in model.named_parameters(remove_duplicate=False)),
            device=fake_device,
            float_dtype=DTYPES[precision],
        )
        fake_buffers = _fake_like(buffers, device=fake_device, float_dtype=None)
        batch = tree_map(lambda x: _fake_tensor(x, fake_device, None), example_batch)
        recorder = StepRecorder(
            model,
            params={name: fakes[id(p)] for name, p in canonical.items()},
            direct_params=_direct_params(model, canonical),
            op_log=op_log,
        )
        with contextlib.ExitStack() as stack:
            stack.enter_context(_swapped(model, {**fakes, **fake_buffers}))
            stack.enter_context(_training(model))
            stack.enter_context(_no_kv_cache(model))
            if activation_checkpointing:
                stack.enter_context(_hf_checkpointing(model))
            try:
                with recorder:
                    output = _call(model, batch)  # kept through backward, as loops keep it
                    loss = _loss_of(output)
                    recorder.begin_backward()
                    loss.backward()
                    del loss, output
            except Exception as err:
                raise MetaProfileError(_explain(model, recorder.failed_op, err)) from err
        record = recorder.result()
    layer_forward_s = layer_forward_seconds(op_log) if op_log is not None else {}
    layer_matmul_s = layer_matmul_seconds(op_log, layer_forward_s) if op_log is not None else {}
    layer_backward_s = layer_backward_seconds(op_log) if layer_forward_s else {}
    batch_size, seq_len = _batch_shape(example_batch)
    forward_counts: dict[str, int] = {}
    for name in record.forward_order:
        forward_counts[name] = forward_counts.get(name, 0) + 1
    return Profile(
        params=infos,
        forward_order=record.forward_order,
        backward_order=record.backward_order,
        module_params=record.module_params,
        checkpoint_blocks=record.checkpoint_blocks,
        checkpointed=bool(record.checkpoint_blocks),  # blocks re-ran in backward
        multi_use=[name for name, count in forward_counts.items() if count > 1],
        layer_activation_bytes=record.layer_activation_bytes,
        layer_flops=record.layer_flops,
        layer_ops=record.layer_ops,
        layer_forward_s=layer_forward_s,
        layer_matmul_s=layer_matmul_s,
        layer_backward_s=layer_backward_s,
        peak_activation_bytes=record.peak_bytes,
        module_input_bytes=record.module_input_bytes,
        backward_peak_bytes=record.backward_peak_bytes,
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
        batch_size=batch_size,
        seq_len=seq_len,
        source="meta",
        seconds=time.perf_counter() - started,
    )


# -- parameters -------------------------------------------------------------------------------
def _param_infos(model: torch.nn.Module) -> tuple[list[ParamInfo], dict[str, torch.Tensor]]:
    """ParamInfo per distinct parameter (first name, aliases) and canonical name -> tensor."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    infos = [
        ParamInfo(
            name=all_names[0],
            shape=tuple(tensors[key].shape),
            numel=tensors[key].numel(),
            requires_grad=tensors[key].requires_grad,
            aliases=tuple(all_names[1:]),
        )
        for key, all_names in names.items()
    ]
    return infos, {all_names[0]: tensors[key] for key, all_names in names.items()}


def _direct_params(
    model: torch.nn.Module, canonical: dict[str, torch.Tensor]
) -> dict[str, list[str]]:
    """Module name -> canonical names of the parameters registered on it (not its children)."""
    name_of = {id(t): name for name, t in canonical.items()}
    direct: dict[str, list[str]] = {}
    for module_name, module in model.named_modules():
        names = list(
            dict.fromkeys(name_of[id(p)] for p in module._parameters.values() if p is not None)
        )
        if names:
            direct[module_name] = names
    return direct


def _distinct(tensors) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if tensor is not None:
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _fake_device(device: str | torch.device) -> torch.device:
    wanted = torch.device(device)
    if wanted.type == "cuda" and torch.cuda.is_available():
        return wanted
    return torch.device("cpu")  # fake CPU tensors stand in for devices this machine lacks


def _fake_tensor(x: Any, device: torch.device, float_dtype: torch.dtype | None) -> Any:
    """A fake tensor shaped like ``x`` (call inside FakeTensorMode); non-tensors pass through."""
    if not isinstance(x, torch.Tensor):
        return x
    dtype = float_dtype if float_dtype is not None and x.is_floating_point() else x.dtype
    return torch.empty(x.shape, dtype=dtype, device=device, requires_grad=x.requires_grad)


def _fake_like(tensors, *, device, float_dtype) -> dict[int, torch.Tensor]:
    return {id(t): _fake_tensor(t, device, float_dtype) for t in tensors}


@contextlib.contextmanager
def _swapped(model: torch.nn.Module, replacement: dict[int, torch.Tensor]) -> Iterator[None]:
    """Swap every parameter and buffer for its replacement (by id) and restore them after."""
    originals: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for key, tensor in table.items():
                    if tensor is not None and id(tensor) in replacement:
                        originals.append((table, key, tensor))
                        table[key] = replacement[id(tensor)]
        yield
    finally:
        for table, key, tensor in originals:
            table[key] = tensor


@contextlib.contextmanager
def _training(model: torch.nn.Module) -> Iterator[None]:
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


@contextlib.contextmanager
def _no_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    """``use_cache`` off for the step, as the runtime runs training forwards ([Note: no KV cache
    in training] in tierwise.runtime.activations.recompute): a cache would hold every layer's
    keys and values to the end of backward, which a trained step never does."""
    configs = {
        id(config): config
        for module in model.modules()
        if isinstance(getattr(config := getattr(module, "config", None), "use_cache", None), bool)
    }
    before = {key: config.use_cache for key, config in configs.items()}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for key, config in configs.items():
            config.use_cache = before[key]


@contextlib.contextmanager
def _hf_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """Turn on Hugging Face activation checkpointing for the step when it is off."""
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None
    )
    already = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    if enable is None or already or not getattr(model, "supports_gradient_checkpointing", False):
        yield
        return
    disable = (
        getattr(model, "activation_checkpointing_disable", None)
        or model.gradient_checkpointing_disable
    )
    enable()
    try:
        yield
    finally:
        disable()


# -- the step ---------------------------------------------------------------------------------
def _call(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _loss_of(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    for leaf in tree_leaves(output if not hasattr(output, "to_tuple") else output.to_tuple()):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return leaf if leaf.dim() == 0 else leaf.sum()
    raise TypeError(
        f"the model returned {type(output).__name__} with no tensor that requires grad; "
        "profile needs a loss (pass labels) or an output to backpropagate from"
    )


def _batch_shape(batch: Any) -> tuple[int | None, int | None]:
    """(batch size, sequence length) from the first 2-D integer tensor, else the first tensor."""
    tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() >= 1]
    ids = [t for t in tensors if t.dim() == 2 and not t.is_floating_point()]
    first = (ids or tensors or [None])[0]
    if first is None:
        return None, None
    return first.shape[0], (first.shape[1] if first.dim() >= 2 else None)


def _explain(model: torch.nn.Module, op: Any, err: Exception) -> str:
    """A message naming the op that needed values and the model code that called it."""
    if op is None:
        first_line = (str(err).splitlines() or [""])[0]
        op_text = f"{type(err).__name__}: {first_line}"
    else:
        names = [_op_name(op)]
        inner = getattr(err, "func", None)  # fake tensors name the op that needed values
        if inner is not None and _op_name(inner) != names[0]:
            names.append(_op_name(inner))
        hint = next((_OP_HINTS[n] for n in reversed(names) if n in _OP_HINTS), None)
        hint = hint or f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        op_text = " -> ".join(f"aten.{n}" for n in names) + f" ({hint})"
    return (
        f"cannot profile {type(model).__name__} on fake tensors (shapes without values): op "
        f"{op_text}, called at {_user_frame(err)}. Falling back to the engine's warm-up trace; "
        "to profile before runtime, keep value-dependent code (.item(), .tolist(), boolean "
        "masks) out of forward"
    )


def _op_name(op: Any) -> str:
    packet = getattr(op, "overloadpacket", op)
    return getattr(packet, "__name__", str(packet)).split(".")[0]


def _user_frame(err: Exception) -> str:
    """The innermost traceback frame outside torch and this package."""
    skip = (Path(torch.__file__).parent, Path(__file__).parent)
    where = "an unknown place"
    for frame in traceback.extract_tb(err.__traceback__):
        path = Path(frame.filename)
        if not any(path.is_relative_to(root) for root in skip):
            where = f"{frame.filename}:{frame.lineno} in {frame.name}"
    return where
