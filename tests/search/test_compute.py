"""The compute term: measured layer times win over FLOPs; the CPU step model adds its parts."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_search")

from search_helpers import gpu_hardware, make_profile  # noqa: E402
from tierwise import Config, Hardware  # noqa: E402
from tierwise_search.compute import BACKWARD_OVER_FORWARD, ComputeRates, layer_times  # noqa: E402
from tierwise_search.search import search_plan  # noqa: E402

K = 1024


def test_measured_layer_times_win_over_flops_and_fill_the_gaps():
    profile = make_profile([[512], [512], [512]], layer_bytes=1000, layer_flops=1e9)
    # layer_flops: blk0 1e9, blk1 2e9, blk2 3e9; blk1 measured, root measured but has no FLOPs
    profile.layer_forward_s = {"blk1": 0.5, "": 0.25}
    times = layer_times(profile, ComputeRates(1e10, 1.0, 1e10))
    assert times.layers == {"blk0": 0.1, "blk1": 0.5, "blk2": 0.3, "": 0.25}
    assert times.forward_s == pytest.approx(1.15)
    assert times.step_s == pytest.approx((1 + BACKWARD_OVER_FORWARD) * 1.15)
    assert "measured" in times.source


def test_without_measurements_flops_over_the_probed_rate():
    profile = make_profile([[512], [512]], layer_bytes=1000, layer_flops=1e9)
    times = layer_times(profile, ComputeRates(1e10, 1.0, 1e10))
    assert times.forward_s == pytest.approx(0.3)
    assert "FLOPs" in times.source


def cpu_hardware() -> Hardware:
    return Hardware(
        device_type="cpu",
        h2d_bandwidth=4e9,
        d2h_bandwidth=2e9,
        device_adam_velocity=1e8,
        host_adam_velocity=1e8,
        device_flops=1e12,
        nvme_read_bandwidth=1e9,
        nvme_write_bandwidth=5e8,
    )


def nvme_plan(hardware: Hardware, *, chunk_size: int = 2 * K, **overrides):
    """Two modules of 2048 elements (forward 0.01 s and 0.02 s), parameters on host in two rCache
    blocks, optimizer states on NVMe."""
    return nvme_search(hardware, chunk_size=chunk_size, **overrides).predicted_step_s


def nvme_search(
    hardware: Hardware,
    *,
    chunk_size: int = 2 * K,
    clipping: bool = False,
    rollback_rate: float = 0.0,
    **overrides,
):
    """The plan ``nvme_plan`` describes."""
    profile = make_profile([[2 * K], [2 * K]], checkpoint=False)
    profile.layer_forward_s = {"blk0": 0.01, "blk1": 0.02}
    config = Config(
        device="cpu",
        device_memory=10**6,
        chunk_size=chunk_size,
        cache_blocks=2 if chunk_size < 4 * K else 1,
        param_placement="host",
        optimizer_placement="nvme",
        nvme_path="/tmp",
        **overrides,
    )
    return search_plan(profile, hardware, config, clipping=clipping, rollback_rate=rollback_rate)


# Hand figures for nvme_plan on cpu_hardware(): each chunk is fetched once (forward) and stays
# for backward; gradients (bf16) go to host once; per 2048-element chunk the pipeline reads and
# writes 12 B/element of states and runs Adam on the cores.
ELEMENTS = 4 * K
PHASE_FB = 3 * 0.03 + ELEMENTS * 2 / 4e9 + ELEMENTS * 2 / 2e9  # compute + fetches + gradients
READ, WRITE, ADAM = 2 * K * 12 / 1e9, 2 * K * 12 / 5e8, 2 * K / 1e8  # one chunk


def test_cpu_components_are_the_bytes_over_the_probed_rates():
    predicted = nvme_plan(cpu_hardware())
    expected = {
        "compute": 3 * 0.03,
        "h2d": ELEMENTS * 2 / 4e9,
        "d2h": ELEMENTS * 2 / 2e9,
        "nvme_read": 2 * READ,
        "nvme_write": 2 * WRITE,
        "optimizer": 2 * ADAM,
    }
    for name, value in expected.items():
        assert predicted[name] == pytest.approx(value, rel=1e-12), name


def test_cpu_nvme_optimizer_after_backward_queues_every_chunk_on_the_disk():
    # both chunks are handed over when backward ends: one disk reads and writes them in turn,
    # the last one's Adam between its read and write; the cores' Adam work (2 chunks) is shorter
    predicted = nvme_plan(cpu_hardware(), optimizer_overlap="after-backward")
    assert predicted["total"] == pytest.approx(PHASE_FB + 2 * (READ + WRITE) + ADAM, rel=1e-12)


def test_cpu_nvme_optimizer_in_backward_hides_all_but_the_last_chunk():
    # blk1's chunk has its gradients halfway through backward: its I/O ends long before backward
    # does, its Adam runs on the compute cores during backward (backward takes that much
    # longer); blk0's chunk (first in forward, last in backward) is only ready at the end
    for overlap in ("auto", "in-backward"):
        predicted = nvme_plan(cpu_hardware(), optimizer_overlap=overlap)
        expected = (PHASE_FB + ADAM) + READ + ADAM + WRITE
        assert predicted["total"] == pytest.approx(expected, rel=1e-12)


GRAD_WRITE = 2 * K * 2 / 5e8  # one chunk's bf16 gradient shard written to its NVMe region


def test_clipping_adds_the_gradient_writes_a_redo_needs():
    # [Note: speculation pricing]: with clipping an in-backward update may be rolled back, so
    # the engine writes each NVMe chunk's gradient shard to disk beside the update
    plain = nvme_search(cpu_hardware())
    clipped = nvme_search(cpu_hardware(), clipping=True)
    extra = clipped.predicted_bytes["nvme_write"] - plain.predicted_bytes["nvme_write"]
    assert extra == ELEMENTS * 2  # every bf16 gradient once
    for name in ("nvme_read", "h2d", "d2h"):
        assert clipped.predicted_bytes[name] == plain.predicted_bytes[name], name
    # the last chunk's gradient write adds to the queue's end; the first chunk's hides
    expected = (PHASE_FB + ADAM) + READ + ADAM + WRITE + GRAD_WRITE
    assert clipped.predicted_step_s["total"] == pytest.approx(expected, rel=1e-12)
    # after backward nothing is speculative: clipping adds nothing
    after = [
        nvme_search(cpu_hardware(), clipping=c, optimizer_overlap="after-backward")
        for c in (False, True)
    ]
    assert after[0].predicted_bytes == after[1].predicted_bytes
    assert after[0].predicted_step_s == after[1].predicted_step_s


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accumulation_overlaps_the_updates_with_the_last_backward_only(k):
    # k forward/backward phases, each moving what one moves; blk1's chunk is still hidden, but
    # only under the last phase: the hidden work stays one chunk's I/O while the step grows
    plan = nvme_search(cpu_hardware(), accumulation_steps=k)
    total = plan.predicted_step_s["total"]
    assert total == pytest.approx(k * PHASE_FB + ADAM + READ + ADAM + WRITE, rel=1e-12)
    serial = k * PHASE_FB + 2 * (READ + WRITE + ADAM)  # nothing overlapped
    hidden = serial - total
    assert hidden == pytest.approx(READ + WRITE, rel=1e-9)
    assert hidden / serial == pytest.approx(
        (READ + WRITE) / (k * PHASE_FB + 2 * (READ + WRITE + ADAM))
    )
    assert plan.predicted_bytes["h2d"] == pytest.approx(k * ELEMENTS * 2, rel=1e-12)
    assert plan.predicted_bytes["nvme_read"] == pytest.approx(2 * 2 * K * 12, rel=1e-12)


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_a_rollback_rate_adds_that_share_of_the_after_backward_update(rate):
    # a rolled-back step redoes its updates after backward (the after-backward path's optimizer
    # phase: both chunks queued on the disk, the last Adam between), reading the gradients
    # back from the disk the speculation wrote them to
    redo = 2 * (READ + WRITE) + ADAM + ELEMENTS * 2 / 1e9
    after = nvme_plan(cpu_hardware(), optimizer_overlap="after-backward")
    assert after["optimizer_phase"] == pytest.approx(2 * (READ + WRITE) + ADAM, rel=1e-12)
    kept = nvme_search(cpu_hardware(), clipping=True).predicted_step_s
    rolled = nvme_search(cpu_hardware(), clipping=True, rollback_rate=rate).predicted_step_s
    assert rolled["rollback"] == pytest.approx(rate * redo, rel=1e-12)
    assert rolled["total"] - kept["total"] == pytest.approx(rate * redo, rel=1e-9)
    assert "rollback" not in kept


def test_one_chunk_for_the_whole_model_overlaps_nothing():
    # one 4096-element chunk: its gradients are complete only when backward ends
    predicted = nvme_plan(cpu_hardware(), chunk_size=4 * K)
    assert predicted["total"] == pytest.approx(PHASE_FB + 2 * (READ + WRITE + ADAM), rel=1e-12)


def test_a_slow_disk_queues_the_last_chunk_behind_the_first():
    # writes 1000x slower: blk1's chunk (ready halfway through backward) still writes when
    # backward ends, and blk0's chunk waits for it
    slow = cpu_hardware()
    slow.nvme_write_bandwidth = 5e5
    write = 2 * K * 12 / 5e5
    fb_end = PHASE_FB + ADAM  # blk1's chunk's Adam runs on the cores during backward
    backward_start = fb_end / 3  # forward is a third of compute
    first_ready = backward_start + (fb_end - backward_start) / 2
    assert first_ready + READ + write > fb_end  # the case this test is about
    predicted = nvme_plan(slow)
    expected = first_ready + 2 * (READ + write) + ADAM
    assert predicted["total"] == pytest.approx(expected, rel=1e-12)


def test_gpu_pipeline_runs_adam_beside_the_io():
    # on CUDA the host's cores are not the compute device: a chunk's service is the slowest of
    # its read, Adam and write, and Adam does not lengthen the forward/backward phase
    gpu = gpu_hardware(nvme_read_bandwidth=1e9, nvme_write_bandwidth=5e8, host_adam_velocity=1e8)
    predicted = nvme_plan(gpu, optimizer_overlap="after-backward")
    service = max(READ, WRITE, ADAM)
    phase_fb = predicted["compute"]  # a spare rCache block: transfers hide under compute
    assert predicted["total"] == pytest.approx(phase_fb + 2 * service, rel=1e-12)


def test_gpu_step_overlaps_what_cpu_adds():
    profile = make_profile([[2 * K], [2 * K]], checkpoint=False)
    profile.layer_forward_s = {"blk0": 0.01, "blk1": 0.02}
    config = Config(
        device="cpu",
        device_memory=10**6,
        chunk_size=2 * K,
        param_placement="host",
        optimizer_placement="host",
        optimizer_overlap="after-backward",  # host Adam in backward: the test below
    )
    gpu = search_plan(profile, gpu_hardware(), config).predicted_step_s
    # three blocks: one spare for prefetch, so fetches and gradient copies hide under compute
    assert gpu["total"] == pytest.approx(3 * 0.03 + gpu["optimizer"], rel=1e-12)


def test_host_updates_run_in_backward_only_where_their_undo_copies_fit():
    # [Note: speculation pricing]: on CUDA a host-resident chunk updates on the worker during
    # backward after an undo copy of its states (12 B/element) reserved in the host tier; in
    # hand-over order, only the copies that fit the room the model data leaves
    from tierwise import PlanError

    blocks = 8
    profile = make_profile([[2 * K] for _ in range(blocks)], checkpoint=False)
    profile.layer_forward_s = {f"blk{b}": 0.01 for b in range(blocks)}

    def plan(host_memory=None, overlap="auto"):
        config = Config(
            device="cpu",
            device_memory=10**6,
            chunk_size=2 * K,
            param_placement="host",
            optimizer_placement="host",
            optimizer_overlap=overlap,
            host_memory=host_memory,
        )
        return search_plan(profile, gpu_hardware(), config)

    adam = 2 * K / gpu_hardware().host_adam_velocity  # one chunk's host Adam
    after = plan(overlap="after-backward").predicted_step_s["total"]
    roomy = plan()
    # every update but the last chunk's (handed over when backward ends) hides under backward
    assert roomy.predicted_step_s["total"] == pytest.approx(after - (blocks - 1) * adam, rel=1e-9)
    assert any(f"all {blocks} chunks in backward" in line for line in roomy.reasons)
    with pytest.raises(PlanError) as info:
        plan(host_memory=1_000)
    # model data (the training-time need) + room of the load/save buffers' size: one undo copy
    # fits in that room
    tight = plan(host_memory=info.value.need + roomy.io_buffer_bytes)
    assert 2 * K * 12 <= tight.io_buffer_bytes < 2 * 2 * K * 12
    assert tight.predicted_step_s["total"] == pytest.approx(after - adam, rel=1e-9)
    assert any(
        f"1 of {blocks} chunks in backward, the others after backward: host_memory has no room"
        in line
        for line in tight.reasons
    )
