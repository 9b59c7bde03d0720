"""Compute devices for device-parametrized tests: "cpu" always, "cuda" when a GPU is present.

``@pytest.mark.parametrize("device", DEVICES)`` runs a test once per device. The cuda case carries
the ``cuda`` marker (``pytest -m cuda`` selects only it, as bench/gpu/run.sh does) and is skipped
with a reason on a machine without CUDA, so it never fails or passes silently there.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
NO_CUDA_REASON = (
    "no CUDA device (torch.cuda.is_available() is False); bench/gpu/run.sh tests runs it on a GPU"
)

CUDA = pytest.param(
    "cuda",
    id="cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)],
)
DEVICES = [pytest.param("cpu", id="cpu"), CUDA]
ONLY_CUDA = [CUDA]


@contextlib.contextmanager
def deterministic(device: str):
    """On CUDA, pick PyTorch's deterministic kernels where one exists (bitwise comparisons
    between runs need them: atomics in a backward reorder additions); restores the setting.
    The cuBLAS side needs CUBLAS_WORKSPACE_CONFIG, set in tests/conftest.py before any CUDA use."""
    if torch.device(device).type != "cuda":
        yield
        return
    before, before_warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn)


def synchronize(device: str | torch.device) -> None:
    """Wait for everything queued on ``device`` (no-op on CPU)."""
    device = torch.device(device)
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
