"""The core planner counts the load/save buffers (Plan.io_buffer_bytes) in its host check: setup
reserves them on the host tier beside the model data while weights load, save_pretrained while
saving, so an accepted plan also loads and saves within host_memory."""

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


def test_host_budget_holding_the_model_data_but_not_the_load_buffers_is_refused():
    # bf16 params, which take the gradients (2 B: [Note: gradients in the parameter
    # payload]) + fp32 master and Adam moments (12 B)
    data = LAYERS * N * (2 + 12)
    io = io_buffer_bytes(N, N)  # largest parameter = largest chunk = N elements
    assert _plan(None).io_buffer_bytes == io
    for budget in (data, data + io - 1):  # the model data fits, the buffers do not
        with pytest.raises(PlanError) as info:
            _plan(budget)
        message = str(info.value)
        assert "host memory binds" in message and "load/save buffers" in message
        assert "\n" not in message
        assert info.value.tier == "host"
        assert (info.value.need, info.value.limit) == (data + io, budget)
    plan = _plan(data + io)
    assert (plan.param_tier, plan.optim_tier, plan.io_buffer_bytes) == ("host", "host", io)
