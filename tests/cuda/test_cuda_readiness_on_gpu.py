"""The single-device GPU path (issue 28): what only a GPU can show of each defect. The CPU side
of each is in tests/core/test_cuda_readiness.py (and the files its note names)."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.devices import ONLY_CUDA, deterministic
from helpers.models import tiny_batch, tiny_model
from helpers.train import train
from tierwise import api
from tierwise.hookspecs import hookimpl
from tierwise.plugins import build_plugin_manager
from tierwise.runtime.residency.rcache import RCache


class MixedOptimizerPlanner:
    """Optimizer states of even chunks on the device, odd ones on the host (as search plans
    place them when the model exceeds the device budget)."""

    @hookimpl(tryfirst=True)
    def tierwise_make_plan(self, profile, hardware, config):
        from tierwise.planning.planner import default_plan

        plan = default_plan(profile=profile, hardware=hardware, config=config)
        groups = {info.group for info in profile.params}
        plan.optim_tiers = {g: ["device", "host"] * 64 for g in groups}
        return plan


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_clip_with_optimizer_states_on_device_and_host(device, monkeypatch):
    """Defect 1: the clip norm of gradients on two devices equals torch's on the same model."""
    host = build_plugin_manager(load_entry_points=False)
    host.pm.register(MixedOptimizerPlanner(), name="mixed")
    monkeypatch.setattr(api, "get_plugin_host", lambda: host)
    reference = tiny_model("gpt2").to(device)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, precision="fp32", device=device, chunk_size=5000)
    engine = tierwise.engine_of(model)
    assert {c.optim.tier.name for c in engine.chunks() if c.trainable} == {"device", "host"}
    with deterministic(device):
        batch = {k: v.to(device) for k, v in tiny_batch(seed=0).items()}
        model(**batch).loss.backward()
        got = tierwise.clip_grad_norm_(model, 0.5)
        reference(**batch).loss.backward()
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    # per-parameter norms of host chunks are taken by the CPU's kernel, not CUDA's
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()
    opt.step()
    engine.close()


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_cuda_without_index_lends_the_fixed_rcache_blocks(device, monkeypatch):
    """Defect 2: Config.device="cuda" becomes cuda:N, so the rCache lends its blocks."""
    lent: list[bool] = []
    original = RCache.lend

    def record(self, block_id, storage):
        lent.append(original(self, block_id, storage))
        return lent[-1]

    monkeypatch.setattr(RCache, "lend", record)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, device="cuda", param_placement="host", cache_blocks=3, chunk_size=5000
    )
    engine = tierwise.engine_of(model)
    assert engine.device == torch.device("cuda", torch.cuda.current_device())
    train(model, opt, 1)
    assert lent and all(lent)
    engine.close()


@pytest.mark.combined  # needs tierwise-profiler: the `all` env runs it ([Note: one env per test])
@pytest.mark.parametrize("device", ONLY_CUDA)
def test_warm_up_tracing_keeps_the_users_peak_memory_statistics(device):
    """Defect 8: the profiler's tracer runs during the warm-up step and leaves the CUDA peak
    that the user's code measured before it."""
    pytest.importorskip("tierwise_profiler")
    torch.cuda.reset_peak_memory_stats(device)
    big = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    del big
    peak = torch.cuda.max_memory_allocated(device)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, device=device, param_placement="host", cache_blocks=3)
    train(model, opt, 1)  # the warm-up step, traced
    assert tierwise.engine_of(model).tracing.memory_moments  # the tracer did run
    assert torch.cuda.max_memory_allocated(device) >= peak
    tierwise.engine_of(model).close()


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_host_gradient_shards_are_filled_without_a_wait_per_parameter(device, monkeypatch):
    """Defect 4: gradients going into host-resident shards are copied without blocking; each
    chunk's copies are waited for once ([Note: one host wait per chunk])."""
    from tierwise.runtime.grads.single_rank import SingleRankGrads

    blocking: list[tuple] = []
    original_copy, original_to = torch.Tensor.copy_, torch.Tensor.to
    originals = {name: getattr(torch.Tensor, name) for name in ("cpu", "item", "tolist")}

    def copy_(self, src, non_blocking=False):
        if self.device.type == "cpu" and src.device.type == "cuda" and not non_blocking:
            blocking.append(("copy_", tuple(src.shape)))
        return original_copy(self, src, non_blocking)

    def to(self, *args, **kwargs):  # .to("cpu") / .to(host_tensor.device), blocking or not
        out = original_to(self, *args, **kwargs)
        if self.device.type == "cuda" and out.device.type == "cpu":
            if not kwargs.get("non_blocking", False):
                blocking.append(("to", tuple(self.shape)))
        return out

    def reading(name):
        def read(self, *args, **kwargs):
            if self.device.type == "cuda":
                blocking.append((name, tuple(self.shape)))
            return originals[name](self, *args, **kwargs)

        return read

    waits: list = []
    original_land = SingleRankGrads._land_copies

    def land(self, chunk):
        if self.host_copies.in_flight(chunk.key):
            waits.append(chunk.key)
        return original_land(self, chunk)

    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device=device,
        param_placement="device",
        optimizer_placement="host",
        chunk_size=5000,
    )
    engine = tierwise.engine_of(model)
    train(model, opt, 1)  # warm-up and re-layout
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.Tensor, "to", to)
    for name in originals:  # any other device-to-host read in backward blocks too
        monkeypatch.setattr(torch.Tensor, name, reading(name))
    monkeypatch.setattr(SingleRankGrads, "_land_copies", land)
    batch = {k: v.to(device) for k, v in tiny_batch(seed=1).items()}
    model(**batch).loss.backward()
    trainable = [c for c in engine.chunks() if c.trainable]
    assert blocking == [], f"blocking device-to-host copies in backward: {blocking[:5]}"
    assert 0 < len(waits) == len(set(waits)) <= len(trainable)
    opt.step()
    engine.close()


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_accumulated_gradients_reach_host_shards_without_a_blocking_copy(device, monkeypatch):
    """Defect 4, accumulation: a second micro-batch's gradients are copied to the host without
    blocking and added once their chunk lands ([Note: one host wait per chunk]); the shards hold
    plain PyTorch's accumulated gradients bitwise (fp32, the same CUDA kernels, IEEE adds)."""
    from tierwise.runtime.grads.storage import slot_grad

    blocking: list[tuple] = []
    original_copy, original_to = torch.Tensor.copy_, torch.Tensor.to

    def copy_(self, src, non_blocking=False):
        if self.device.type == "cpu" and src.device.type == "cuda" and not non_blocking:
            blocking.append(tuple(src.shape))
        return original_copy(self, src, non_blocking)

    def to(self, *args, **kwargs):
        out = original_to(self, *args, **kwargs)
        if self.device.type == "cuda" and out.device.type == "cpu":
            blocking.append(tuple(self.shape))
        return out

    torch.manual_seed(0)
    plain = tiny_model("gpt2").to(device)
    model = tiny_model("gpt2")
    model.load_state_dict({k: v.cpu() for k, v in plain.state_dict().items()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device=device,
        param_placement="device",
        optimizer_placement="host",
        chunk_size=5000,
        accumulation_steps=2,
        optimizer_overlap="after-backward",  # the shards are read after backward here
    )
    engine = tierwise.engine_of(model)
    batches = [{k: v.to(device) for k, v in tiny_batch(seed=s).items()} for s in (1, 2)]
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.Tensor, "to", to)
    for batch in batches:
        model(**batch).loss.backward()
    monkeypatch.undo()
    assert blocking == [], "a gradient reached its host shard through a blocking copy"
    assert engine.gradients.host_copies.waits > 0
    for batch in batches:
        plain(**batch).loss.backward()
    reference = dict(plain.named_parameters())
    for chunk in engine.chunks():
        if chunk.trainable:
            shard = engine.gradients.grad_shard(chunk)
            assert shard.device.type == "cpu"
            for slot in chunk.slots:
                got = slot_grad(chunk, shard, slot)
                want = reference[slot.name].grad.reshape(-1).cpu()
                assert torch.equal(got, want), slot.name
    engine.close()


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_pinned_memory_is_one_budget_counted_in_host_memory(device):
    """Defect 5: the activation swaps' pinned buffers are Config.pinned_memory, reserved in the
    host tier; host slabs are slices of one registered arena (is_pinned), counted whole."""
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        device=device,
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
        activation_offload="host",
        pinned_memory="64MiB",
    )
    engine = tierwise.engine_of(model)
    host = engine.tiers["host"]
    slabs = sum(c.home.nbytes for c in engine.chunks() if c.home.tier is host)
    assert engine.activations.pool.capacity == 64 << 20
    assert host.used_bytes >= slabs + (64 << 20)
    assert all(c.home.tensor.is_pinned() for c in engine.chunks() if c.home.tier is host)
    # [Note: one pinned arena]: every host slab of setup sits in one registered extent
    assert host.arena.registrations == 1
    assert host.used_bytes == host.arena.registered_bytes + (64 << 20)
    train(model, opt, 2)
    engine.close()


@pytest.mark.combined  # needs tierwise-nvme: the `all` env runs it ([Note: one env per test])
@pytest.mark.parametrize("device", ONLY_CUDA)
def test_nvme_reads_into_device_memory_copy_on_the_issuing_stream(device, tmp_path):
    """Defect 3: a read into device memory issued on a side stream (as a prefetch is) is
    copied there by the engine's thread, and the compute stream waits for its event."""
    pytest.importorskip("tierwise_nvme")
    from tierwise.config import Config
    from tierwise.tiers import PayloadKind
    from tierwise_nvme import NVMeOptions, NVMeTier
    from tierwise_nvme.transfer import DeviceRead

    tier = NVMeTier(
        device=torch.device(device),
        budget=None,
        config=Config(nvme_path=str(tmp_path), device=device),
        options=NVMeOptions(backend="threads"),
    )
    n = 1 << 22
    slab = tier.allocate(n, torch.int32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk 0")
    tier.write(slab, torch.arange(n, dtype=torch.int32)).wait()
    out = torch.zeros(n, dtype=torch.int32, device=device)
    side = torch.Stream(device=device)
    torch.accelerator.synchronize(device)
    with side:
        handle = tier.read(slab, out)
    assert isinstance(handle, DeviceRead) and handle.stream == side
    handle.wait()  # the compute stream waits for the copy's event
    assert int(out.sum(dtype=torch.int64)) == n * (n - 1) // 2
    tier.release(slab)
    tier.close()
