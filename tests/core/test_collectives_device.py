"""Every tensor a multi-rank step hands to a collective is on its group's device.

On NCCL a collective takes only tensors on the rank's CUDA device; gloo takes CPU tensors, so a
gloo run cannot show a CPU tensor slipping through. Here every group is a recording fake of an
NCCL-style group whose device is not the CPU the run computes on (tests/helpers/fake_nccl.py):
a tensor is on it only when the collectives layer put it there. Through a whole step (forward
and backward gathers and reductions, the clip norm, the fp16 overflow flag, the re-layout after
warm-up), the train command's stop flags and loss mean, and a checkpoint save and load, nothing
reaches a collective from anywhere else. [Note: collectives on the group's device]
"""

import pytest
import tierwise
import torch
from helpers.fake_nccl import RecordingNCCL
from helpers.models import tiny_batch, tiny_model
from helpers.multiproc import run_ranks
from tierwise.train.distributed import World, mean_over_ranks
from tierwise.train.interrupts import Agreement, StopRequest

pytestmark = pytest.mark.multiprocess


def _run(rank, world, path, fake):
    fake = RecordingNCCL() if fake else None
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    recorder = fake.installed() if fake is not None else _Nothing()
    losses = []

    def phase(name):
        if fake is not None:
            fake.phase = name

    with recorder:
        model, opt = tierwise.setup(
            model,
            opt,
            precision="fp16",
            device="cpu",
            chunk_size=4096,
            cache_blocks=3,
            param_placement="host",
            optimizer_placement="host",
        )
        for step in range(3):
            phase(f"forward/backward {step}")
            loss = model(**tiny_batch(seed=100 * step + rank)).loss
            loss.backward()
            phase(f"clip {step}")
            tierwise.clip_grad_norm_(model, 0.5)
            phase("step 0: fp16 overflow flag, re-layout" if step == 0 else f"step {step}")
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            phase("train: stop flags")
            me = World(rank=rank, size=world, device="cpu")
            Agreement(me, save_minutes=1e-9).after_step(StopRequest())
            phase("train: loss mean")
            mean_over_ranks(loss.item(), me)
        phase("save_checkpoint")
        tierwise.save_checkpoint(path, model, opt)
        phase("load_checkpoint")  # same world size: each rank reads its own file
        tierwise.load_checkpoint(path, model, opt)
        phase("state_dict")
        state = {k: v.clone() for k, v in model.state_dict().items()}
        phase("load_state_dict")  # whole-model values cut into shards: gathers chunks
        model.load_state_dict(state)
    if fake is None:
        return losses, state, None, None
    return losses, state, fake.calls, fake.misplaced


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _both(rank, world, path):
    return _run(rank, world, f"{path}/real", False), _run(rank, world, f"{path}/fake", True)


def test_every_collective_of_a_step_gets_tensors_on_the_groups_device(tmp_path):
    for real, fake in run_ranks(_both, 2, str(tmp_path)):
        losses, state, calls, misplaced = fake
        assert misplaced == []
        phases = {phase for phase, _ in calls}
        for expected in (
            "forward/backward 0",
            "clip 0",
            "step 0: fp16 overflow flag, re-layout",
            "train: stop flags",
            "train: loss mean",
            "save_checkpoint",
            "state_dict",
            "load_state_dict",
        ):
            assert expected in phases, (expected, sorted(phases))
        ops = {op for _, op in calls}
        assert {"all_gather", "reduce_scatter", "all_reduce", "broadcast_object"} <= ops
        assert {"all_gather_object", "barrier"} <= ops
        # the layer's moves and copies back change nothing: the same run without the fake
        assert losses == real[0]
        for name, value in real[1].items():
            assert torch.equal(state[name], value), name


def _rank_order(rank, world, shard, fake):
    fake = RecordingNCCL() if fake else None
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with fake.installed() if fake is not None else _Nothing():
        model, opt = tierwise.setup(
            model,
            opt,
            precision="fp32",
            device="cpu",
            chunk_size=4096,
            param_placement="host",
            optimizer_placement="host",
            shard=shard,
            reduce_order="rank",
        )
        for step in range(2):
            if fake is not None:
                fake.phase = f"backward {step}"
            loss = model(**tiny_batch(seed=100 * step + rank)).loss
            loss.backward()
            if fake is not None:
                fake.phase = f"step {step}"
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, state, (fake.calls, fake.misplaced) if fake is not None else None


def _rank_order_both(rank, world):
    return {
        shard: (_rank_order(rank, world, shard, False), _rank_order(rank, world, shard, True))
        for shard in (True, False)
    }


def test_reductions_in_rank_order_get_tensors_on_the_groups_device():
    """[Note: reduction in rank order]: its all-to-alls (async for sharded chunks, one waited
    for at launch and one async for replicated ones) take the block and the receive block on
    the group's device, and the fake's moves change nothing."""
    for result in run_ranks(_rank_order_both, 2):
        for shard, (real, (losses, state, (calls, misplaced))) in result.items():
            assert misplaced == [], shard
            backward = {op for phase, op in calls if phase.startswith("backward")}
            assert "all_to_all" in backward and "reduce_scatter" not in backward, backward
            assert losses == real[0], shard
            for name, value in real[1].items():
                assert torch.equal(state[name], value), (shard, name)
