"""[Note: the 14-byte NVMe home]: bf16/fp16 chunks whose home is on NVMe and whose optimizer
states are in host memory keep their gradients in the NVMe home (``Plan.grads_in_nvme_home``):
14 bytes per element (2 on NVMe, 12 in host memory), counted by hand, trained bitwise like the
16-byte plan (a host gradient shard) on the same model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402
from helpers.train import train  # noqa: E402
from nvme_helpers import nvme_pool_bytes  # noqa: E402
from tierwise.chunks.payload import GRAD_OFFLOAD_BUFFERS, model_data_by_tier  # noqa: E402
from tierwise.config import ConfigError  # noqa: E402
from tierwise.plan import Plan  # noqa: E402
from tierwise.planning.totals import plan_model_bytes  # noqa: E402

N = 1000
CHUNK = 5000
NVME_FACTS = {"nvme_read_bandwidth": 2e9, "nvme_write_bandwidth": 1e9, "nvme_free": 1 << 40}


@pytest.fixture(autouse=True)
def _no_disk_probe(monkeypatch):
    """Fixed NVMe rates instead of a bandwidth measurement per fresh directory (seconds each on
    a busy disk); the arithmetic does not depend on them."""
    import tierwise_nvme.probe

    monkeypatch.setattr(tierwise_nvme.probe, "probe_nvme", lambda directory, **kw: dict(NVME_FACTS))


def test_the_variant_counts_14_bytes_per_element():
    """By hand: the home (2, holding the gradients) on NVMe, master 4 + m 4 + v 4 in host
    memory, no gradient shard; the 16-byte plan has a 2-byte host shard more; fp32 has none to
    save."""
    count = dict(precision="bf16", param_tier="nvme", optim_tier="host")
    assert model_data_by_tier([(N, True, False)], **count) == {"host": 14 * N, "nvme": 2 * N}
    got = model_data_by_tier([(N, True, False)], **count, grads_in_nvme_home=True)
    assert got == {"host": 12 * N, "nvme": 2 * N}
    frozen = model_data_by_tier([(N, False, False)], **count, grads_in_nvme_home=True)
    assert frozen == {"nvme": 2 * N}
    fp32 = dict(count, precision="fp32")
    assert model_data_by_tier([(N, True, False)], **fp32, grads_in_nvme_home=True) == {
        "host": 16 * N,
        "nvme": 4 * N,
    }


def _gpt2():
    model = tiny_model("gpt2")  # tied embeddings (wte = lm_head)
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
    return model


def _ask_for_the_variant(monkeypatch, *, variant: bool) -> None:
    """Core's planner (the search disabled), its plan asking for the variant or not: an
    explicit plan, as a planner plugin may give one."""
    import tierwise.planning.planner as planner

    made = planner.default_plan

    def asking(**kwargs):
        plan = made(**kwargs)
        plan.grads_in_nvme_home = variant
        return plan

    # core's planner and profile, as in the nvme env (the profiler plugin's probe times matmuls)
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "search,profiler")
    monkeypatch.setattr(planner, "default_plan", asking)


def _setup(nvme_dir, *, precision="bf16", model=None, **config):
    model = _gpt2() if model is None else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return tierwise.setup(
        model,
        opt,
        precision=precision,
        device="cpu",
        chunk_size=CHUNK,
        cache_blocks=3,
        param_placement="nvme",
        optimizer_placement="host",
        nvme_path=str(nvme_dir),
        **config,
    )


def _run(monkeypatch, nvme_dir, *, variant, precision="bf16", model=None, config=None, **loop):
    _ask_for_the_variant(monkeypatch, variant=variant)
    model, opt = _setup(nvme_dir, precision=precision, model=model, **(config or {}))
    engine = tierwise.engine_of(model)
    try:
        assert engine.plan.grads_in_nvme_home is variant
        trainable = [c for c in engine.chunks() if c.trainable]
        assert all(c.home.tier.name == "nvme" and c.optim.tier.name == "host" for c in trainable)
        assert all(c.optim.grads_in_home is variant for c in trainable)
        losses = train(model, opt, **loop)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        return losses, state, engine.stats()
    finally:
        engine.close()


def _assert_same(got, want):
    assert got[0] == want[0]
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), key


def test_accumulation_with_clipping_is_bitwise_the_16_byte_plan(monkeypatch, nvme_dir):
    loop = dict(steps=3, accum=2, clip=0.05)
    want = _run(monkeypatch, nvme_dir / "16", variant=False, **loop)
    got = _run(monkeypatch, nvme_dir / "14", variant=True, **loop)
    _assert_same(got, want)
    # the gradients went through the host buffers to the homes' regions and back
    assert got[2]["moved_bytes"]["grad:host->nvme"] > 0
    assert "grad:host->nvme" not in want[2]["moved_bytes"]


def _overflowing_gpt2():
    """fp16: the second step's loss is scaled far up, its gradients overflow, the step is
    skipped (spilled homes get their parameters back from the masters)."""
    model = _gpt2()
    calls = {"n": 0}
    forward = model.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] in (3, 4):  # both micro-batches of the second step
            out.loss = out.loss * 1e10
        return out

    model.forward = scaled
    return model


def test_an_fp16_overflow_skip_is_bitwise_the_16_byte_plan(monkeypatch, nvme_dir):
    loop = dict(steps=3, accum=2, clip=1.0)
    want = _run(
        monkeypatch,
        nvme_dir / "16",
        variant=False,
        precision="fp16",
        model=_overflowing_gpt2(),
        **loop,
    )
    got = _run(
        monkeypatch,
        nvme_dir / "14",
        variant=True,
        precision="fp16",
        model=_overflowing_gpt2(),
        **loop,
    )
    assert got[2]["skipped_steps"] == want[2]["skipped_steps"] == 1
    _assert_same(got, want)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_in_backward_rollback_and_redo_is_bitwise_the_16_byte_plan(
    monkeypatch, nvme_dir, precision
):
    """The 16-byte plan updates its host states on the host worker during backward and rolls
    them back under clipping; the variant updates after backward ([Note: the 14-byte NVMe
    home]): bitwise the same."""
    config = dict(optimizer_overlap="in-backward", accumulation_steps=2)
    loop = dict(steps=3, accum=2, clip=0.05)
    want = _run(
        monkeypatch, nvme_dir / "16", variant=False, precision=precision, config=config, **loop
    )
    assert want[2]["optimizer_overlap"]["rollbacks"] >= 1
    got = _run(
        monkeypatch, nvme_dir / "14", variant=True, precision=precision, config=config, **loop
    )
    assert got[2]["optimizer_overlap"]["rollbacks"] == 0
    _assert_same(got, want)


def test_checkpoint_resume_with_the_variant_is_bitwise(monkeypatch, nvme_dir, tmp_path):
    _ask_for_the_variant(monkeypatch, variant=True)
    model, opt = _setup(nvme_dir / "a")
    engine = tierwise.engine_of(model)
    assert engine.plan.grads_in_nvme_home
    try:
        train(model, opt, 2, accum=2, clip=0.05)
        tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
        straight = train(model, opt, 2, accum=2, clip=0.05, first_seed=4)
        final = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        engine.close()
    resumed, resumed_opt = _setup(nvme_dir / "b")
    engine = tierwise.engine_of(resumed)
    try:
        tierwise.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
        assert train(resumed, resumed_opt, 2, accum=2, clip=0.05, first_seed=4) == straight
        for key, value in final.items():
            assert torch.equal(resumed.state_dict()[key], value), key
    finally:
        engine.close()


def test_a_plan_asking_for_the_variant_in_fp32_is_refused(monkeypatch, nvme_dir):
    _ask_for_the_variant(monkeypatch, variant=True)
    with pytest.raises(ConfigError, match="precision='fp32'"):
        _setup(nvme_dir, precision="fp32")


def _profile():
    from tierwise import ParamInfo, Profile

    names = [f"layers.{b}.w" for b in range(8)]
    return Profile(
        params=[
            ParamInfo(
                name=n,
                shape=(4096,),
                numel=4096,
                requires_grad=i >= 2,
                group="data/g0/train" if i >= 2 else "data/g0/frozen",
            )
            for i, n in enumerate(names)
        ],
        forward_order=names,
        backward_order=names[::-1],
        module_params={n[:-2]: [n] for n in names},
    )


def _core_plan(host_memory, *, precision="bf16"):
    """Core's planner on 8 layers of 4096 elements in chunks of 8192 (the first two frozen, in
    a group of their own), params on NVMe, optimizer states in host memory."""
    from tierwise import Config, Hardware
    from tierwise.planning.planner import default_plan

    return default_plan(
        profile=_profile(),
        hardware=Hardware(device_type="cpu"),
        config=Config(
            device="cpu",
            precision=precision,
            chunk_size=8192,
            param_placement="nvme",
            optimizer_placement="host",
            nvme_path="/nonexistent-planning-only",
            host_memory=host_memory,
        ),
    )


def test_core_planner_chooses_the_variant_only_when_16_bytes_miss_the_host_budget():
    """By hand: 4 chunks of 8192, the first frozen (no host bytes), 3 trainable: the 16-byte plan holds 12 + 2 bytes per trainable element in host memory; the
    variant 12, plus 2 gradient buffers of one chunk in bf16."""
    from tierwise.plan import PlanError

    trainable = 3 * 8192
    sixteen = 14 * trainable
    variant = 12 * trainable + 2 * 8192 * 2
    assert variant < sixteen
    assert not _core_plan(sixteen).grads_in_nvme_home  # 16 bytes fit: nothing changes
    plan = _core_plan(sixteen - 1)
    assert plan.grads_in_nvme_home
    assert any("gradients kept in the NVMe homes" in r for r in plan.reasons)
    assert "gradients in nvme homes" in plan.table()
    assert Plan.from_json(plan.to_json()).grads_in_nvme_home
    # totals count it from the same PayloadSpec: 12 host bytes per trainable element
    by_tier = plan_model_bytes(_profile(), plan, "bf16")
    assert by_tier == {"host": 12 * trainable, "nvme": 2 * 4 * 8192}
    assert _core_plan(variant).grads_in_nvme_home
    with pytest.raises(PlanError, match="gradients in the NVMe homes") as info:
        _core_plan(variant - 1)
    assert info.value.need == variant and info.value.tier == "host"
    # fp32 has no 2-byte payload to reuse: refused at its 12 + 4 host bytes (gradient shard)
    with pytest.raises(PlanError) as info:
        _core_plan(sixteen - 1, precision="fp32")
    assert info.value.need == 16 * trainable


def _setup_searched(nvme_dir, host_memory):
    model = _gpt2()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return tierwise.setup(
        model,
        opt,
        precision="bf16",
        device="cpu",
        chunk_size=5000,
        param_placement="nvme",
        optimizer_placement="host",
        nvme_path=str(nvme_dir),
        host_memory=host_memory,
    )


@pytest.mark.combined
def test_the_search_plans_it_1_byte_short_of_16_bytes_and_it_trains_inside_the_budgets(
    tmp_path,
):
    """The tiny GPT-2 (7 trainable chunks of 5000): the 16-byte plan needs 14 host bytes per
    trainable element (12 of states, 2 of gradient shard) beside the NVMe tier's own host
    buffers; one byte less is planned with the gradients in the NVMe homes, whose host need is
    12 bytes per element and two gradient buffers; it trains 2 clipped steps of 2 micro-batches
    with the host ledger peaking there; one byte below that is refused."""
    pytest.importorskip("tierwise_search")
    from tierwise.plan import PlanError

    with pytest.raises(PlanError) as refused:  # what the smallest plan needs
        _setup_searched(tmp_path / "probe", 1)
    trainable, largest = 7 * 5000, 5000
    variant_data = 12 * trainable + GRAD_OFFLOAD_BUFFERS * largest * 2
    pools = refused.value.need - variant_data  # the NVMe tier's host buffers at this size
    sixteen = 14 * trainable + pools
    model, opt = _setup_searched(tmp_path / "16", sixteen)
    engine = tierwise.engine_of(model)
    try:
        assert not engine.plan.grads_in_nvme_home  # 16 bytes fit: nothing changes
    finally:
        engine.close()
    model, opt = _setup_searched(tmp_path / "14", sixteen - 1)
    engine = tierwise.engine_of(model)
    try:
        assert engine.plan.grads_in_nvme_home
        chunks = [c for c in engine.chunks() if c.trainable]
        assert sum(c.shard_size for c in chunks) == trainable
        assert max(c.shard_size for c in engine.chunks()) == largest
        assert all(c.optim.grads_in_home and c.home.tier.name == "nvme" for c in chunks)
        assert pools == nvme_pool_bytes(engine)  # what the NVMe tier built
        train(model, opt, 2, accum=2, clip=0.05)
        memory = engine.stats()["memory"]
        assert memory["host"]["peak_bytes"] == variant_data + pools <= sixteen - 1
        assert memory["grad_offload_buffers"]["peak_bytes"] <= GRAD_OFFLOAD_BUFFERS * largest * 2
        assert memory["host"]["budget"] == sixteen - 1
    finally:
        engine.close()
    with pytest.raises(PlanError, match="host memory binds") as info:
        _setup_searched(tmp_path / "short", variant_data + pools - 1)
    assert info.value.need == variant_data + pools


def _two_ranks(rank: int, world: int, nvme_dir: str) -> dict:
    """One gloo rank: the sharded nvme/host placement at 16 bytes, then with the variant, each
    trained 2 clipped steps of 2 micro-batches on this rank's own batches."""
    import os

    import tierwise.planning.planner as planner
    import tierwise_nvme.probe

    os.environ["TIERWISE_DISABLE_PLUGINS"] = "search,profiler"
    tierwise_nvme.probe.probe_nvme = lambda directory, **kw: dict(NVME_FACTS)
    made = planner.default_plan
    results = {}
    for variant in (False, True):

        def asking(variant=variant, **kwargs):
            plan = made(**kwargs)
            plan.grads_in_nvme_home = variant
            return plan

        planner.default_plan = asking
        model = _gpt2()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, opt = tierwise.setup(
            model,
            opt,
            precision="bf16",
            device="cpu",
            chunk_size=4096,
            cache_blocks=2,
            param_placement="nvme",
            optimizer_placement="host",
            nvme_path=f"{nvme_dir}/{variant}-{rank}",
        )
        engine = tierwise.engine_of(model)
        losses = train(model, opt, 2, clip=0.05, accum=2, first_seed=100 * rank)
        in_home = {c.optim.grads_in_home for c in engine.chunks() if c.trainable}
        sharded = {c.group.sharded for c in engine.chunks()}
        state = model.state_dict()  # a collective: every rank calls it
        engine.close()
        results[variant] = (losses, state, in_home, sharded)
    return results


@pytest.mark.multiprocess
def test_two_ranks_sharded_are_bitwise_the_16_byte_plan(nvme_dir):
    per_rank = run_ranks(_two_ranks, 2, str(nvme_dir), timeout=400)
    for rank in range(2):
        want, got = per_rank[rank][False], per_rank[rank][True]
        assert want[2] == {False} and got[2] == {True}
        assert want[3] == got[3] == {True}
        assert got[0] == want[0], f"rank {rank}: losses differ"
        for key, value in want[1].items():
            assert torch.equal(got[1][key], value), (rank, key)
