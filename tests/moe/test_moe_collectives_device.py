"""MoE's collectives (expert all-to-all, tensor-parallel all-reduces, shard gathers for whole-model
state dicts) get tensors on their group's device: every group is a recording fake of an
NCCL-style group (tests/helpers/fake_nccl.py, [Note: collectives on the group's device])."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_moe")
pytest.importorskip("transformers")

import moe_workers as w  # noqa: E402
import numpy  # noqa: E402
from helpers.fake_nccl import RecordingNCCL  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess
SETTINGS = dict(param_placement="host", optimizer_placement="host", cache_blocks=3)


def _both(rank, world, kind, parallel):
    real = w.engine_run(rank, world, kind, parallel, SETTINGS, steps=2)
    fake = RecordingNCCL()
    with fake.installed():
        faked = w.engine_run(rank, world, kind, parallel, SETTINGS, steps=2)
    return real, faked, fake.calls, fake.misplaced


@pytest.mark.parametrize(
    "kind,parallel,ops",
    [
        ("mixtral", {"expert": 2}, {"all_to_all", "all_gather_list"}),
        ("llama", {"tensor": 2}, {"all_reduce", "all_gather_list"}),
    ],
)
def test_moe_collectives_get_tensors_on_the_groups_device(kind, parallel, ops):
    for real, faked, calls, misplaced in run_ranks(_both, 2, kind, parallel):
        assert misplaced == []
        assert ops <= {op for _, op in calls}
        assert faked["losses"] == real["losses"]
        for name, value in real["state"].items():
            assert numpy.array_equal(faked["state"][name], value), name  # portable(): numpy
