"""Small safetensors files written whole (adapters), with the mode ``save_pretrained`` gives.

Model weights are streamed instead, a tensor at a time: ``tierwise.weights.ShardedWriter``.
"""

from __future__ import annotations

import os

import torch


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
