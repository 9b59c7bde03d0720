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
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tierwise.weights.block_writer import BlockFile, WriteWindow

if TYPE_CHECKING:
    from collections.abc import Callable

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
MAX_SHARD_BYTES = 5 * 10**9
"""Largest shard written: 5 GB, as transformers reads max_shard_size="5GB"."""
EXPORT_WINDOW_BYTES = 32 << 20
"""Staging bytes of an export's shards: eight 4 MiB blocks, converting and writing together
([Note: pipelined export])."""
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
        # the loading pipeline reads on its own thread; reentrant: a collection inside the
        # lock may run a finalizer
        self._lock = threading.RLock()

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        import weakref

        nbytes = tensor.untyped_storage().nbytes()
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._freed, nbytes)
        return tensor

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes

    def reset(self) -> None:
        with self._lock:
            self.peak = self.live


READS = ReadCounter()
"""Every buffer the weight readers hand out (tierwise.weights)."""


class SafetensorsFile:
    """One safetensors file: its tensors' entries, and reads of a tensor or a slice of one."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        reads: Callable[[memoryview, int], None] | None = None,
    ):
        """``reads(view, offset)``: fills ``view`` with the file's bytes from ``offset``,
        in place of ``os.preadv`` (a checkpoint reader that hashes what it reads: [Note:
        hashing while reading])."""
        self.path = Path(path)
        self._reads = reads
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
        fd = os.open(self.path, os.O_RDONLY) if self._reads is None else None
        try:
            for i in range(outer):
                offset = entry.begin + i * shape[dim] * inner + start * inner
                part = view[i * run : (i + 1) * run]
                if fd is not None:
                    _pread_full(fd, part, offset, self.path, name)
                    continue
                try:
                    self._reads(part, offset)
                except EOFError:
                    raise WeightsError(f"{self.path}: truncated while reading {name}") from None
        finally:
            if fd is not None:
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


HEADER_PER_TENSOR = 192
"""Header bytes reserved per tensor beyond its quoted name (dtype, a shape of up to 4
dimensions and two byte offsets of up to 20 digits take under 150)."""


CHECKPOINT_WINDOW_BYTES = 4 << 20
"""Staging bytes of a file written alone (a checkpoint's rank file): small, as a checkpoint
holds one chunk's shard besides ([Note: pipelined export])."""


class SafetensorsWriter:
    """One safetensors file written a tensor at a time, holding none of them beyond the write
    window: space for the header is reserved from the names that may come (an upper bound), the
    data is streamed behind it by the window's workers, converted there ([Note: pipelined
    export]), and the header, padded with spaces as safetensors pads it, is written last
    ([Note: reading weights without mapping files]). ``window``: shared with other files (a
    ``ShardedWriter``'s shards), else a small one of its own; ``direct``: O_DIRECT writes."""

    def __init__(
        self,
        path: str | os.PathLike,
        names: list[str],
        *,
        window: WriteWindow | None = None,
        direct: bool = False,
    ):
        self.path = Path(path)
        reserve = 64 + sum(len(json.dumps(n)) + HEADER_PER_TENSOR for n in names)
        self.reserve = reserve + (-(8 + reserve) % 8)  # data starts 8-byte aligned
        self.header: dict[str, dict] = {}
        self.bytes = 0
        self._own_window = window is None
        self._window = WriteWindow(CHECKPOINT_WINDOW_BYTES) if window is None else window
        try:
            self._file = BlockFile(self.path, self._window, direct=direct)
        except BaseException:
            self._close_window()
            raise
        self._file.reserve_head(8 + self.reserve)

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Write ``tensor`` (converted to ``dtype`` when given) under ``name``; the tensor must
        stay unchanged until ``close`` (the workers read it)."""
        if name in self.header:
            raise WeightsError(f"{self.path}: tensor {name} written twice")
        dtype = tensor.dtype if dtype is None else dtype
        data = tensor.detach()
        if data.device.type != "cpu":  # workers touch host memory only
            data = data.to("cpu")
        nbytes = data.numel() * dtype.itemsize
        if nbytes:
            self._file.append(data, dtype)
        self.header[name] = {
            "dtype": CODES[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self.bytes, self.bytes + nbytes],
        }
        self.bytes += nbytes

    def close(self) -> None:
        header = {**self.header, "__metadata__": {"format": "pt"}}
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > self.reserve:
            self.abort()
            raise WeightsError(
                f"{self.path}: header of {len(text)} bytes exceeds the {self.reserve} reserved "
                "(a tensor not named when the file was opened)"
            )
        head = self.reserve.to_bytes(8, "little") + text + b" " * (self.reserve - len(text))
        try:
            self._file.finish(head)
        finally:
            self._close_window()

    def abort(self) -> None:
        """Close and remove the file (a failed write leaves nothing)."""
        self._file.abort()
        self._close_window()

    def _close_window(self) -> None:
        if self._own_window:
            self._window.close()


class ShardedWriter:
    """safetensors shards named as ``save_pretrained`` names them, written a tensor at a time.
    ``sizes``: the byte size of every tensor, in the order they will be added; a new shard
    starts where the next tensor would take the current one past ``max_bytes`` (a larger
    tensor gets a shard of its own). ``close`` names them ``prefix-0000i-of-0000n``, or
    ``prefix.safetensors`` alone, and writes the index when there are several. The shards share
    one write window of ``window_bytes`` and are written with O_DIRECT where the file system
    allows it ([Note: pipelined export])."""

    def __init__(
        self,
        folder: str | os.PathLike,
        sizes: dict[str, int],
        *,
        max_bytes: int,
        prefix: str = "model",
        window_bytes: int = EXPORT_WINDOW_BYTES,
    ):
        self.folder = Path(folder)
        self.prefix = prefix
        self.window = WriteWindow(window_bytes)
        self.shards: list[list[str]] = [[]]
        self.shard_of: dict[str, int] = {}
        size = 0
        for name, nbytes in sizes.items():
            if self.shards[-1] and size + nbytes > max_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(name)
            self.shard_of[name] = len(self.shards) - 1
            size += nbytes
        self._written: list[SafetensorsWriter] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Write ``tensor`` (converted to ``dtype`` when given; unchanged until ``close``)."""
        if name not in self.shard_of:
            raise WeightsError(f"{self.folder}: tensor {name} was not announced to the writer")
        shard = self.shard_of[name]
        while len(self._written) <= shard:
            if self._written:
                self._written[-1].close()
            index = len(self._written)
            part = self.folder / f"{self.prefix}-part{index + 1:05d}.safetensors.tmp"
            self._written.append(
                SafetensorsWriter(part, self.shards[index], window=self.window, direct=True)
            )
        if shard != len(self._written) - 1:
            raise WeightsError(f"{self.folder}: tensor {name} added out of the announced order")
        self._written[-1].add(name, tensor, dtype)
        self.total_bytes += tensor.numel() * (tensor.dtype if dtype is None else dtype).itemsize

    def close(self) -> list[Path]:
        """Finish the last shard, name the shards and write the index; return the shard files."""
        if len(self._written) != len(self.shards) or any(
            n not in self._written[-1].header for n in self.shards[-1]
        ):
            raise WeightsError(f"{self.folder}: the writer was closed before every tensor came")
        try:
            self._written[-1].close()
        finally:
            self.window.close()
        count = len(self._written)
        if count == 1:
            final = [self.folder / f"{self.prefix}.safetensors"]
        else:
            final = [
                self.folder / f"{self.prefix}-{i:05d}-of-{count:05d}.safetensors"
                for i in range(1, count + 1)
            ]
        weight_map = {}
        for writer, path in zip(self._written, final, strict=True):
            os.replace(writer.path, path)
            weight_map.update(dict.fromkeys(writer.header, path.name))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / f"{self.prefix}.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        return final

    def abort(self) -> None:
        """Remove what was written (a failed export leaves no partial shards)."""
        for writer in self._written:
            writer.abort()
        self.window.close()
