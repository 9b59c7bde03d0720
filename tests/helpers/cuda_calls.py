"""torch.cuda as on a machine without CUDA, where every CUDA call fails the test."""

from __future__ import annotations

import torch

BUILD_QUERIES = ("is_available", "_is_compiled")
"""Questions about the torch build that touch no device and create no CUDA context: what a
CPU-only machine answers without CUDA (torch._dynamo asks ``_is_compiled`` when it is first
imported, which transformers does when a model class is first used)."""


def forbid_cuda_calls(monkeypatch) -> list[str]:
    """Patch every callable of torch.cuda but the build queries to raise (and record its name);
    ``is_available`` answers False. Returns the list of names called: a test asserts it empty."""
    calls: list[str] = []

    def forbidden(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"torch.cuda.{name} called on a CPU-only machine")

        return call

    for name in dir(torch.cuda):
        value = getattr(torch.cuda, name)
        if callable(value) and not isinstance(value, type) and name not in BUILD_QUERIES:
            monkeypatch.setattr(torch.cuda, name, forbidden(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    return calls
