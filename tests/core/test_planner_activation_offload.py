"""Core's planner counts activation offloading in its activation minimum: with every block
swapped to host or NVMe the device keeps the activations outside blocks, the block in backward
and the blocks read back ahead of it, not all of them (a way to fit, counted as one)."""

import pytest
from tierwise import Config, Hardware, ParamInfo, PlanError, Profile
from tierwise.planning.planner import default_plan

N, LAYERS = 1 << 16, 8
BLOCK = 100 * 2**20  # saved activation bytes of one block
HEAD = 50 * 2**20  # saved by the LM head, outside every block
INPUT = 10 * 2**20  # what each block is handed (its checkpoint keeps it when recomputed)
GIB = 2**30


def _profile() -> Profile:
    names = [f"layers.{b}.w" for b in range(LAYERS)] + ["lm_head.w"]
    activations = {f"layers.{b}": BLOCK for b in range(LAYERS)} | {"lm_head": HEAD}
    return Profile(
        params=[ParamInfo(name=n, shape=(N,), numel=N) for n in names],
        forward_order=names,
        backward_order=names[::-1],
        module_params={n[:-2]: [n] for n in names},
        layer_activation_bytes=activations,
        peak_activation_bytes=LAYERS * BLOCK + HEAD,
        module_input_bytes={f"layers.{b}": INPUT for b in range(LAYERS)},
    )


def _plan(offload: str, device_memory: int, tmp_path=None):
    nvme = {"nvme_path": str(tmp_path)} if offload == "nvme" else {}
    return default_plan(
        profile=_profile(),
        hardware=Hardware(device_type="cuda", device_memory=device_memory),
        config=Config(
            device="cuda", precision="bf16", chunk_size=N, activation_offload=offload, **nvme
        ),
    )


def test_swapping_every_block_frees_all_but_one_block_on_the_device(tmp_path):
    # hand-computed: U = 0.95 x (device - 1.25 x activations on the device); model data all on
    # the device: 9 chunks of N elements x at most 16 B (2 B params, 12 B fp32 master, m and v,
    # and until gradients live in the parameter payload a 2 B gradient shard)
    data = (LAYERS + 1) * N * 16
    # outside blocks + the last block's backward + the two blocks the runtime reads back ahead
    # of it ([Note: activation peak under a policy])
    swapped = HEAD + 3 * BLOCK
    device = int(data / 0.95 + 1.25 * swapped) + 2**20  # fits with 1 MiB to spare
    for offload in ("host", "nvme"):
        plan = _plan(offload, device, tmp_path)
        assert (plan.param_tier, plan.optim_tier) == ("device", "device")
        assert plan.device_allowance <= 0.95 * (device - 1.25 * swapped)
    # keeping them all needs 1.25 x 850 MiB: no plan fits
    with pytest.raises(PlanError, match="device memory binds"):
        _plan("none", device)


def test_an_explicit_activation_policy_is_planned_as_given(tmp_path):
    # the budget of the test above: swapping every block fits with model data on the device,
    # keeping them does not; a policy naming the blocks is planned as the runtime resolves it
    data = (LAYERS + 1) * N * 16
    device = int(data / 0.95 + 1.25 * (HEAD + 3 * BLOCK)) + 2**20
    hardware = Hardware(device_type="cuda", device_memory=device)
    base = dict(device="cuda", precision="bf16", chunk_size=N)
    swapped = default_plan(
        profile=_profile(),
        hardware=hardware,
        config=Config(**base, activation_policy={"layers.*": "host"}),
    )
    assert (swapped.param_tier, swapped.optim_tier) == ("device", "device")
    assert swapped.device_allowance <= 0.95 * (device - 1.25 * (HEAD + 3 * BLOCK))
    # "auto" alone would recompute (each block then holds INPUT); blocks the user keeps are
    # planned as kept: 6 kept blocks and 2 recomputed do not fit where 8 recomputed do
    auto = default_plan(
        profile=_profile(), hardware=hardware, config=Config(**base, activation_offload="auto")
    )
    assert (auto.param_tier, set(auto.activation_policy.values())) == ("device", {"recompute"})
    with pytest.raises(PlanError, match="device memory binds"):
        default_plan(
            profile=_profile(),
            hardware=hardware,
            config=Config(
                **base,
                activation_offload="auto",
                activation_policy={f"layers.{b}": "keep" for b in range(6)},
            ),
        )
