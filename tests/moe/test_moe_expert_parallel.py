"""Expert parallelism against single-process PyTorch (no tierwise engine: AdamW per rank and
gradients averaged by hand over each parameter's data-parallel group)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_moe")
pytest.importorskip("transformers")

import moe_workers as w  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402

TOLERANCE = 1e-5
EXPERTS = 4


@pytest.fixture(scope="module")
def references():
    """Single-process runs by model kind, computed once per module."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = w.reference_run(kind)
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def expert_parallel_runs():
    """Per-rank results of expert-parallel size 2 by (kind, world), computed once per module."""
    cache = {}

    def get(kind, world):
        if (kind, world) not in cache:
            cache[kind, world] = run_ranks(w.parallel_run, world, kind, "expert", 2)
        return cache[kind, world]

    return get


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4], ids=["ep2", "ep2xdp2"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_expert_parallel_matches_single_process(kind, world, references, expert_parallel_runs):
    ref = references(kind)
    # the routing the test relies on: every expert used first, then expert 3, then 2 and 3 unused
    assert ref["routed"] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2], [0, 1], [0, 1]]

    for result in expert_parallel_runs(kind, world):
        for got, want in zip(result["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= TOLERANCE * abs(want)
        for name, want in ref["first_grads"].items():
            assert w.max_relative_error(result["first_grads"][name], want) <= TOLERANCE, name
        for name, want in ref["state"].items():
            assert result["state"][name].shape == tuple(want.shape), name
            assert w.max_relative_error(result["state"][name], want) <= TOLERANCE, name
        assert result["reload_matches"]


@pytest.mark.multiprocess
def test_groups_routing_and_unrouted_experts_on_ep2xdp2(expert_parallel_runs):
    ranks = expert_parallel_runs("mixtral", 4)

    assert [r["mp_ranks"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["mp_rank"] for r in ranks] == [0, 1, 0, 1]
    # each rank holds 2 of 4 experts: model size minus half of the expert parameters
    full = sum(p.numel() for p in w.build_model("mixtral").parameters())
    experts = sum(
        p.numel() for n, p in w.build_model("mixtral").named_parameters() if ".experts." in n
    )
    assert all(r["param_numel"] == full - experts // 2 for r in ranks)

    # step 0: every expert computes rows on its rank (both layers)
    for expert in range(EXPERTS):
        owner = [r for r in ranks if r["mp_rank"] == expert // 2]
        assert all(sum(layer[expert % 2] for layer in r["local_rows"][0]) > 0 for r in owner)
    for r in ranks:
        if r["mp_rank"] == 1:
            # step 2: expert 3 idle; steps 3-4: the whole rank idle, its experts' gradients zero
            assert [layer[1] for layer in r["local_rows"][2]] == [0, 0]
            assert r["local_rows"][3] == [[0, 0], [0, 0]]
            assert r["zero_grad_experts"][2:] == [[3], [2, 3], [2, 3]]
        else:
            assert r["zero_grad_experts"] == [[]] * w.STEPS


@pytest.mark.multiprocess
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_capacity_factor_drops_like_brute_force(capacity_factor):
    ranks = run_ranks(w.capacity_run, 2, capacity_factor)

    for r in ranks:
        assert r["out_error"] <= TOLERANCE
        assert r["grad_error"] <= TOLERANCE
    total_dropped = sum(r["dropped"] for r in ranks)
    assert (total_dropped > 0) == (capacity_factor is not None)


def test_size_one_in_one_process_matches_hf_experts():
    from tierwise.config import Config
    from tierwise_moe import ExpertParallel, ShardedExperts

    batch = w.global_batch()
    reference = w.build_model("mixtral")
    model = w.build_model("mixtral")
    pattern = ExpertParallel(size=1, config=Config(device="cpu"), process_group=None)
    pattern.prepare(model)
    assert sum(isinstance(m, ShardedExperts) for m in model.modules()) == 2
    assert pattern.dp_group() is None

    reference(**batch).loss.backward()
    loss = model(**batch).loss
    loss.backward()
    assert abs(loss.item() - reference(**batch).loss.item()) <= TOLERANCE * loss.item()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert w.max_relative_error(param.grad, grads[name].grad) <= TOLERANCE, name


def test_prepare_shards_in_place_and_claims_only_expert_parameters():
    from tierwise.config import Config
    from tierwise_moe import ExpertParallel, ShardedExperts
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    model = tiny_model("qwen2_moe")
    params_before = list(model.parameters())
    pattern = ExpertParallel(size=1, config=Config(device="cpu"), process_group=None)
    with pytest.raises(RuntimeError, match="before prepare"):
        pattern.claims("x", None)
    pattern.prepare(model)
    pattern.prepare(model)  # idempotent
    assert list(model.parameters()) == params_before  # same objects: the optimizer keeps them
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, ShardedExperts) and isinstance(experts, Qwen2MoeExperts)
    claimed = sorted(n for n, p in model.named_parameters() if pattern.claims(n, p))
    assert claimed == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")
    ]  # the router, the shared expert and its gate stay data-parallel


def test_errors_say_what_to_change():
    from tierwise.config import Config
    from tierwise_moe import ExpertParallel
    from tierwise_moe.experts import UnsupportedExperts, shard_experts_
    from tierwise_moe.mesh import MeshError

    cfg = Config(device="cpu")
    with pytest.raises(MeshError, match="single process.*multiple of 2"):
        ExpertParallel(size=2, config=cfg, process_group=None)
    with pytest.raises(ValueError, match="no MoE experts in LlamaForCausalLM"):
        ExpertParallel(size=1, config=cfg, process_group=None).prepare(tiny_model("llama"))
    with pytest.raises(ValueError, match="capacity_factor=0"):
        ExpertParallel(size=1, config=cfg, process_group=None, capacity_factor=0)
    experts = tiny_model("mixtral").model.layers[0].mlp.experts
    with pytest.raises(
        UnsupportedExperts, match="4 experts do not split over expert-parallel size 3"
    ):
        shard_experts_(experts, rank=0, size=3, group=None)
    experts.is_transposed = True
    with pytest.raises(UnsupportedExperts, match="is_transposed=True"):
        ExpertParallel(size=1, config=cfg, process_group=None).prepare(
            torch.nn.ModuleDict({"experts": experts})
        )
