"""Saving a tierwise-managed Hugging Face model: ``save_pretrained`` writes the fp32 masters and
says so in ``config.json``.

[Note: the dtype save_pretrained records]
transformers records ``model.dtype`` (the dtype of the first floating parameter) as the config's
``dtype``. A managed model computes in its precision (bf16 parameters) but ``state_dict()`` returns
the fp32 master weights, so plain ``save_pretrained`` would write fp32 tensors under a config that
says bfloat16. The wrapper installed here streams the masters into safetensors shards one chunk at
a time (:func:`save_pretrained`, [Note: streaming a model out]; a collective under data, expert or
tensor parallelism: call it on every rank), or, given a ``state_dict``, lets transformers write
that, and then records the dtype of the tensors actually written; unless told otherwise, only
rank 0 writes. This module does not import transformers.
"""

from __future__ import annotations

import functools
import json
import os
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tierwise.plan import save_buffer_bytes
from tierwise.tiers.base import PayloadKind, TierBudgetError
from tierwise.units import format_gib, parse_bytes
from tierwise.weights.block_writer import ALIGN, WINDOW_BLOCKS
from tierwise.weights.safetensors_io import EXPORT_WINDOW_BYTES, ShardedWriter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Dtypes a saved or exported model can be written in."""
MAX_SHARD_SIZE = "5GB"
"""Largest safetensors shard written (the size the Hugging Face Hub recommends)."""
CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")
"""Where config.json records the weights' dtype (transformers 5 and 4)."""


def is_hf_pretrained(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (checked without importing it)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for cls in type(model).__mro__
    )


def record_dtype(save_directory: str | Path, dtype: torch.dtype) -> None:
    """Write ``dtype`` into ``save_directory/config.json`` (the key transformers uses)."""
    path = Path(save_directory) / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    keys = [k for k in CONFIG_DTYPE_KEYS if k in config] or ["dtype"]
    for key in keys:
        config[key] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def written_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype of the floating-point tensors in ``state_dict`` (None when there are none)."""
    return next((v.dtype for v in state_dict.values() if v.is_floating_point()), None)


def save_pretrained(
    model: torch.nn.Module,
    save_directory: str | os.PathLike,
    *,
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    is_main_process: bool | None = None,
) -> Path:
    """Write a tierwise-managed transformers model as a ``from_pretrained`` folder, streaming:
    one chunk group and one tensor in host memory at a time, never the model ([Note: streaming
    a model out]). Collective (every rank calls it); ``is_main_process`` (default: global rank
    0) writes. ``dtype``: of the weights written (the fp32 masters by default), recorded in
    config.json. Tied parameters are written once, under their first name (transformers ties
    them again on load); persistent buffers are written too.
    """
    from tierwise.checkpoint.full_state import iter_full_state
    from tierwise.registry import engine_of

    engine = engine_of(model)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if is_main_process is None:
        is_main_process = _global_rank() == 0
    folder = Path(save_directory)
    buffers = persistent_buffers(model)
    full_numel = {info.name: info.numel for info in engine.profile.params}
    sizes = {}  # in the order iter_full_state yields them
    for chunk in engine.chunks():
        for slot in chunk.slots:
            sizes[slot.name] = _whole_numel(engine, chunk, slot, full_numel) * dtype.itemsize
    for name, buffer in buffers.items():
        item = dtype.itemsize if buffer.is_floating_point() else buffer.element_size()
        sizes[name] = buffer.numel() * item
    host = engine.tiers["host"]
    reserved = save_buffer_bytes(engine.plan.io_buffer_bytes)
    check_save_room(host, reserved)
    host.reserve(reserved, kind=PayloadKind.STAGING, what="the save buffers (Plan.io_buffer_bytes)")
    window, ahead, copy = save_buffers(engine, reserved)
    writer = None
    try:
        if is_main_process:
            folder.mkdir(parents=True, exist_ok=True)
            for stale in [*folder.glob("model*.safetensors"), *folder.glob("model*.index.json")]:
                stale.unlink()  # what an earlier save left would be loaded with these shards
            writer = ShardedWriter(
                folder, sizes, max_bytes=parse_bytes(max_shard_size), window_bytes=window
            )
        with ThreadPoolExecutor(1, thread_name_prefix="tierwise-save-read") as reader:
            values = iter_full_state(
                engine,
                engine.patterns,
                pool=reader,
                ahead_bytes=ahead,
                copy=copy,
                wanted_dtype=dtype,  # [Note: exporting from the home]
            )
            for (name, *_aliases), value in values:
                if writer is not None:  # converted by the writer's workers
                    writer.add(name, value, dtype if value.is_floating_point() else None)
                del value
        if writer is not None:
            for name, buffer in buffers.items():
                writer.add(name, buffer, dtype if buffer.is_floating_point() else None)
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        host.unreserve(reserved)
    if is_main_process:
        config = getattr(model, "config", None)
        if config is not None:
            config.architectures = [type(model).__name__]
            config.save_pretrained(folder)
            record_dtype(folder, dtype)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(folder)
    return folder


def check_save_room(host, reserved: int) -> None:
    """Refuse a save whose buffers (``reserved`` bytes) do not fit in the host tier beside what
    it holds, before anything is written, naming the least ``host_memory`` (what the tier holds
    now plus the buffers) and how to have setup check it ([Note: the weight load checked at
    plan time])."""
    if host.budget is None or host.used_bytes + reserved <= host.budget:
        return
    raise TierBudgetError(
        f"save_pretrained needs {format_gib(reserved)} of save buffers (Plan.io_buffer_bytes) in "
        f"the host tier beside the {format_gib(host.used_bytes)} it holds, "
        f"{format_gib(host.used_bytes + reserved)} in all; host_memory is "
        f"{format_gib(host.budget)}: raise host_memory to at least "
        f"{format_gib(host.used_bytes + reserved)}, and set Config.saves_weights=True so setup "
        "checks this before training (tierwise plan --save-weights names the least host_memory)"
    )


def save_buffers(engine, reserved: int) -> tuple[int, int, bool]:
    """(write window bytes, read-ahead bytes, whether values are copied out of their chunk) of
    a save within its ``reserved`` host bytes (``Plan.io_buffer_bytes``: the largest parameter
    twice and the largest chunk in fp32, two load pieces) ([Note: pipelined export]).

    The write window takes up to ``EXPORT_WINDOW_BYTES`` of what the chunk leaves. Values
    handed to the writer as views keep their chunk until written: two chunks are held (the one
    being written, the one before it until its last pieces are), so views are used when that
    fits, else each value is copied out (two parameters held, the one being written and the
    next). What is left reads the next chunk ahead."""
    largest_chunk = max((c.capacity for c in engine.chunks()), default=0) * 4
    largest = max((s.numel for c in engine.chunks() for s in c.slots), default=0) * 4
    window = min(EXPORT_WINDOW_BYTES, max(0, reserved - largest_chunk) // 2)
    window = max(window, WINDOW_BLOCKS * ALIGN)  # the smallest window (a tiny model)
    if 2 * largest_chunk + window <= reserved:
        return window, reserved - 2 * largest_chunk - window, False
    return window, max(0, reserved - largest_chunk - 2 * largest - window), True


def _whole_numel(engine, chunk, slot, full_numel: dict[str, int]) -> int:
    """Elements of a parameter's whole-model value (a model-parallel one is larger than its
    slot: the profile, taken after the patterns split it, counts this rank's block)."""
    pattern = next((p for p in engine.patterns if p.key == chunk.group.pattern_key), None)
    block = pattern.local_slice(slot.name, slot.param) if pattern is not None else None
    if block is None:
        return full_numel.get(slot.name, slot.numel)
    dim, start, stop, whole = block
    return slot.numel // (stop - start) * whole


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict`` holds, by name (without running the state-dict hooks)."""
    out = {}
    for prefix, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for name, buffer in module.named_buffers(recurse=False):
            if name not in skip and buffer is not None:
                out[f"{prefix}.{name}" if prefix else name] = buffer
    return out


def install_save_pretrained(model: torch.nn.Module) -> None:
    """Make ``model.save_pretrained`` stream the fp32 masters into shards and record that dtype
    ([Note: the dtype save_pretrained records], [Note: streaming a model out]); given a
    ``state_dict``, transformers writes that. Does nothing for other models."""
    if not is_hf_pretrained(model):
        return
    original = model.save_pretrained

    @functools.wraps(original)
    def save_pretrained_method(
        self, save_directory, *args, state_dict=None, is_main_process=None, **kwargs
    ):
        if state_dict is None and not args and set(kwargs) <= {"max_shard_size"}:
            return save_pretrained(
                self,
                save_directory,
                max_shard_size=kwargs.get("max_shard_size", MAX_SHARD_SIZE),
                is_main_process=is_main_process,
            )
        if state_dict is None:
            state_dict = self.state_dict()  # collective: every rank gathers
        if is_main_process is None:  # every rank calls (the gather above); rank 0 writes
            is_main_process = _global_rank() == 0
        kwargs.setdefault("max_shard_size", MAX_SHARD_SIZE)
        dtype = written_dtype(state_dict)  # before: transformers empties the dict as it writes
        result = original(
            save_directory, *args, state_dict=state_dict, is_main_process=is_main_process, **kwargs
        )
        if is_main_process and dtype is not None:
            record_dtype(save_directory, dtype)
        return result

    model.save_pretrained = types.MethodType(save_pretrained_method, model)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
