"""A checkpoint's manifest: what files it has (sizes, SHA-256), who wrote it, and where each
parameter's pieces are.

[Note: checkpoint manifest]
``manifest.json`` is the last file written into a checkpoint directory (by rank 0, after every
rank has written and hashed its own files) and the directory is swapped in only after it, so a
checkpoint without one is incomplete by construction. Loading checks every file the manifest
lists for presence and size, and the checksum of each file a rank opens; a mismatch raises
:class:`CheckpointError` naming the file, which ``tierwise train --resume`` answers by falling
back to the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT_VERSION = 3
READABLE_FORMATS = (2, 3)
"""Format 3 stores each rank's pieces as one safetensors file, written and read a piece at a time
([Note: reading weights without mapping files]); format 2 (a torch.save dict) is still read."""


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, corrupt or not one tierwise can read."""


def sha256_of(path: Path, block: int = 1 << 20) -> str:
    """The file's SHA-256, read in blocks (never the whole file in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while data := handle.read(block):
            digest.update(data)
    return digest.hexdigest()


def describe(path: Path) -> dict[str, Any]:
    """Size and checksum of a file just written (fsynced first)."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    file = folder / MANIFEST
    with open(file, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of checkpoint ``folder`` after checking every listed file's presence and
    size (checksums are checked per file when it is opened: :func:`check_file`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder}: no such directory")
    file = folder / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {folder} is incomplete: it has no {MANIFEST} (a save was interrupted, "
            "or it was written by a tierwise older than 0.1 checkpoints with manifests)"
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is unreadable ({err})") from None
    if manifest.get("format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"checkpoint {folder} has format {manifest.get('format')!r}; this tierwise reads "
            f"formats {', '.join(map(str, READABLE_FORMATS))}"
        )
    for name, entry in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is incomplete: {name} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {folder} is corrupt: {name} has {size} bytes, the manifest says "
                f"{entry['bytes']}"
            )
    return manifest


def check_file(folder: Path, name: str, manifest: dict[str, Any]) -> Path:
    """``folder/name`` after checking its checksum against the manifest."""
    path = Path(folder) / name
    expected = manifest["files"][name]["sha256"]
    if sha256_of(path) != expected:
        raise CheckpointError(
            f"checkpoint {folder} is corrupt: {name} does not match its checksum in {MANIFEST}"
        )
    return path


def verify(folder: str | os.PathLike) -> dict[str, Any]:
    """Check a whole checkpoint (sizes and every checksum); return its manifest."""
    manifest = read_manifest(folder)
    for name in manifest["files"]:
        check_file(Path(folder), name, manifest)
    return manifest
