"""torch.cuda as on a machine without CUDA, where every CUDA call fails the test."""

from __future__ import annotations

import torch

NO_CONTEXT_QUERIES = ("is_available", "_is_compiled", "is_current_stream_capturing")
"""Questions that create no CUDA context and touch no device, answered False as a CPU-only
machine answers them: torch._dynamo asks ``_is_compiled`` when it is first imported (transformers
imports it when a model class is first used), and transformers asks
``is_current_stream_capturing`` in its models' forward."""


def forbid_cuda_calls(monkeypatch) -> list[str]:
    """Patch every callable of torch.cuda but the no-context queries to raise (and record its
    name); those answer False. Returns the list of names called: a test asserts it empty."""
    calls: list[str] = []

    def forbidden(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"torch.cuda.{name} called on a CPU-only machine")

        return call

    for name in dir(torch.cuda):
        value = getattr(torch.cuda, name)
        if callable(value) and not isinstance(value, type) and name not in NO_CONTEXT_QUERIES:
            monkeypatch.setattr(torch.cuda, name, forbidden(name))
    for name in NO_CONTEXT_QUERIES:
        monkeypatch.setattr(torch.cuda, name, lambda: False)
    return calls
