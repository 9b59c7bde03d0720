"""Write tensors one at a time into safetensors shards named as ``save_pretrained`` names them.

At most one shard's tensors are held at once: a shard is written as soon as the next tensor would
take it past ``max_bytes`` (a tensor larger than that gets a shard of its own), then renamed
``model-0000i-of-0000n.safetensors`` with a ``model.safetensors.index.json`` when there are several,
or ``model.safetensors`` alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

MAX_SHARD_BYTES = 5 * 10**9
"""5 GB, as transformers reads max_shard_size="5GB"."""


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """``safetensors.torch.save_file`` with the file's mode from the umask (0644 under the
    usual 022), as ``save_pretrained``'s files get: save_file itself creates them 0600."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~current_umask())


class ShardWriter:
    """Collects tensors by name and writes them into shards of at most ``max_bytes``."""

    def __init__(
        self, folder: str | os.PathLike, *, max_bytes: int = MAX_SHARD_BYTES, prefix: str = "model"
    ):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.prefix = prefix
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._written):
            raise ValueError(f"ShardWriter: {name} was added twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.folder / f"{self.prefix}-part{len(self._written) + 1:05d}.safetensors.tmp"
        save_safetensors(self._pending, path)
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write what is left, name the shards and write the index; return the shard files."""
        if self._pending or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            final = [self.folder / f"{self.prefix}.safetensors"]
        else:
            final = [
                self.folder / f"{self.prefix}-{i:05d}-of-{count:05d}.safetensors"
                for i in range(1, count + 1)
            ]
        weight_map = {}
        for (tmp, names), path in zip(self._written, final, strict=True):
            os.replace(tmp, path)
            weight_map.update(dict.fromkeys(names, path.name))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / f"{self.prefix}.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        return final
