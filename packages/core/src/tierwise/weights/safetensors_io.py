"""Reading and writing safetensors files one tensor (or one slice of one) at a time.

[Note: reading weights without mapping files]
``safetensors.safe_open`` maps the whole file: every page a read touches stays in the process's
resident memory until the file is closed, and the mapping takes address space the size of the
shard (a 5 GB shard does not fit a process capped at 4 GiB). This reader parses the header
(8-byte little-endian length, then JSON: dtype, shape and byte range of each tensor) and reads
exactly the bytes of the tensor, or of the slice of it, that is asked for with ``os.preadv``
into a fresh buffer, so the only memory a read takes is what it returns. A slice along
dimension ``d`` reads ``prod(shape[:d])`` contiguous runs, one per outer index. The header is
checked against the file's size when the file is opened, so a truncated shard is an error
before anything is built.

The writer is the reverse: given every tensor's name, dtype and shape up front it writes the
header first and then each tensor's bytes as they come, holding none of them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""safetensors dtype codes and the torch dtypes they hold."""
CODES = {dtype: code for code, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20
"""A header larger than this is not a safetensors header (the format's own limit)."""


class WeightsError(ValueError):
    """Pretrained weights that cannot be loaded into (or written from) a model; the message
    names the file or tensor."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in its file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """First byte, from the start of the file."""
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ReadCounter:
    """Bytes of buffers handed out by reads and still alive, and the most alive at once (a test
    hook: the bound on host memory while loading is checked on it)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        import weakref

        nbytes = tensor.untyped_storage().nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._freed, nbytes)
        return tensor

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset(self) -> None:
        self.peak = self.live


READS = ReadCounter()
"""Every buffer the weight readers hand out (tierwise.weights)."""


class SafetensorsFile:
    """One safetensors file: its tensors' entries, and reads of a tensor or a slice of one."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                length = int.from_bytes(head, "little") if len(head) == 8 else -1
                if length < 0 or 8 + length > size or length > MAX_HEADER_BYTES:
                    raise WeightsError(
                        f"{self.path}: truncated or not a safetensors file ({size} bytes, header "
                        "incomplete); re-download or re-save the checkpoint"
                    )
                header = json.loads(f.read(length))
        except OSError as err:
            raise WeightsError(f"{self.path}: cannot read ({err.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise WeightsError(f"{self.path}: not a safetensors file (bad header)") from None
        header.pop("__metadata__", None)
        start = 8 + length
        self.entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            if info.get("dtype") not in DTYPES:
                raise WeightsError(
                    f"{self.path}: tensor {name} has dtype {info.get('dtype')!r}, which tierwise "
                    f"cannot load (it reads {', '.join(DTYPES)})"
                )
            begin, end = info["data_offsets"]
            entry = TensorEntry(
                DTYPES[info["dtype"]], tuple(info["shape"]), start + begin, start + end
            )
            if entry.end - entry.begin != entry.numel * entry.dtype.itemsize:
                raise WeightsError(
                    f"{self.path}: tensor {name}'s byte range does not match its shape"
                )
            if entry.end > size:
                raise WeightsError(
                    f"{self.path}: truncated: tensor {name} ends at byte {entry.end} but the file "
                    f"has {size} bytes; re-download or re-save the checkpoint"
                )
            self.entries[name] = entry

    def read(
        self, name: str, dim: int = 0, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Tensor ``name``, or its elements ``start:stop`` along dimension ``dim``, in its
        stored dtype ([Note: reading weights without mapping files])."""
        entry = self.entries[name]
        shape = list(entry.shape) or [1]
        stop = shape[dim] if stop is None else stop
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1 :]) * entry.dtype.itemsize
        run = (stop - start) * inner
        out = torch.empty(outer * run, dtype=torch.uint8)
        view = memoryview(out.numpy())
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i in range(outer):
                offset = entry.begin + i * shape[dim] * inner + start * inner
                _pread_full(fd, view[i * run : (i + 1) * run], offset, self.path, name)
        finally:
            os.close(fd)
        shape[dim] = stop - start
        value = out.view(entry.dtype).view(shape if entry.shape else ())
        return READS.track(value)


def _pread_full(fd: int, view: memoryview, offset: int, path: Path, name: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise WeightsError(f"{path}: truncated while reading tensor {name}")
        done += got


class ShardPlan:
    """Which shard file each tensor goes to: tensors in the order given, a new shard when the
    next would take the current one past ``max_bytes`` (a larger tensor gets one of its own),
    named as ``save_pretrained`` names them."""

    def __init__(
        self,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        *,
        max_bytes: int,
        prefix: str = "model",
    ):
        shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
        size = 0
        for entry in entries:
            nbytes = math.prod(entry[2]) * entry[1].itemsize
            if shards[-1] and size + nbytes > max_bytes:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += nbytes
        count = len(shards)
        if count == 1:
            names = [f"{prefix}.safetensors"]
        else:
            names = [f"{prefix}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        self.shards = list(zip(names, shards, strict=True))
        self.prefix = prefix
        self.total_bytes = sum(math.prod(e[2]) * e[1].itemsize for e in entries)

    def write_index(self, folder: Path) -> None:
        """``prefix.safetensors.index.json`` when there are several shards."""
        if len(self.shards) == 1:
            return
        weight_map = {name: file for file, tensors in self.shards for name, _, _ in tensors}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (folder / f"{self.prefix}.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n"
        )


class StreamingShardWriter:
    """Writes the shards of a :class:`ShardPlan` into ``folder``, one tensor at a time and in
    the plan's order; holds no tensor ([Note: reading weights without mapping files])."""

    def __init__(self, folder: str | os.PathLike, plan: ShardPlan):
        self.folder = Path(folder)
        self.plan = plan
        self._order = [(i, e) for i, (_, tensors) in enumerate(plan.shards) for e in tensors]
        self._next = 0
        self._file = None
        self._shard = -1

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise WeightsError(f"writing {name}: every planned tensor was written already")
        shard, (expected, dtype, shape) = self._order[self._next]
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise WeightsError(
                f"writing {name} {tuple(tensor.shape)} {tensor.dtype}: expected {expected} "
                f"{tuple(shape)} {dtype} next"
            )
        if shard != self._shard:
            self._open(shard)
        data = tensor.detach().contiguous().view(-1)
        if data.numel():
            self._file.write(memoryview(data.view(torch.uint8).numpy()))
        self._next += 1

    def _open(self, shard: int) -> None:
        self._close_file()
        file, tensors = self.plan.shards[shard]
        header, offset = {}, 0
        for name, dtype, shape in tensors:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._file = open(self.folder / file, "wb")  # noqa: SIM115 - closed in _close_file
        self._file.write(len(text).to_bytes(8, "little"))
        self._file.write(text)
        self._shard = shard

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Finish the last shard and write the index; every planned tensor must have come."""
        self._close_file()
        if self._next != len(self._order):
            missing = self._order[self._next][1][0]
            raise WeightsError(f"the export stopped before tensor {missing} was written")
        self.plan.write_index(self.folder)
