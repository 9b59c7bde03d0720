"""The core planner's host check is what training holds: the model data. The load/save buffers
(Plan.io_buffer_bytes) are taken only while weights load or save ([Note: load/save buffers are
not held through training]); the plan reports them and says when they do not fit beside the
model data."""

import pytest
from tierwise import Config, Hardware, ParamInfo, PlanError, Profile
from tierwise.plan import io_buffer_bytes
from tierwise.planning.planner import default_plan

N, LAYERS = 1 << 16, 8


def _profile() -> Profile:
    names = [f"layers.{b}.w" for b in range(LAYERS)]
    return Profile(
        params=[ParamInfo(name=n, shape=(N,), numel=N) for n in names],
        forward_order=names,
        backward_order=names[::-1],
        module_params={n[:-2]: [n] for n in names},
    )


def _plan(host_memory):
    return default_plan(
        profile=_profile(),
        hardware=Hardware(device_type="cpu"),
        config=Config(
            device="cpu",
            precision="bf16",
            chunk_size=N,
            param_placement="host",
            optimizer_placement="host",
            host_memory=host_memory,
        ),
    )


def test_training_need_is_the_model_data_and_the_load_buffers_are_reported_beside_it():
    # bf16 params, which take the gradients (2 B: [Note: gradients in the parameter
    # payload]) + fp32 master and Adam moments (12 B)
    data = LAYERS * N * (2 + 12)
    io = io_buffer_bytes(N, N)  # largest parameter = largest chunk = N elements
    assert _plan(None).io_buffer_bytes == io
    with pytest.raises(PlanError) as info:  # the model data does not fit: refused
        _plan(data - 1)
    message = str(info.value)
    assert "host memory binds" in message and "\n" not in message
    assert info.value.tier == "host"
    assert (info.value.need, info.value.limit) == (data, data - 1)
    for budget in (data, data + io - 1):  # training fits; loading or saving would not
        plan = _plan(budget)
        assert (plan.param_tier, plan.optim_tier, plan.io_buffer_bytes) == ("host", "host", io)
        assert any(r.startswith("load/save buffers:") for r in plan.reasons)
    plan = _plan(data + io)  # room for both: nothing to say
    assert not any(r.startswith("load/save buffers:") for r in plan.reasons)


def test_the_gradient_offload_buffers_are_counted_in_the_host_need(tmp_path):
    # fp32 with params on host and optimizer states on NVMe: the host holds each chunk's fp32
    # parameters (4 B) and, in front of the gradient shards on NVMe, GRAD_OFFLOAD_BUFFERS (2)
    # buffers of the largest shard (N elements x 4 B): [Note: active gradient offloading]
    data = LAYERS * N * 4
    buffers = 2 * N * 4

    def plan(host_memory):
        return default_plan(
            profile=_profile(),
            hardware=Hardware(device_type="cpu"),
            config=Config(
                device="cpu",
                precision="fp32",
                chunk_size=N,
                param_placement="host",
                optimizer_placement="nvme",
                nvme_path=str(tmp_path),
                host_memory=host_memory,
            ),
        )

    with pytest.raises(PlanError) as info:
        plan(data + buffers - 1)
    assert (info.value.need, info.value.limit) == (data + buffers, data + buffers - 1)
    assert plan(data + buffers).optim_tier == "nvme"
