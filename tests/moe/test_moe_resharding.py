"""A checkpoint saved under expert or tensor parallelism loads without it (and the other way):
masters and moments are stored by whole-model parameter name, so the next step on the same
global batch matches the saving run's next step."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_moe")
pytest.importorskip("transformers")

import moe_workers as w  # noqa: E402
import tierwise  # noqa: E402
import torch  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402
from tierwise.checkpoint.reader import KINDS, CheckpointReader  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _build(kind, parallel):
    model = w.build_model(kind)
    opt = w.make_optimizer(model)
    return tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=4096,
        parallel=parallel,
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
    )


def _step(model, opt, rank, world, parallel):
    tensor = parallel.get("tensor", 1)
    model(**w.batch_slice(w.global_batch(), rank // tensor, world // tensor)).loss.backward()
    opt.step()
    opt.zero_grad()


def _save(rank, world, kind, parallel, path):
    model, opt = _build(kind, parallel)
    for _ in range(2):
        _step(model, opt, rank, world, parallel)
    tierwise.save_checkpoint(path, model, opt)
    saved = model.state_dict()
    _step(model, opt, rank, world, parallel)
    return saved, model.state_dict()


def _load(rank, world, kind, parallel, path, resaved):
    model, opt = _build(kind, parallel)
    tierwise.load_checkpoint(path, model, opt)
    loaded = model.state_dict()
    tierwise.save_checkpoint(resaved, model, opt)
    _step(model, opt, rank, world, parallel)
    return loaded, model.state_dict()


@pytest.mark.parametrize(
    ("kind", "old", "new"),
    [
        ("mixtral", (2, {"expert": 2}), (1, {})),
        ("llama", (2, {"tensor": 2}), (2, {})),
        ("mixtral", (1, {}), (2, {"expert": 2})),
    ],
    ids=["ep2-to-1-rank", "tp2-to-dp2", "1-rank-to-ep2"],
)
def test_model_parallel_layout_changes_on_resume(tmp_path, kind, old, new):
    path, resaved = str(tmp_path / "ckpt"), str(tmp_path / "again")
    saved, reference_next = run_ranks(_save, old[0], kind, old[1], path)[0]
    loaded, next_state = run_ranks(_load, new[0], kind, new[1], path, resaved)[0]
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    first, second = CheckpointReader(path), CheckpointReader(resaved)
    for name in first.names():
        assert first.step(name) == second.step(name)
        for kind_ in KINDS:
            assert torch.equal(first.tensor(name, kind_), second.tensor(name, kind_)), (name, kind_)
    for name, value in reference_next.items():
        assert w.max_relative_error(next_state[name], value) <= 1e-5, name
