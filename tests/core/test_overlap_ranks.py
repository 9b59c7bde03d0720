"""Several ranks keep the optimizer overlap ([Note: one collective order], [Note: speculative
updates]): a chunk that every rank had complete when its reduction was launched is final the
moment the reduction and the ranks' flags land, and its update starts then, during backward. The
result is bitwise the after-backward run's and matches DDP."""

from __future__ import annotations

import contextlib

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.multiproc import run_ranks
from helpers.overlap import ALWAYS, NEVER
from tierwise.parallel import collectives
from tierwise.runtime.grads.reduce.reducer import END

pytestmark = pytest.mark.multiprocess
CLIPS = [None, NEVER, NEVER, ALWAYS, NEVER]
"""max_norm per step (None: no clipping): kept speculations, and a rollback at step 3."""
MODES = ["in-backward", "speculative-kept", "speculative-kept", "rolled-back", "speculative-kept"]
SETTINGS = {
    "sharded": dict(shard=True, cache_blocks=2, param_placement="host"),
    "replicated": dict(shard=False, param_placement="device"),
    # [Note: reduction in rank order]: all-to-alls and a local sum instead of a reduce-scatter
    "rank-order": dict(shard=True, cache_blocks=2, param_placement="host", reduce_order="rank"),
}


class _Landed:
    """A collective that has completed (gloo's async reduce-scatter work reports
    ``is_completed() == False`` even after ``wait``)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class LandsAtOnce(collectives.TorchDistributed):
    """gloo collectives that have landed when they return. On a tiny model a real async gloo
    collective may still be in flight when backward ends, which would make *when* an update
    starts a matter of timing; here a reduction and its flags are in when the reducer next
    looks, so what runs in backward is decided by the rule alone."""

    def reduce_scatter_into(self, out, full, op, group, async_op):
        return _landed(super().reduce_scatter_into(out, full, op, group, async_op))

    def all_reduce(self, tensor, op, group, async_op):
        return _landed(super().all_reduce(tensor, op, group, async_op))

    def all_to_all_single(self, out, tensor, out_splits, in_splits, group, async_op=False):
        work = super().all_to_all_single(out, tensor, out_splits, in_splits, group, async_op)
        return _landed(work)


def _landed(work):
    if work is None:  # a blocking call
        return None
    work.wait()
    return _Landed()


@contextlib.contextmanager
def _backend(backend):
    previous = collectives.BACKEND
    collectives.BACKEND = backend
    try:
        yield
    finally:
        collectives.BACKEND = previous


def _setup(overlap, **options):
    """A tiny GPT-2 and its AdamW under tierwise, optimizer states in host memory."""
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=4096,
        optimizer_placement="host",
        optimizer_overlap=overlap,
        **options,
    )


def _tierwise(rank, world, settings, overlap, lands_at_once=False):
    backend = LandsAtOnce() if lands_at_once else collectives.BACKEND
    with _backend(backend):
        model, opt = _setup(overlap, **settings)
        engine = tierwise.engine_of(model)
        reducer = engine.gradients.reducer
        started = []  # (chunk key, in backward) of every update the host worker was given
        submit = engine.optimizer.host_updates.submit

        def recording_submit(chunk, *args, **kwargs):
            started.append((chunk.key, engine.phases.in_backward))
            return submit(chunk, *args, **kwargs)

        engine.optimizer.host_updates.submit = recording_submit
        syncs, due = [0], {}
        sync_point = reducer.sync_point

        def counting_sync_point(chunks_by_key):
            syncs[0] += 1
            sync_point(chunks_by_key)
            if syncs[0] == 1:  # the due points of this backward (predicted ones agreed by now)
                due.update(reducer.due)

        reducer.sync_point = counting_sync_point
        losses, steps = [], []
        for step, max_norm in enumerate(CLIPS):
            syncs[0] = 0
            due.clear()
            del started[:]
            loss = model(**tiny_batch(seed=1000 * step + rank)).loss
            loss.backward()
            if max_norm is not None:
                tierwise.clip_grad_norm_(model, max_norm)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            steps.append(
                dict(
                    # launched at a sync point (not at the end of backward) in this backward
                    at_sync=sorted(k for k, d in due.items() if d <= syncs[0]),
                    flagged=sorted(k for k, d in due.items() if d < END),  # due at a sync point
                    finalised=sorted(reducer.last_finalised),
                    started=list(started),
                    late=[k for kind, k in reducer.last_launches if kind == "late"],
                    mode=engine.optimizer.last_update_mode,
                )
            )
        state = {k: v.clone() for k, v in model.state_dict().items()}  # a collective
        chunks = sorted(reducer.order)
    engine.close()
    return dict(losses=losses, state=state, steps=steps, chunks=chunks)


def _ddp(rank, world):
    model = tiny_model("gpt2")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    losses = []
    for step, max_norm in enumerate(CLIPS):
        loss = ddp(**tiny_batch(seed=1000 * step + rank)).loss
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, state={k: v.clone() for k, v in model.state_dict().items()})


def _runs(rank, world, settings):
    return dict(
        ddp=_ddp(rank, world),
        after=_tierwise(rank, world, settings, "after-backward"),
        during=_tierwise(rank, world, settings, "in-backward"),
        at_once=_tierwise(rank, world, settings, "in-backward", lands_at_once=True),
    )


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_updates_start_when_reductions_land_and_match_after_backward_and_ddp(kind):
    for rank, runs in enumerate(run_ranks(_runs, 2, SETTINGS[kind], timeout=400)):
        after, ddp = runs["after"], runs["ddp"]
        assert [s["mode"] for s in after["steps"]] == ["after-backward"] * len(CLIPS)
        for name in ("during", "at_once"):
            got = runs[name]
            assert [s["mode"] for s in got["steps"]] == MODES, (rank, name)
            assert got["losses"] == after["losses"], (rank, name)
            for key, value in after["state"].items():
                assert torch.equal(got["state"][key], value), (rank, name, key)
            for step, record in enumerate(got["steps"]):
                assert not record["late"]  # a static model
                # every chunk due at a sync point (predicted from the forward in the first
                # backward and the first after the re-layout) was agreed complete on every
                # rank; those due after the last sync point (the embeddings) are launched at
                # the end of backward, their flags with them
                assert record["finalised"] == record["flagged"], (rank, name, step)
                assert record["at_sync"], (rank, name, step)
                assert set(record["at_sync"]) < set(record["flagged"]), (rank, name, step)
                # every chunk's update started once
                assert sorted(k for k, _ in record["started"]) == got["chunks"], (rank, step)
        for step, record in enumerate(runs["at_once"]["steps"]):
            # collectives that land at once: each of those updates started during backward,
            # the chunks launched at the end of backward after it
            in_backward = sorted(k for k, during in record["started"] if during)
            assert in_backward == record["at_sync"], (rank, step)
        for a, b in zip(after["losses"], ddp["losses"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), (rank, a, b)
        for name, value in ddp["state"].items():
            mine = after["state"][name.removeprefix("module.")]
            rel = (mine - value).abs().max() / value.abs().max()
            assert rel <= 1e-5, (rank, name, float(rel))


def _accumulate_without_hint(rank, world):
    model, opt = _setup("in-backward")
    engine = tierwise.engine_of(model)
    try:
        model(**tiny_batch(seed=rank)).loss.backward()  # its updates run: one backward a step
        with pytest.raises(RuntimeError) as caught:
            model(**tiny_batch(seed=10 + rank)).loss.backward()
        opt.zero_grad()  # the step is dropped: nothing of it is applied
    finally:
        engine.close()
    return str(caught.value)


def test_a_second_backward_after_in_backward_updates_is_refused_on_every_rank():
    # one process refuses this too (tests/nvme/test_optimizer_overlap.py); several ranks reach
    # the same refusal instead of an illegal gradient state transition
    for message in run_ranks(_accumulate_without_hint, 2):
        assert "a gradient arrived for a chunk whose optimizer update already ran" in message
        assert "Config.accumulation_steps" in message


def _accumulating(rank, world, overlap):
    model, opt = _setup(overlap, accumulation_steps=2, **SETTINGS["sharded"])
    engine = tierwise.engine_of(model)
    started = []  # the backward of the step (0, 1; 2 once the last one ended) of each update
    submit = engine.optimizer.host_updates.submit

    def recording_submit(chunk, *args, **kwargs):
        started.append(engine.phases.backwards_this_step)
        return submit(chunk, *args, **kwargs)

    engine.optimizer.host_updates.submit = recording_submit
    modes = []
    for step in range(3):
        for micro in range(2):
            (model(**tiny_batch(seed=100 * step + 10 * micro + rank)).loss / 2).backward()
        tierwise.clip_grad_norm_(model, NEVER)
        opt.step()
        opt.zero_grad()
        modes.append(engine.optimizer.last_update_mode)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine.close()
    return state, modes, started


def _accumulating_both(rank, world):
    return _accumulating(rank, world, "after-backward"), _accumulating(rank, world, "in-backward")


def test_accumulation_updates_early_only_in_the_last_backward():
    for want, got in run_ranks(_accumulating_both, 2):
        assert got[1] == ["speculative-kept"] * 3 and want[1] == ["after-backward"] * 3
        assert got[2] and all(backward >= 1 for backward in got[2])  # never in the first one
        for key, value in want[0].items():
            assert torch.equal(got[0][key], value), key
