"""Expert and tensor parallelism through ``tierwise.setup(..., parallel={...})``: chunks, offload
and sharding over each pattern's data-parallel group, against single-process PyTorch."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_moe")
pytest.importorskip("transformers")

import moe_workers as w  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess
TOLERANCE = 1e-5
OFFLOAD = dict(param_placement="host", optimizer_placement="host", cache_blocks=3)
ON_DEVICE = dict(param_placement="device", optimizer_placement="device")


@pytest.fixture(scope="module")
def runs():
    """Engine runs by (kind, world, parallel, settings), computed once per module."""
    cache = {}

    def get(kind, world, parallel, settings):
        key = (kind, world, tuple(parallel.items()), tuple(settings.items()))
        if key not in cache:
            cache[key] = run_ranks(w.engine_run, world, kind, parallel, settings)
        return cache[key]

    return get


def _assert_matches(ranks, ref):
    for result in ranks:
        for got, want in zip(result["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= TOLERANCE * abs(want)
        for name, want in ref["state"].items():
            assert w.max_relative_error(result["state"][name], want) <= TOLERANCE, name


@pytest.mark.parametrize(
    "kind, world",
    [("mixtral", 2), ("mixtral", 4), ("qwen2_moe", 2)],
    ids=["mixtral-ep2", "mixtral-ep2xdp2", "qwen2_moe-ep2"],
)
def test_expert_parallel_with_offload_matches_single_process(kind, world, runs):
    _assert_matches(runs(kind, world, {"expert": 2}, OFFLOAD), w.reference_run(kind))


def test_expert_and_tensor_parallel_together_match_single_process(runs):
    # 4 ranks: tensor groups {0,1} {2,3} (same batch), expert groups {0,2} {1,3}
    ranks = runs("mixtral", 4, {"expert": 2, "tensor": 2}, OFFLOAD)
    _assert_matches(ranks, w.reference_run("mixtral"))
    assert [r["model_parallel_ranks"] for r in ranks] == [
        {"expert": [0, 2], "tensor": [0, 1]},
        {"expert": [1, 3], "tensor": [0, 1]},
        {"expert": [0, 2], "tensor": [2, 3]},
        {"expert": [1, 3], "tensor": [2, 3]},
    ]
    for result in ranks:
        groups = result["groups"]
        assert groups["expert/g0/train"]["dp_size"] == 2  # the tensor peers hold the same experts
        assert groups["tensor/g0/train"]["dp_size"] == 2
        assert groups["data/g0/train"]["dp_size"] == 4


def test_expert_chunks_are_sharded_over_the_ep_complement(runs):
    ranks = runs("mixtral", 4, {"expert": 2}, OFFLOAD)
    model = w.build_model("mixtral")
    expert_numel = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense_numel = sum(p.numel() for p in model.parameters()) - expert_numel
    for result in ranks:
        experts, dense = result["groups"]["expert/g0/train"], result["groups"]["data/g0/train"]
        # each rank keeps E/2 experts; their chunks are split over the 2 ranks holding them
        assert experts["param_numel"] == expert_numel // 2
        assert experts["dp_size"] == 2 and experts["sharded"]
        assert expert_numel // 4 <= experts["shard_numel"] <= expert_numel // 4 + 4096
        # everything else is split over all 4 ranks
        assert dense["param_numel"] == dense_numel
        assert dense["dp_size"] == 4 and dense["sharded"]
        assert dense_numel // 4 <= dense["shard_numel"] <= dense_numel // 4 + 4096


def test_tensor_parallel_host_offload_equals_all_on_device_bitwise(runs):
    on_host = runs("llama", 2, {"tensor": 2}, OFFLOAD)
    on_device = runs("llama", 2, {"tensor": 2}, ON_DEVICE)
    for host_rank, device_rank in zip(on_host, on_device, strict=True):
        assert host_rank["losses"] == device_rank["losses"]
        for name, value in device_rank["state"].items():
            assert (host_rank["state"][name] == value).all(), name
    assert on_host[0]["groups"]["tensor/g0/train"]["dp_size"] == 1
    _assert_matches(on_device, w.reference_run("llama", moe=False))
