"""StepMemoryTracer on the CPU: checked against peak RSS and against the fake-tensor profile."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tierwise_profiler")

import torch  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from profiler_reference import drop_grads  # noqa: E402
from tierwise_profiler import StepMemoryTracer  # noqa: E402
from tierwise_profiler.model_profile import profile_model  # noqa: E402

RSS_STEP = textwrap.dedent(
    """
    import json, torch
    from tierwise_profiler import StepMemoryTracer

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    torch.manual_seed(0)
    # 64 MiB activations: above glibc's mmap threshold, so freed memory leaves RSS at once
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU()) for _ in range(3)])
    x = torch.randn(8192, 2048)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    for _ in range(2):  # warm-up: lazy one-time allocations of the first steps, and the
        warm = StepMemoryTracer("cpu")  # tracer's own code paged in (file-backed pages count in RSS)
        warm.start()
        model(x).sum().backward()
        warm.stop()
    open("/proc/self/clear_refs", "w").write("5")  # reset the RSS high-water mark
    before = status("VmRSS:")
    tracer = StepMemoryTracer("cpu")
    tracer.start()
    loss = model(x).sum()
    tracer.mark("forward")
    loss.backward()
    tracer.mark("backward")
    del loss
    moments = tracer.stop()
    print(json.dumps({"rss_peak": status("VmHWM:") - before, "tracer_peak": tracer.peak_bytes, "moments": moments}))
    """
)


def test_cpu_tracer_peak_matches_peak_rss():
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to reset the RSS high-water mark")
    result = subprocess.run(
        [sys.executable, "-c", RSS_STEP],
        capture_output=True,
        text=True,
        check=True,
        env={"OMP_NUM_THREADS": "1"},
    )
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["tracer_peak"] > 200 * 2**20  # several 64 MiB activations
    assert data["tracer_peak"] == pytest.approx(data["rss_peak"], rel=0.15)
    assert [name for name, _ in data["moments"]] == ["forward", "backward", "stop"]
    assert max(value for _, value in data["moments"]) == data["tracer_peak"]


def test_cpu_tracer_agrees_with_the_fake_tensor_profile():
    model = tiny_model("gpt2")
    batch = tiny_batch(batch=4, seq=32)
    profile = profile_model(model, batch, precision="fp32")
    handles = drop_grads(model)
    tracer = StepMemoryTracer("cpu")
    tracer.start()
    output = model(**batch)
    tracer.mark("forward")
    output.loss.backward()
    del output
    tracer.mark("backward")
    moments = tracer.stop()
    for handle in handles:
        handle.remove()
    assert tracer.peak_bytes == profile.peak_activation_bytes
    assert dict(moments)["forward"] >= sum(profile.layer_activation_bytes.values())


def test_tensors_made_before_start_or_while_paused_are_not_counted():
    before = torch.ones(1 << 20)
    tracer = StepMemoryTracer("cpu")
    tracer.start()
    view = before[: 1 << 19].view(-1, 2)  # a view of old memory allocates nothing
    with tracer.paused():
        chunk = torch.empty(1 << 20)  # the engine's own chunk allocation
    chunk.mul_(2)  # in place: no new storage
    made = before * 2  # 4 MiB of new memory
    tracer.mark("op")
    del made
    moments = tracer.stop()
    assert moments == [("op", 4 << 20), ("stop", 4 << 20)]
    assert view.shape == (1 << 18, 2)


def test_a_cuda_tracer_leaves_cuda_statistics_alone(monkeypatch):
    """Issue 28, defect 8: tracing the warm-up step on CUDA must not reset the process's CUDA
    peak-memory statistics (the user's own measurements). Every torch.cuda call fails here, so a
    tracer for "cuda" that resets, synchronises or reads them fails; it counts storages as on
    the CPU ([Note: the tracer leaves CUDA's statistics alone])."""
    from helpers.cuda_calls import forbid_cuda_calls

    calls = forbid_cuda_calls(monkeypatch)
    tracer = StepMemoryTracer("cuda", model_bytes=lambda: 0)
    tracer.start()
    made = torch.empty(1 << 20)  # 4 MiB
    tracer.mark("op")
    del made
    assert tracer.stop() == [("op", 4 << 20), ("stop", 4 << 20)]  # made lived into "stop"
    assert calls == []


def test_the_tracer_is_the_memory_tracer_core_calls():
    """tierwise.protocols.MemoryTracer is what the engine calls during warm-up; the profiler's
    tracer has every method of it."""
    from tierwise.protocols import MemoryTracer as TracerProtocol

    assert isinstance(StepMemoryTracer("cpu"), TracerProtocol)
