"""Checkpoints resharded by parameter name: saved on one world size / plan, loaded on another.

The reference is the saving run itself: its next step on a global batch, against the loading
run's next step on the same global batch split over its own ranks."""

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.multiproc import run_ranks
from tierwise.checkpoint.reader import KINDS, CheckpointReader

pytestmark = pytest.mark.multiprocess
GLOBAL_BATCH = 4
PLANS = {
    "zero3-host": dict(
        shard=True,
        chunk_size=2048,
        cache_blocks=2,
        param_placement="host",
        optimizer_placement="host",
    ),
    "device-big-chunks": dict(shard=True, chunk_size=8192, param_placement="device"),
    "replicated": dict(
        shard=False,
        chunk_size=4096,
        cache_blocks=3,
        param_placement="host",
        optimizer_placement="host",
    ),
}


def _global_step(model, opt, rank, world, step):
    rows = tiny_batch(batch=GLOBAL_BATCH, seed=100 + step)
    per = GLOBAL_BATCH // world
    batch = {k: v[rank * per : (rank + 1) * per] for k, v in rows.items()}
    model(**batch).loss.backward()
    tierwise.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()


def _build(plan):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tierwise.setup(model, opt, precision="fp32", device="cpu", **PLANS[plan])


def _save(rank, world, path, plan):
    model, opt = _build(plan)
    for step in range(3):
        _global_step(model, opt, rank, world, step)
    tierwise.save_checkpoint(path, model, opt)
    saved = model.state_dict()
    _global_step(model, opt, rank, world, 3)
    return saved, model.state_dict()


def _load(rank, world, path, plan, resaved):
    model, opt = _build(plan)
    tierwise.load_checkpoint(path, model, opt)
    loaded = model.state_dict()
    tierwise.save_checkpoint(resaved, model, opt)  # to compare moments and steps by name
    _global_step(model, opt, rank, world, 3)
    return loaded, model.state_dict()


@pytest.mark.parametrize(
    ("old", "new", "old_plan", "new_plan"),
    [
        (2, 1, "zero3-host", "zero3-host"),
        (1, 2, "zero3-host", "zero3-host"),
        (2, 4, "zero3-host", "zero3-host"),
        (2, 2, "zero3-host", "device-big-chunks"),
        (2, 2, "replicated", "zero3-host"),
    ],
)
def test_resharded_checkpoint_continues_like_the_saving_run(tmp_path, old, new, old_plan, new_plan):
    path, resaved = str(tmp_path / "ckpt"), str(tmp_path / "again")
    saved, reference_next = run_ranks(_save, old, path, old_plan)[0]
    loaded, next_state = run_ranks(_load, new, path, new_plan, resaved)[0]
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    first, second = CheckpointReader(path), CheckpointReader(resaved)
    assert (first.world_size, second.world_size) == (old, new)
    assert sorted(first.names()) == sorted(second.names())
    for name in first.names():
        assert first.step(name) == second.step(name) == 3.0
        for kind in KINDS:
            assert torch.equal(first.tensor(name, kind), second.tensor(name, kind)), (name, kind)
    for name, value in reference_next.items():
        rel = (next_state[name] - value).abs().max() / value.abs().max()
        assert rel <= 1e-5, (name, float(rel))


def _opened_files(rank, world, path, plan):
    from tierwise.checkpoint.reader import CheckpointReader as Reader

    opened = []
    real = Reader._open

    def recording(self, file):
        opened.append(file)
        return real(self, file)

    Reader._open = recording
    model, opt = _build(plan)
    tierwise.load_checkpoint(path, model, opt)
    return sorted(set(opened))


def test_each_rank_reads_only_the_files_holding_its_shard(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 2, path, "zero3-host")
    assert run_ranks(_opened_files, 2, path, "zero3-host") == [
        ["rank00000-of-00002.safetensors"],
        ["rank00001-of-00002.safetensors"],
    ]


def test_each_rank_of_a_larger_world_reads_only_the_files_holding_its_shard(tmp_path):
    """2 -> 4 ranks with the same chunks: a new rank's shard is half of an old rank's, so it
    opens that rank's file only (and reads only the bytes of its own pieces)."""
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 2, path, "zero3-host")
    assert run_ranks(_opened_files, 4, path, "zero3-host") == [
        ["rank00000-of-00002.safetensors"],
        ["rank00000-of-00002.safetensors"],
        ["rank00001-of-00002.safetensors"],
        ["rank00001-of-00002.safetensors"],
    ]
