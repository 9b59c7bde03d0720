"""NVMeTier: chunk payloads in preallocated files on a fast disk, moved by asynchronous I/O."""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tierwise.tiers import DONE, IOHandle, PayloadKind, Slab, Tier
from tierwise.tiers.base import ZERO_PIECE
from tierwise.tiers.ledger import MemoryPool

from tierwise_nvme.backends import IOBackend, open_backend
from tierwise_nvme.buffers import bounce_budget
from tierwise_nvme.options import NVMeOptions
from tierwise_nvme.preflight import check_directory, check_space
from tierwise_nvme.staged_read import StagedReads
from tierwise_nvme.staging import HOST_FRACTION, StagingPool, host_bytes, read_pool_count
from tierwise_nvme.swapfile import SwapFile, align_up, remove_stale_files, swap_file_name
from tierwise_nvme.transfer import Transfers

if TYPE_CHECKING:
    from tierwise.config import Config

MAX_LOOKAHEAD = 4
"""Most chunks an optimizer pipeline reads ahead of the one it updates (auto lookahead)."""

_instances = itertools.count()


def current_rank() -> int:
    """This process's rank in the default process group (0 when not distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class NVMeTier(Tier):
    """Chunk payloads on disk under ``config.nvme_path``: one preallocated file per kind of data
    (the leading word of ``allocate(what=...)``) for this process and rank.

    ``budget`` caps the bytes allocated on disk (None: what the file system has). Transfers are
    asynchronous (see tierwise_nvme.transfer); files are deleted by ``close()``, at interpreter
    exit, and — if the process crashed — by the next NVMeTier created in the same directory.
    """

    PLUGIN_NAME = "nvme"
    ADDRESSABLE = False
    STATE_COPIES = 2  # [Note: atomic optimizer step]

    def __init__(
        self,
        *,
        device: torch.device,
        budget: int | None,
        config: Config,
        options: NVMeOptions | None = None,
        backend: IOBackend | None = None,
        staging: StagingPool | None = None,
    ) -> None:
        super().__init__(device=device, budget=budget, config=config)
        if not config.nvme_path:
            raise ValueError(
                "the nvme tier needs Config.nvme_path: set it to a directory on a fast local disk"
            )
        self.directory = check_directory(config.nvme_path)  # [Note: NVMe preflight]
        remove_stale_files(self.directory)
        self.options = options or NVMeOptions.from_env()
        self.backend = backend or open_backend(self.options, self.directory)
        self.rank = current_rank()
        self.instance = next(_instances)
        self.moved_bytes = {"nvme->host": 0, "host->nvme": 0}
        """Bytes read from and written to disk by this tier so far (every transfer: parameter
        loads, optimizer pipeline, checkpoints). Updated from several threads under a lock."""
        self.moves = {"nvme->host": 0, "host->nvme": 0}
        """Transfers started by this tier so far, by direction."""
        self.moved_by_kind: dict[str, int] = {}
        """``moved_bytes`` split by what moved: keys "<direction> <PayloadKind value>"."""
        self._count_lock = threading.Lock()
        self._pipelines: weakref.WeakSet = weakref.WeakSet()
        """Optimizer pipelines over this tier, told about every write (see ``write``)."""
        self.staging = staging or StagingPool.for_reads(
            block_size=self.options.block_size, queue_depth=self.options.queue_depth, config=config
        )
        self.pipeline_memory = MemoryPool(
            "nvme_optimizer_staging",
            memory="host",
            pinned=self.device.type == "cuda",
            within="host",
        )
        """The ledger pool of every optimizer pipeline's staging buffers (reserved in the host
        tier through ``host_buffer_bytes``; [Note: the memory ledger])."""
        """Host buffers that reads into destinations O_DIRECT cannot fill in place (rCache
        chunks, device tensors) stream through; bounded, sized automatically (see
        StagingPool.for_reads and [Note: staged reads]). Only this tier's reads use it."""
        self._staged = StagedReads(self.backend, self.staging)
        self._transfers = Transfers(
            self.backend,
            pin=self.device.type == "cuda",
            staged=self._staged,
            bounce_bytes=self.options.bounce_bytes,
            timeout_s=self.options.timeout_s,
        )
        self._files: dict[str, SwapFile] = {}
        self._known_zero: set[tuple[int, int]] = set()
        """(id of the file, byte offset) of slab regions that hold zeros not written to disk:
        [Note: known-zero regions]. Guarded by ``_zero_lock``."""
        self._zero_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False
        self._release = weakref.finalize(self, _release_files, self.backend, self._files)
        """[Note: swap files outlive no tier] A tier dropped without ``close()`` (a managed
        model let go, a setup that failed part way) or still open at interpreter exit closes
        its backend and descriptors and deletes its files when it is collected or at exit
        (``weakref.finalize`` runs at most once, and not after ``close()``)."""

    # -- files ------------------------------------------------------------------------------
    def _file(self, payload: PayloadKind) -> SwapFile:
        kind = PayloadKind(payload).value
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the nvme tier in {self.directory} is closed")
            if kind not in self._files:
                name = swap_file_name(
                    pid=os.getpid(), instance=self.instance, rank=self.rank, kind=kind
                )
                self._files[kind] = SwapFile(
                    self.directory / name, direct=self.backend.direct, kind=kind
                )
            return self._files[kind]

    @property
    def paths(self) -> list[Path]:
        """The swap files this tier has open."""
        return [file.path for file in self._files.values()]

    def reserve(self, nbytes: int, *, kind: PayloadKind, what: str = "") -> None:
        """Preallocate room for ``nbytes`` of ``kind`` now (one free-space check up front, naming
        the whole amount), so later ``allocate`` calls of that kind never grow the file."""
        self._file(kind).reserve(nbytes)

    # -- Tier interface ---------------------------------------------------------------------
    @classmethod
    def environment_note(cls) -> str | None:
        from tierwise_nvme.backends.libaio_backend import load_libaio

        try:
            load_libaio()
        except (OSError, ImportError) as err:
            return (
                f"Linux AIO is unavailable ({err}): the nvme tier uses its thread-pool "
                "fallback (os.preadv/os.pwritev); install libaio.so.1 (Debian/Ubuntu: "
                "apt-get install libaio1, or libaio1t64) for asynchronous kernel I/O"
            )
        return None

    def check_capacity(self, slab_bytes: list[int]) -> None:
        """The disk has room for slabs of these sizes, beside what this tier holds already."""
        check_space(self.directory, slab_bytes)

    def allocate(
        self, numel: int, dtype: torch.dtype, *, kind: PayloadKind, what: str = ""
    ) -> Slab:
        slab = Slab(self, numel, dtype, what or kind.value, kind=kind)
        file = self._file(kind)  # one file per kind of payload
        self._account(slab.nbytes, slab.what)
        try:
            slab.offset = file.allocate(max(slab.nbytes, 1))
        except BaseException:
            self.used_bytes -= slab.nbytes
            raise
        slab.extra["file"] = file
        return slab

    def allocate_state(
        self, numel: int, dtype: torch.dtype, *, kind: PayloadKind, what: str = ""
    ) -> Slab:
        """A slab with a second region for the next step's values: [Note: atomic optimizer
        step]. ``write_next`` fills that region, ``commit`` makes it the slab's contents."""
        slab = self.allocate(numel, dtype, kind=kind, what=what)
        try:
            self._account(slab.nbytes, slab.what)
        except BaseException:
            self.release(slab)
            raise
        try:
            slab.extra["next"] = slab.extra["file"].allocate(max(slab.nbytes, 1))
        except BaseException:
            self.used_bytes -= slab.nbytes
            self.release(slab)
            raise
        return slab

    def release(self, slab: Slab) -> None:
        file = slab.extra.pop("file", None)
        if file is not None:
            with self._zero_lock:  # a later slab at the same offset is not known zero
                self._known_zero.discard((id(file), slab.offset))
                self._known_zero.discard((id(file), slab.extra.get("next")))
            file.free(slab.offset, max(slab.nbytes, 1))
            self.used_bytes -= slab.nbytes
            spare = slab.extra.pop("next", None)
            if spare is not None:
                file.free(spare, max(slab.nbytes, 1))
                self.used_bytes -= slab.nbytes

    def read(self, slab: Slab, out: torch.Tensor, *, offset: int = 0) -> IOHandle:
        """Start filling ``out`` from the slab; returns at once (any number of reads may be in
        flight). A destination O_DIRECT cannot fill in place streams through ``self.staging``
        (see [Note: staged reads]); keep ``out`` alive and unresized until the handle is done."""
        file = self._check(slab, out, offset, "read into")
        if out.numel() == 0:
            return DONE
        if self._is_known_zero(file, slab.offset):  # [Note: known-zero regions]
            out.zero_()
            return DONE
        start = slab.offset + offset * out.element_size()
        handle = self._transfers.read(file, start, out)
        self._count("nvme->host", out.nbytes, slab.kind)
        return handle

    def write(
        self, slab: Slab, src: torch.Tensor, *, offset: int = 0, rest_is_padding: bool = False
    ) -> IOHandle:
        """Start writing ``src`` at element ``offset`` of the slab; keep ``src`` unchanged until
        the handle is done. ``rest_is_padding``: the slab's other elements hold nothing, so
        partial pages at either end are zero-filled rather than read back first (see
        [Note: unaligned transfers]); their contents are unspecified afterwards."""
        file = self._check(slab, src, offset, "write from")
        for pipeline in list(self._pipelines):  # a prefetched copy of this slab is stale now
            pipeline.slab_written(slab)
        return self._write_region(file, slab.offset, slab, src, offset, rest_is_padding)

    # [Note: known-zero regions]
    # Adam moments start at zero: setup writing them (and the first step reading them back)
    # was most of a load's disk traffic, 8 B/param of fp32 moments against 4 of master.
    # ``write_zeros`` only records the slab's current region (file, byte offset) as known
    # zero. A read of a known-zero region fills the destination with zeros without I/O; a
    # write covering the whole region (what the optimizer pipeline's ``write_next`` and
    # checkpoint loads do) drops the flag; a write of part of it first writes the region's
    # zeros, so the bytes around the part are what they were. ``write_next`` targets the
    # other region, so a step's commit leaves the slab's new contents unflagged; ``release``
    # forgets the slab's regions. The flag is per region, whatever the payload kind.
    def write_zeros(self, slab: Slab) -> IOHandle:
        """Record ``slab`` as all zeros, writing nothing: [Note: known-zero regions]."""
        file = slab.extra.get("file")
        if file is None or slab.tier is not self:
            raise ValueError(
                f"nvme tier: cannot zero {slab.what}: the slab was released or is not this tier's"
            )
        for pipeline in list(self._pipelines):  # a prefetched copy of this slab is stale now
            pipeline.slab_written(slab)
        with self._zero_lock:
            self._known_zero.add((id(file), slab.offset))
        return DONE

    def _is_known_zero(self, file: SwapFile, base: int) -> bool:
        with self._zero_lock:
            return (id(file), base) in self._known_zero

    def _unzero(self, file: SwapFile, base: int, slab: Slab, whole: bool) -> None:
        """Before a write into region ``base``: drop its known-zero flag, first writing its
        zeros when the write covers only part of it."""
        with self._zero_lock:
            if (id(file), base) not in self._known_zero:
                return
            self._known_zero.discard((id(file), base))
        if whole:
            return
        zeros = torch.zeros(min(slab.numel, ZERO_PIECE), dtype=slab.dtype)
        for at in range(0, slab.numel, ZERO_PIECE):
            part = zeros[: min(ZERO_PIECE, slab.numel - at)]
            self._write_region(file, base, slab, part, at).wait()

    def write_next(self, slab: Slab, src: torch.Tensor) -> IOHandle:
        """Write all of ``src`` into the region ``commit`` will make the slab's contents (the
        slab itself when it has no second region); reads still see the committed values."""
        file = self._check(slab, src, 0, "write from")
        if "next" not in slab.extra:
            return self.write(slab, src)
        return self._write_region(file, slab.extra["next"], slab, src, 0)

    def commit(self, slab: Slab) -> None:
        """The values ``write_next`` wrote (complete) are the slab's contents from now on; the
        old region becomes the next step's. See [Note: atomic optimizer step]."""
        if "next" in slab.extra:
            slab.offset, slab.extra["next"] = slab.extra["next"], slab.offset
            for pipeline in list(self._pipelines):
                pipeline.slab_written(slab)

    def _write_region(
        self,
        file,
        base: int,
        slab: Slab,
        src: torch.Tensor,
        offset: int,
        rest_is_padding: bool = False,
    ) -> IOHandle:
        if src.numel() == 0:
            return DONE
        whole = rest_is_padding or (offset == 0 and src.numel() == slab.numel)
        self._unzero(file, base, slab, whole)  # [Note: known-zero regions]
        start = base + offset * src.element_size()
        if rest_is_padding:  # only the written bytes are data
            floor, limit = start, start + src.nbytes
        else:  # the slab's other bytes are data too
            floor, limit = 0, base + slab.nbytes
        handle = self._transfers.write(file, start, src, limit=limit, floor=floor)
        self._count("host->nvme", src.nbytes, slab.kind)
        return handle

    def _count(self, direction: str, nbytes: int, kind: PayloadKind) -> None:
        with self._count_lock:  # the engine's thread and the optimizer pipeline's both transfer
            self.moved_bytes[direction] += nbytes
            self.moves[direction] += 1
            key = f"{direction} {PayloadKind(kind).value}"
            self.moved_by_kind[key] = self.moved_by_kind.get(key, 0) + nbytes

    def _check(self, slab: Slab, tensor: torch.Tensor, offset: int, verb: str) -> SwapFile:
        file = slab.extra.get("file")
        if file is None or slab.tier is not self:
            raise ValueError(
                f"nvme tier: cannot {verb} {slab.what}: the slab was released or is not this tier's"
            )
        if tensor.dtype != slab.dtype:
            raise TypeError(
                f"nvme tier: cannot {verb} a {tensor.dtype} tensor for {slab.what}, which holds "
                f"{slab.dtype}: convert the tensor first"
            )
        if offset < 0 or offset + tensor.numel() > slab.numel:
            raise IndexError(
                f"nvme tier: elements [{offset}, {offset + tensor.numel()}) are outside "
                f"{slab.what} ({slab.numel} elements)"
            )
        return file

    def close(self) -> None:
        """Finish transfers in flight, then close and delete the swap files (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._staged.drain()  # pieces still queued for a staging buffer are not in the backend
        self.backend.close()
        self._transfers.reclaim(all_=True)
        for file in self._files.values():
            self._transfers.forget(file)
            file.close()
        self._release.detach()

    def optimizer_pipeline(
        self, *, buffer_bytes: int, states: int = 3, lookahead: int | None = None
    ):
        """An NVMeOptimizerPipeline over this tier with its own staging pool of
        ``states * (lookahead + 2)`` buffers of ``buffer_bytes`` (pinned on CUDA): the reads of
        the next ``lookahead`` chunks, the update of one and the write of another at once.
        See [Note: optimizer pipeline]. ``lookahead`` None (the engine's call) picks enough
        chunks to keep the disk's queue full (``queue_depth * block_size`` bytes of reads), at
        most 4, fewer where the pool would exceed HOST_FRACTION of the host memory."""
        from tierwise_nvme.optimizer_pipeline import NVMeOptimizerPipeline

        if lookahead is None:
            lookahead = pipeline_lookahead(
                self.options, buffer_bytes, states=states, host=host_bytes(self.config)
            )
        pool = StagingPool(
            buffer_bytes=buffer_bytes,
            count=states * (lookahead + 2),
            pin=self.device.type == "cuda",
            memory=self.pipeline_memory,
            timeout_s=self.options.timeout_s,
        )
        pipeline = NVMeOptimizerPipeline(tier=self, pool=pool, lookahead=lookahead)
        self._pipelines.add(pipeline)
        return pipeline

    def memory_pools(self) -> list[MemoryPool]:
        """The staged reads', the optimizer pipelines' and the transfers' host buffers
        ([Note: the memory ledger])."""
        return [self.staging.memory, self.pipeline_memory, *self._transfers.memory_pools()]

    def size_host_buffers(self, *, transfer_bytes: int) -> None:
        """Bound the bounce buffers for transfers of at most ``transfer_bytes`` and count them
        in ``host_buffer_bytes`` ([Note: bounce buffers in the host budget])."""
        limit = self.options.bounce_bytes
        self._transfers.reserve_bounces_in_host(
            bounce_budget(limit=limit, transfer_bytes=transfer_bytes)
        )

    def host_buffer_bytes(self, *, optimizer_buffer_bytes: int = 0) -> int:
        """[Note: storage tiers' host buffers] The staged-read pool, the bounce buffers once
        ``size_host_buffers`` bounded them, and with ``optimizer_buffer_bytes`` the pool of the
        optimizer pipeline the engine makes (``optimizer_pipeline`` with an automatic
        lookahead): all hold at most this."""
        return (
            self.staging.count * self.staging.buffer_bytes
            + self._transfers.reserved_bounce_bytes()
            + planned_pipeline_bytes(self.options, self.config, optimizer_buffer_bytes)
        )

    @classmethod
    def planned_host_buffer_bytes(
        cls,
        config: Config,
        *,
        optimizer_buffer_bytes: int = 0,
        transfer_bytes: int = 0,
        ranks_per_node: int | None = None,
    ) -> int:
        """``host_buffer_bytes`` of a tier made with ``config`` and the environment's options
        and sized for transfers of ``transfer_bytes`` (for planners, before any tier exists) on
        a node of ``ranks_per_node`` ranks (the plan's hardware's; see ``host_bytes``)."""
        options = NVMeOptions.from_env()
        host = host_bytes(config, ranks_per_node=ranks_per_node)
        reads = read_pool_count(
            block_size=options.block_size, queue_depth=options.queue_depth, host=host
        )
        caches = 2 if torch.device(config.device).type == "cuda" else 1  # + the pinned copies
        bounces = bounce_budget(limit=options.bounce_bytes, transfer_bytes=transfer_bytes)
        return (
            reads * options.block_size
            + (caches * bounces if transfer_bytes else 0)
            + planned_pipeline_bytes(options, config, optimizer_buffer_bytes, host=host)
        )

    def file_bytes(self) -> int:
        """Bytes preallocated on disk by this tier (all kinds)."""
        return sum(align_up(file.size) for file in self._files.values())


def pipeline_lookahead(
    options: NVMeOptions, buffer_bytes: int, *, states: int, host: int | None
) -> int:
    """Chunks an optimizer pipeline reads ahead: enough to keep the disk's queue full
    (``queue_depth * block_size`` bytes of reads), at most MAX_LOOKAHEAD, fewer where its pool
    would exceed HOST_FRACTION of the host memory (``host``; None: unknown)."""
    queue_bytes = options.queue_depth * options.block_size
    lookahead = min(MAX_LOOKAHEAD, max(1, -(-queue_bytes // (states * buffer_bytes))))
    while host is not None and lookahead > 1:
        if states * (lookahead + 2) * buffer_bytes <= host * HOST_FRACTION:
            break
        lookahead -= 1
    return lookahead


def planned_pipeline_bytes(
    options: NVMeOptions, config: Config, buffer_bytes: int, *, host: int | None = None
) -> int:
    """Bytes of the pool of the optimizer pipeline (Adam's 3 states) over buffers of
    ``buffer_bytes``, sized against ``host`` (None: ``host_bytes(config)``); 0 for none."""
    if buffer_bytes <= 0:
        return 0
    host = host if host is not None else host_bytes(config)
    lookahead = pipeline_lookahead(options, buffer_bytes, states=3, host=host)
    return 3 * (lookahead + 2) * buffer_bytes


def _release_files(backend: IOBackend, files: dict[str, SwapFile]) -> None:
    """What a tier holds outside Python's memory: the backend's descriptors and threads, and
    the swap files ([Note: swap files outlive no tier]). Holds no reference to the tier."""
    try:
        backend.close()
    finally:
        for file in files.values():
            file.close()


__all__ = [
    "MAX_LOOKAHEAD",
    "NVMeTier",
    "current_rank",
    "pipeline_lookahead",
    "planned_pipeline_bytes",
]
