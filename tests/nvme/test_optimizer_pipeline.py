"""NVMeOptimizerPipeline: read -> update -> write of NVMe-resident states equals doing it in memory."""

from __future__ import annotations

import errno
import threading

import pytest
import torch
from tierwise.optim import AdamHyper, adam_update

pytest.importorskip("tierwise_nvme")

from nvme_helpers import FailingBackend  # noqa: E402
from tierwise.tiers import PayloadKind
from tierwise_nvme import NVMeIOError, StagingPool  # noqa: E402
from tierwise_nvme.backends import ThreadPoolBackend  # noqa: E402
from tierwise_nvme.optimizer_pipeline import NVMeOptimizerPipeline  # noqa: E402
from tierwise_nvme.tier import MAX_LOOKAHEAD  # noqa: E402

SIZES = [1000, 4097, 30_001, 7, 65_536, 12_345]


def adamw(grad: torch.Tensor, step: torch.Tensor):
    """The chunked update the engine would run: fused AdamW on (master, exp_avg, exp_avg_sq)."""

    def update(states: list[torch.Tensor]) -> None:
        master, exp_avg, exp_avg_sq = states
        adam_update(
            master=master,
            grad=grad,
            exp_avg=exp_avg,
            exp_avg_sq=exp_avg_sq,
            step=step,
            hyper=AdamHyper(
                lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True
            ),
        )

    return update


def setup_states(tier, generator):
    chunks = []
    for index, numel in enumerate(SIZES):
        slabs = [
            tier.allocate(
                numel, torch.float32, kind=PayloadKind.OPTIM_STATE, what=f"optim_chunk {index} {k}"
            )
            for k in range(3)
        ]
        states = [torch.randn(numel, generator=generator), torch.zeros(numel), torch.zeros(numel)]
        for slab, state in zip(slabs, states, strict=True):
            tier.write(slab, state).wait()
        grads = [torch.randn(numel, generator=generator) for _ in range(2)]
        chunks.append((slabs, states, grads))
    return chunks


def read_states(tier, slabs):
    outs = [torch.empty(slab.numel) for slab in slabs]
    for slab, out in zip(slabs, outs, strict=True):
        tier.read(slab, out).wait()
    return outs


@pytest.mark.parametrize("pool_buffers,prefetch", [(9, False), (9, True), (3, True), (4, False)])
def test_pipelined_updates_equal_in_memory_updates(make_tier, pool_buffers, prefetch):
    tier = make_tier("libaio")
    chunks = setup_states(tier, torch.Generator().manual_seed(0))
    pool = StagingPool(buffer_bytes=max(SIZES) * 4, count=pool_buffers)
    pipeline = NVMeOptimizerPipeline(tier=tier, pool=pool, lookahead=1)
    steps_ref = [torch.zeros(()) for _ in chunks]
    steps = [torch.zeros(()) for _ in chunks]
    for step in range(2):  # two optimizer steps; chunks submitted in backward order
        order = list(reversed(range(len(chunks))))
        if prefetch:  # a global check needs all gradients first: reads start during "backward"
            started = [pipeline.prefetch(i, chunks[i][0]) for i in order]
            # buffers are lent only while room for one more chunk remains; in the second step
            # the chunks the last drain read ahead into every free buffer count as started
            first = {(9, 0): 2, (9, 1): 3, (3, 0): 0, (3, 1): 1}[pool_buffers, step]
            assert started == [True] * first + [False] * (len(order) - first)
        for i in order:
            slabs, states, grads = chunks[i]
            adamw(grads[step], steps_ref[i])(states)  # the reference, in memory
            pipeline.submit(i, slabs, adamw(grads[step], steps[i]))
        pipeline.drain()
        for slabs, states, _ in chunks:
            for got, want in zip(read_states(tier, slabs), states, strict=True):
                assert torch.equal(got, want)
    assert pipeline.updated == 2 * len(chunks)
    # drain read ahead the next step's first chunks into every free buffer: (5, 4, 3) or (5)
    assert pool.lent == 3 * (pool_buffers // 3)
    pipeline.close()
    assert pool.lent == 0


def test_drain_reads_the_next_steps_first_chunks_ahead(make_tier):
    tier = make_tier("libaio")
    chunks = setup_states(tier, torch.Generator().manual_seed(7))
    pipeline = NVMeOptimizerPipeline(
        tier=tier, pool=StagingPool(buffer_bytes=max(SIZES) * 4, count=12), lookahead=2
    )
    steps_ref = [torch.zeros(()) for _ in chunks]
    steps = [torch.zeros(()) for _ in chunks]
    order = [2, 0, 5, 1, 4, 3]
    for step in range(2):
        reads_before_submit = tier.moves["nvme->host"]
        for i in order:
            slabs, states, grads = chunks[i]
            adamw(grads[step], steps_ref[i])(states)
            pipeline.submit(i, slabs, adamw(grads[step], steps[i]))
        pipeline.drain()
        # after the drain, the reads of the first chunks of this order (2, 0, 5, 1) are in
        # flight: 4 chunks' states fill the 12 buffers ([Note: read ahead in the last step's
        # order]); in the second step those 4 were not read again
        assert sorted(pipeline._prefetched) == [0, 1, 2, 5]
        assert tier.moves["nvme->host"] - reads_before_submit == 3 * (len(chunks) + 4 - 4 * step)
        for slabs, states, _ in chunks:  # (step 2 updates from the read-ahead copies)
            for got, want in zip(read_states(tier, slabs), states, strict=True):
                assert torch.equal(got, want)
    pipeline.close()
    assert tier.moves["nvme->host"] > 0


def landing_at_once(tier) -> None:
    """Make ``tier.write_next`` return only once its write is complete, so that a pipeline
    frees a chunk's buffers as soon as the chunk is updated (no timing decides the test)."""
    write_next = tier.write_next

    def landed_write_next(slab, buffer):
        handle = write_next(slab, buffer)
        handle.wait()
        return handle

    tier.write_next = landed_write_next


def test_states_are_read_ahead_of_submission_in_the_last_steps_order(make_tier):
    # [Note: read ahead in the last step's order]: in the second step every chunk's states are
    # read before it is submitted (backward would otherwise wait for each read), and the
    # updates from those copies equal the in-memory ones
    tier = make_tier("libaio")
    landing_at_once(tier)
    chunks = setup_states(tier, torch.Generator().manual_seed(8))
    pool = StagingPool(buffer_bytes=max(SIZES) * 4, count=9)  # 3 chunks' states
    pipeline = NVMeOptimizerPipeline(tier=tier, pool=pool, lookahead=1)
    steps_ref = [torch.zeros(()) for _ in chunks]
    steps = [torch.zeros(()) for _ in chunks]
    order = [4, 1, 5, 0, 3, 2]
    read_before_submit = []
    for step in range(3):
        for i in order:
            slabs, states, grads = chunks[i]
            adamw(grads[step % 2], steps_ref[i])(states)
            read_before_submit.append(i in pipeline._prefetched)
            done = threading.Event()  # the worker finished this chunk (and read ahead after it)
            pipeline.submit(i, slabs, adamw(grads[step % 2], steps[i]), on_done=done.set)
            done.wait(timeout=60)
        pipeline.drain()
        for slabs, states, _ in chunks:
            for got, want in zip(read_states(tier, slabs), states, strict=True):
                assert torch.equal(got, want)
    assert read_before_submit == [False] * 6 + [True] * 12
    pipeline.close()
    assert pool.lent == 0


def test_a_chunk_out_of_the_last_order_takes_the_read_ahead_buffers(make_tier):
    # every buffer holds a read-ahead chunk when one submitted out of order needs buffers: it
    # takes those of the chunk read furthest ahead, which is read again when submitted
    tier = make_tier("libaio")
    chunks = setup_states(tier, torch.Generator().manual_seed(9))[:3]
    pool = StagingPool(buffer_bytes=max(SIZES) * 4, count=6)  # 2 chunks' states
    pipeline = NVMeOptimizerPipeline(tier=tier, pool=pool, lookahead=1)
    steps_ref = [torch.zeros(()) for _ in chunks]
    steps = [torch.zeros(()) for _ in chunks]
    for step, order in enumerate(([0, 1, 2], [2, 0, 1])):
        for i in order:
            slabs, states, grads = chunks[i]
            adamw(grads[step], steps_ref[i])(states)
            done = threading.Event()  # one at a time: chunk 2 finds every buffer read ahead
            pipeline.submit(i, slabs, adamw(grads[step], steps[i]), on_done=done.set)
            done.wait(timeout=60)
        if step == 0:
            pipeline.drain()
            assert list(pipeline._prefetched) == [0, 1]  # the whole pool, read ahead
            reads = tier.moves["nvme->host"]
    pipeline.drain()
    # chunk 2 (not read ahead) took chunk 1's buffers: 2 and 1 were read in the second step
    # (and the next step's first chunks, 2 and 0, after its drain)
    assert tier.moves["nvme->host"] - reads == 3 * (2 + 2)
    for slabs, states, _ in chunks:
        for got, want in zip(read_states(tier, slabs), states, strict=True):
            assert torch.equal(got, want)
    pipeline.close()
    assert pool.lent == 0


def test_updates_run_on_the_worker_while_the_caller_continues(make_tier):
    tier = make_tier("threads")
    chunks = setup_states(tier, torch.Generator().manual_seed(1))
    pipeline = NVMeOptimizerPipeline(
        tier=tier, pool=StagingPool(buffer_bytes=max(SIZES) * 4, count=9)
    )
    gate = threading.Event()
    threads = []

    def gated(states):
        gate.wait()  # blocks the worker, never the caller
        threads.append(threading.current_thread().name)

    for i, (slabs, _, _) in enumerate(chunks):
        pipeline.submit(i, slabs, gated)  # returns although no update can finish yet
    gate.set()
    pipeline.drain()
    assert threads == ["tierwise-nvme-optimizer"] * len(chunks)
    pipeline.close()


@pytest.mark.parametrize("writes", ["as-they-come", "land-at-once"])
def test_prefetched_chunks_update_first_and_still_match(make_tier, writes):
    # the engine prefetches the last chunks during backward but submits in chunk order at step:
    # the pipeline updates the prefetched ones first so their buffers do not sit idle, whether
    # or not earlier writes have landed when the worker can read ahead (which frees buffers)
    tier = make_tier("threads")
    if writes == "land-at-once":
        landing_at_once(tier)
    chunks = setup_states(tier, torch.Generator().manual_seed(5))
    pipeline = NVMeOptimizerPipeline(
        tier=tier, pool=StagingPool(buffer_bytes=max(SIZES) * 4, count=9)
    )
    assert [pipeline.prefetch(i, chunks[i][0]) for i in (5, 4)] == [True, True]
    holding, gate, order = threading.Event(), threading.Event(), []

    def hold(states):
        holding.set()
        gate.wait()

    pipeline.submit("gate", chunks[0][0], hold)
    holding.wait()  # the worker is inside this update: nothing else runs before the gate opens
    steps = [torch.zeros(()) for _ in chunks]
    for i, (slabs, states, grads) in enumerate(chunks):

        def update(states, i=i, grad=grads[0]):
            order.append(i)
            adamw(grad, steps[i])(states)

        pipeline.submit(i, slabs, update)
    reference = [[t.clone() for t in read_states(tier, slabs)] for slabs, _, _ in chunks]
    gate.set()
    pipeline.drain()
    assert order == [4, 5, 0, 1, 2, 3]
    for (slabs, _, grads), want in zip(chunks, reference, strict=True):
        adamw(grads[0], torch.zeros(()))(want)
        for got, expected in zip(read_states(tier, slabs), want, strict=True):
            assert torch.equal(got, expected)
    pipeline.close()


def test_a_write_to_a_prefetched_slab_drops_the_stale_copy(make_tier):
    # e.g. a checkpoint load after a skipped step: the update must see the new states
    tier = make_tier("libaio")
    chunks = setup_states(tier, torch.Generator().manual_seed(6))
    pipeline = tier.optimizer_pipeline(buffer_bytes=max(SIZES) * 4)
    slabs, _, grads = chunks[0]
    assert pipeline.prefetch("c", slabs)
    loaded = [torch.rand(slab.numel, generator=torch.Generator().manual_seed(7)) for slab in slabs]
    for slab, values in zip(slabs, loaded, strict=True):
        tier.write(slab, values).wait()
    assert pipeline.pool.lent == 0  # the prefetched buffers went back
    pipeline.submit("c", slabs, adamw(grads[0], torch.zeros(())))
    pipeline.drain()
    adamw(grads[0], torch.zeros(()))(loaded)
    for got, want in zip(read_states(tier, slabs), loaded, strict=True):
        assert torch.equal(got, want)
    pipeline.close()


def test_too_small_pool_is_a_clear_error(make_tier):
    tier = make_tier("threads")
    chunks = setup_states(tier, torch.Generator().manual_seed(2))
    pipeline = NVMeOptimizerPipeline(
        tier=tier, pool=StagingPool(buffer_bytes=max(SIZES) * 4, count=2)
    )
    pipeline.submit(0, chunks[0][0], lambda states: None)
    with pytest.raises(
        RuntimeError, match="cannot hold the 3 states of one chunk; give it at least 9"
    ):
        pipeline.drain()
    pipeline.close()


def test_failed_read_stops_updates_and_is_reported(make_tier):
    io = FailingBackend(
        ThreadPoolBackend(direct=True, block_size=1 << 20, queue_depth=8), fail_at=None
    )
    tier = make_tier("threads", io=io)
    chunks = setup_states(tier, torch.Generator().manual_seed(3))
    pipeline = NVMeOptimizerPipeline(
        tier=tier, pool=StagingPool(buffer_bytes=max(SIZES) * 4, count=3), lookahead=0
    )
    before = [read_states(tier, slabs) for slabs, _, _ in chunks]
    updated = []
    target = chunks[1][0][0]  # the first state slab of the second chunk
    io.fail_if = lambda request: (
        request.op == "read"
        and request.offset == target.offset
        and (request.path == str(target.extra["file"].path))
    )
    for i, (slabs, _, grads) in enumerate(chunks):
        step = torch.zeros(())

        def update(states, i=i, grad=grads[0], step=step):
            adamw(grad, step)(states)
            updated.append(i)

        pipeline.submit(i, slabs, update)
    with pytest.raises(NVMeIOError) as info:
        pipeline.drain()
    assert info.value.errno == errno.EIO and str(chunks[1][0][0].extra["file"].path) in str(
        info.value
    )
    assert updated == [0]  # neither the failed chunk nor any later one was updated
    for index, (slabs, _, _) in enumerate(chunks[1:], start=1):
        for got, want in zip(read_states(tier, slabs), before[index], strict=True):
            assert torch.equal(got, want)
    assert pipeline.pool.lent == 0
    pipeline.close()


def test_tier_builds_a_pipeline_sized_for_three_stages(make_tier):
    tier = make_tier("libaio", block_size=1 << 20, queue_depth=16)
    # reads of 16 MiB keep the disk's queue full: 16 MiB / (3 states * 4 MiB) -> 2 chunks ahead
    deep = tier.optimizer_pipeline(buffer_bytes=4 << 20)
    assert deep.lookahead == 2 and deep.pool.count == 3 * 4
    huge = tier.optimizer_pipeline(buffer_bytes=1 << 30)  # one chunk's states already fill it
    assert huge.lookahead == 1 and huge.pool.count == 9
    tiny = tier.optimizer_pipeline(buffer_bytes=4096)
    assert tiny.lookahead == MAX_LOOKAHEAD
    for pipeline in (deep, huge, tiny):
        pipeline.close()
    pipeline = tier.optimizer_pipeline(buffer_bytes=max(SIZES) * 4, lookahead=1)
    assert pipeline.pool.count == 9 and pipeline.lookahead == 1 and pipeline.tier is tier
    slabs, states, grads = setup_states(tier, torch.Generator().manual_seed(4))[0]
    pipeline.submit("c", slabs, adamw(grads[0], torch.zeros(())))
    adamw(grads[0], torch.zeros(()))(states)
    pipeline.close()
    for got, want in zip(read_states(tier, slabs), states, strict=True):
        assert torch.equal(got, want)


def test_the_pipeline_is_the_optimizer_pipeline_core_calls(tmp_path):
    """tierwise.tiers.base.OptimizerPipeline is what the engine calls; the NVMe tier's pipeline
    has every method of it."""
    from tierwise.config import Config
    from tierwise.tiers.base import OptimizerPipeline
    from tierwise_nvme import NVMeTier

    tier = NVMeTier(
        device=torch.device("cpu"),
        budget=None,
        config=Config(nvme_path=str(tmp_path), device="cpu"),
    )
    pipeline = tier.optimizer_pipeline(buffer_bytes=4096)
    try:
        assert isinstance(pipeline, OptimizerPipeline)
    finally:
        pipeline.close()
        tier.close()
