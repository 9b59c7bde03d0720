"""A model built on the meta device, set up with the profiler installed: the pre-runtime profile
(from ``example_batch``) and the warm-up tracer of the first step run on it, and it trains
exactly like the same model built on the CPU (issue 16: the tracer copied meta rotary buffers)."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_profiler")
pytest.importorskip("transformers")

from helpers.meta import assert_meta_trains_like_cpu  # noqa: E402
from helpers.models import tiny_batch  # noqa: E402
from tierwise.plugins import get_plugin_host  # noqa: E402


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2_moe"])
def test_meta_model_profiled_and_traced_trains_like_the_cpu_model(family):
    plugged = {h for info in get_plugin_host().infos() if info.name != "core" for h in info.hooks}
    assert {"tierwise_profile_model", "tierwise_memory_tracer"} <= plugged  # the profiler's
    assert_meta_trains_like_cpu(family, example_batch=tiny_batch())
