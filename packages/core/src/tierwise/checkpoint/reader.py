"""Read a tierwise checkpoint by parameter name, one piece at a time.

[Note: checkpoint by parameter name]
A checkpoint stores, per parameter (under its original, whole-model name), flat pieces of its
fp32 master weights and of its Adam moments as the run stored them (fp32, bf16, or int8 codes
with their block scales; ``read`` gives fp32 values of any of them): piece ``[lo, hi)`` of the parameter's flattened whole-model
value, in the file of the rank that wrote it. Which rank wrote which piece follows from the
layout it ran with (its data-parallel shard of each chunk, or a 1/world share of a
model-parallel parameter), and the manifest's ``params`` index lists them. Reading by name and
range therefore needs no knowledge of the writer's world size, chunk size, tiers or
model-parallel layout. A read takes only the bytes of the pieces it asks for (format 3: each
rank's file is safetensors, read with ``os.preadv``, [Note: reading weights without mapping
files]; format 2's torch.save files are memory-mapped): a rank resuming on another world size
reads its own share, never the whole model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tierwise.checkpoint.hashing_reads import HashingReads
from tierwise.checkpoint.manifest import MANIFEST, CheckpointError, check_file, read_manifest
from tierwise.checkpoint.plain_data import load_plain
from tierwise.optim.state_formats import decode_piece
from tierwise.weights.safetensors_io import SafetensorsFile

KINDS = ("master", "exp_avg", "exp_avg_sq")
"""What is stored per parameter: fp32 master weights (a frozen parameter's value) and, for
trainable parameters, the two Adam moments."""

MOMENT_KINDS = KINDS[1:]
"""The Adam moments, stored as the run's ``Config.optimizer_states`` kept them (fp32, bf16, or
int8 codes with ``<key>.scales`` and ``<key>.phase``: [Note: low-bit optimizer states])."""


class CheckpointReader:
    """A checkpoint directory written by :func:`tierwise.save_checkpoint`, read by parameter name.

    >>> reader = CheckpointReader("ckpt")
    >>> for name in reader.names():
    ...     weight = reader.tensor(name)             # whole-model fp32 master, original shape
    ...     m = reader.read(name, "exp_avg", 0, 10)  # the first 10 elements of its first moment
    """

    def __init__(
        self, path: str | os.PathLike, *, check_on_open: bool = True, hash_reads: bool = True
    ):
        """``check_on_open=False``: a file is not checksummed when opened; with
        ``hash_reads`` its safetensors files are hashed by the reads themselves ([Note:
        hashing while reading]). The caller runs :meth:`check_all` after its reads (or, without
        ``hash_reads``, checks on another reader) and uses nothing it read before that passed
        (an export publishes its shards only then: [Note: pipelined export])."""
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self._params: dict[str, dict[str, Any]] = self.manifest["params"]
        self._aliases: dict[str, str] = self.manifest.get("aliases", {})
        self._files: dict[str, SafetensorsFile | dict[str, torch.Tensor]] = {}
        self._verified: set[str] = set()
        self._check_on_open = check_on_open
        self._hash_reads = hash_reads and not check_on_open
        self.hashing: dict[str, HashingReads] = {}
        """The files read through a ``HashingReads`` (``check_on_open=False``), by name."""

    def check_all(self) -> None:
        """Check every file of the checkpoint against its manifest checksum (raises
        :class:`CheckpointError` naming the first that does not match). A file hashed while
        it was read is finished (its unread rest read once), the others are read whole."""
        for file in self.manifest["files"]:
            if file not in self.hashing:
                self._checked(file)
                continue
            reads = self.hashing[file]
            try:
                matches = reads.digest() == self.manifest["files"][file]["sha256"]
            except EOFError:
                matches = False
            if not matches:
                raise CheckpointError(
                    f"checkpoint {self.path} is corrupt: {file} does not match its checksum "
                    f"in {MANIFEST}"
                )

    def close(self) -> None:
        """Close the files read through a ``HashingReads``."""
        for reads in self.hashing.values():
            reads.close()

    # -- what is in it ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """How many ranks wrote it."""
        return self.manifest["world_size"]

    @property
    def steps_taken(self) -> int:
        """Optimizer steps the run had taken when it was saved."""
        return self.manifest["step"]

    def names(self) -> list[str]:
        """Parameter names (a tied parameter once, under its first name; see :meth:`aliases`)."""
        return list(self._params)

    def aliases(self) -> dict[str, str]:
        """Other names of tied parameters -> the name they are stored under."""
        return dict(self._aliases)

    def __contains__(self, name: str) -> bool:
        return self._aliases.get(name, name) in self._params

    def shape(self, name: str) -> torch.Size:
        """The whole-model shape of ``name``."""
        return torch.Size(self._entry(name)["shape"])

    def numel(self, name: str) -> int:
        return self.shape(name).numel()

    def trainable(self, name: str) -> bool:
        """Whether Adam moments are stored for ``name``."""
        return self._entry(name)["trainable"]

    def step(self, name: str) -> float:
        """The Adam step count of ``name`` (its bias correction)."""
        return float(self._entry(name)["step"])

    # -- values -------------------------------------------------------------------------------
    def read(
        self, name: str, kind: str = "master", start: int = 0, end: int | None = None
    ) -> torch.Tensor:
        """Elements ``[start, end)`` of ``name``'s flattened whole-model ``kind`` (fp32, a copy).

        Only the files holding those elements are opened (and checked against the manifest).
        """
        entry = self._entry(name)
        if kind not in KINDS or (kind != "master" and not entry["trainable"]):
            raise KeyError(
                f"checkpoint {self.path}: {name} has no {kind!r} (it has: "
                f"{', '.join(KINDS if entry['trainable'] else KINDS[:1])})"
            )
        numel = self.numel(name)
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise IndexError(f"{name}: range [{start}, {end}) is outside its {numel} elements")
        whole = self._one_piece(name, kind, start, end)
        if whole is not None:
            return whole
        out = torch.empty(end - start, dtype=torch.float32)
        covered = 0
        for file, lo, hi in entry["pieces"]:
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            opened = self._open(file)
            key = f"{self._aliases.get(name, name)}/{kind}"
            if _dtype_of(opened, key) == torch.uint8:  # int8 moments: decoded, as the run did
                piece = decode_piece(
                    _whole(opened, key),
                    _whole(opened, f"{key}.scales"),
                    int(_whole(opened, f"{key}.phase")),
                    signed=kind == "exp_avg",
                )
                out[a - start : b - start] = piece[a - lo : b - lo]
            elif isinstance(opened, SafetensorsFile):  # format 3: only the bytes asked for
                out[a - start : b - start] = opened.read(key, 0, a - lo, b - lo)
            else:
                out[a - start : b - start] = opened[key][a - lo : b - lo]
            covered += b - a
        if covered != end - start:
            raise CheckpointError(
                f"checkpoint {self.path}: the pieces of {name} do not cover [{start}, {end})"
            )
        return out

    def _one_piece(self, name: str, kind: str, start: int, end: int) -> torch.Tensor | None:
        """``[start, end)`` read straight into the buffer returned, when one fp32 piece of a
        format-3 file holds all of it (no second buffer, no copy: [Note: export memory])."""
        for file, lo, hi in self._entry(name)["pieces"]:
            if lo <= start and end <= hi and start < end:
                opened = self._open(file)
                key = f"{self._aliases.get(name, name)}/{kind}"
                if isinstance(opened, SafetensorsFile) and _dtype_of(opened, key) == torch.float32:
                    return opened.read(key, 0, start - lo, end - lo)
        return None

    @property
    def optimizer_states(self) -> str:
        """How the saving run stored its Adam moments (``Config.optimizer_states``)."""
        return self.manifest.get("optimizer_states", "fp32")

    @property
    def chunk_size(self) -> int | None:
        """The saving run's chunk size (None when not recorded)."""
        return self.manifest.get("plan", {}).get("chunk_size")

    def stored_piece(
        self, name: str, kind: str, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """int8 moments: (codes, block scales, phase) of the one piece that is exactly elements
        ``[start, end)`` of ``name`` (a resumed run of the same layout restores them as they
        were); None when the moment is not int8 or no piece has those bounds."""
        if self.optimizer_states != "int8" or kind not in MOMENT_KINDS:
            return None
        for file, lo, hi in self._entry(name)["pieces"]:
            if (lo, hi) == (start, end):
                opened = self._open(file)
                key = f"{self._aliases.get(name, name)}/{kind}"
                return (
                    _whole(opened, key),
                    _whole(opened, f"{key}.scales"),
                    int(_whole(opened, f"{key}.phase")),
                )
        return None

    def files_for(self, name: str, start: int = 0, end: int | None = None) -> set[str]:
        """The files holding elements ``[start, end)`` of ``name``."""
        end = self.numel(name) if end is None else end
        return {
            file for file, lo, hi in self._entry(name)["pieces"] if max(lo, start) < min(hi, end)
        }

    def open_files(self, files: set[str]) -> None:
        """Open (and check against the manifest) ``files`` now: a caller that writes what it
        reads checks everything before the first write."""
        for file in sorted(files):
            self._open(file)

    def release(self) -> None:
        """Unmap the files opened so far (they stay checked): pages a read touched count in the
        process's resident memory until their file is unmapped, so a reader that goes through a
        whole checkpoint calls this after each parameter to hold one parameter's pages at a time."""
        self._files.clear()

    def tensor(self, name: str, kind: str = "master") -> torch.Tensor:
        """The whole-model ``kind`` of ``name`` in its original shape (fp32)."""
        return self.read(name, kind).view(self.shape(name))

    def engine_state(self) -> dict[str, Any]:
        """Loss scaler, step counter and optimizer hyper-parameters of the run (plain data only:
        [Note: checkpoints hold plain data])."""
        self._checked("engine.pt")
        return load_plain(self.path, "engine.pt")

    def extra(self, rank: int) -> dict[str, Any] | None:
        """What ``save_checkpoint(extra=...)`` stored for ``rank`` (None if nothing; plain data
        only: [Note: checkpoints hold plain data])."""
        name = f"extra-rank{rank:05d}.pt"
        if name not in self.manifest["files"]:
            return None
        self._checked(name)
        return load_plain(self.path, name)

    # -- internals ----------------------------------------------------------------------------
    def _entry(self, name: str) -> dict[str, Any]:
        key = self._aliases.get(name, name)
        if key not in self._params:
            raise KeyError(f"checkpoint {self.path} has no parameter {name!r}")
        return self._params[key]

    def _checked(self, file: str) -> Path:
        return check_file(self.path, file, self.manifest)

    def _open(self, file: str) -> SafetensorsFile | dict[str, torch.Tensor]:
        if file not in self._files:
            checked = file in self._verified or not self._check_on_open
            path = self.path / file if checked else self._checked(file)
            if file.endswith(".safetensors") and self._hash_reads:
                if file not in self.hashing:  # kept across ``release``: the hash goes on
                    self.hashing[file] = HashingReads(path)
                self._files[file] = SafetensorsFile(path, reads=self.hashing[file].read_into)
            elif file.endswith(".safetensors"):
                self._files[file] = SafetensorsFile(path)
            else:
                self._files[file] = load_plain(self.path, file, mmap=True)
            self._verified.add(file)
        return self._files[file]


def _whole(opened: SafetensorsFile | dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """Entry ``key`` of an opened checkpoint file (format 3 or 2), whole."""
    return opened.read(key) if isinstance(opened, SafetensorsFile) else opened[key]


def _dtype_of(opened: SafetensorsFile | dict[str, torch.Tensor], key: str) -> torch.dtype:
    if isinstance(opened, SafetensorsFile):
        return opened.entries[key].dtype
    return opened[key].dtype
