"""Fixtures for the NVMe tier tests: a tier factory on a real on-disk temp dir, per backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from nvme_helpers import is_tmpfs, require_libaio


@pytest.fixture
def nvme_dir(tmp_path: Path) -> Path:
    if is_tmpfs(tmp_path):
        pytest.skip(f"{tmp_path} is on tmpfs; the NVMe tests need a directory on a disk")
    return tmp_path


@pytest.fixture
def make_tier(nvme_dir):
    """``make_tier(backend="libaio"|"threads"|"buffered", device="cpu", **options)`` -> a tier
    closed after the test; ``device`` is the compute device (pinned staging on "cuda")."""
    from tierwise.config import Config
    from tierwise_nvme import NVMeOptions, NVMeTier

    tiers = []

    def make(
        backend: str = "libaio",
        *,
        directory: Path | None = None,
        budget=None,
        io=None,
        device: str = "cpu",
        **options,
    ):
        if backend == "libaio":
            require_libaio()
        tier = NVMeTier(
            device=torch.device(device),
            budget=budget,
            config=Config(nvme_path=str(directory or nvme_dir), device=device),
            options=NVMeOptions(backend=backend, **options),
            backend=io,
        )
        if backend == "libaio" and io is None:
            assert tier.backend.name == "libaio", (
                "libaio.so.1 is missing (Debian: apt-get install libaio1)"
            )
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()
