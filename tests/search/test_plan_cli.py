"""``tierwise plan`` end to end on a tiny config.json (analytic profile, no download)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("tierwise_search")

from helpers.models import _config  # noqa: E402
from tierwise import Plan  # noqa: E402
from tierwise.cli import main  # noqa: E402


@pytest.fixture
def run_plan(monkeypatch, capsys):
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "profiler")  # always the analytic profile

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["plan", *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="module")
def config_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(_config("llama").to_json_string())
    return path


def test_plan_command_prints_a_json_plan(run_plan, config_json, tmp_path):
    hardware = tmp_path / "hw.json"
    hardware.write_text(json.dumps({"h2d_bandwidth": 1e9, "d2h_bandwidth": 1e9}))
    code, out, err = run_plan(
        "--model",
        str(config_json),
        "--seq",
        "16",
        "--batch",
        "2",
        "--device",
        "cpu",
        "--device-memory",
        "1GiB",
        "--host-memory",
        "1GiB",
        "--hardware",
        str(hardware),
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    plan = Plan.from_dict(result["plan"])
    assert result["n_params"] == sum(p.numel() for p in plan_profile_params(config_json))
    assert plan.planner == "search"
    assert plan.predicted_step_s["total"] > 0
    fallbacks = [r for r in plan.reasons if "unknown" in r]
    assert fallbacks and not any("h2d_bandwidth" in r for r in fallbacks)


def plan_profile_params(config_json):
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_json.parent)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config).parameters()


def test_plan_command_table_and_too_small_device(run_plan, config_json):
    code, out, err = run_plan(
        "--model", str(config_json), "--seq", "16", "--device", "cpu", "--device-memory", "1GiB"
    )
    assert code == 0, err
    assert "predicted total" in out and "chunk size" in out
    code, out, err = run_plan(
        "--model", str(config_json), "--seq", "16", "--device", "cpu", "--device-memory", "4KiB"
    )
    assert code == 2
    assert "device memory binds" in err and "short" in err


def test_plan_command_prints_each_blocks_activation_choice(run_plan, config_json):
    code, out, err = run_plan(
        "--model",
        str(config_json),
        "--seq",
        "16",
        "--device",
        "cpu",
        "--device-memory",
        "1GiB",
        "--activation-offload",
        "host",
    )
    assert code == 0, err
    import transformers

    layers = transformers.AutoConfig.from_pretrained(config_json.parent).num_hidden_layers
    # every decoder layer has the action the search chose, in a row of its own or in a run of
    # consecutive layers with the same action ("model.layers.0–3  host", issue 38)
    covered = []
    for line in out.splitlines():
        match = re.fullmatch(r"\s*model\.layers\.(\d+)(?:–(\d+))?\s+(\S+)", line)
        if match:
            first, last = int(match[1]), int(match[2] or match[1])
            assert match[3] in ("host", "recompute")
            covered += range(first, last + 1)
    assert covered == list(range(layers))


def test_plan_reports_the_host_buffers_of_loading_and_saving_weights(capsys):
    """Issue 26: the plan's host figures include the load and save buffers."""
    import json

    from tierwise.cli import main

    assert main(["plan", "--model", "llama", "--size", "tiny", "--device", "cpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["io_buffer_bytes"] >= plan["chunk_size"] * 4  # one gathered chunk in fp32


def test_plan_with_int8_optimizer_states_counts_fewer_bytes(run_plan, config_json):
    """``tierwise plan --optimizer-states int8`` (issue 31): the totals count the stored moments
    (master 4 + ~2.03 bytes per trainable parameter instead of 12) and the plan's device
    allowance shrinks when the optimizer states live on the device."""
    results = {}
    for states in ("fp32", "int8"):
        code, out, err = run_plan(
            "--model",
            str(config_json),
            "--seq",
            "16",
            "--device",
            "cpu",
            "--device-memory",
            "1GiB",
            "--optimizer-states",
            states,
            "--json",
        )
        assert code == 0, err
        results[states] = json.loads(out)
    n = results["fp32"]["n_params"]  # every parameter trains
    saved = results["fp32"]["model_bytes"] - results["int8"]["model_bytes"]
    assert saved == n * 8 - int(n * 2 * (1 + 4 / 256))
    fp32, int8 = (Plan.from_dict(results[s]["plan"]) for s in ("fp32", "int8"))
    assert int8.device_allowance < fp32.device_allowance


def test_plan_prices_clipping_rollbacks_and_accumulation(run_plan, config_json, tmp_path):
    """--clip adds the gradient writes a redo needs (NVMe optimizer states), --rollback-rate the
    expected redo, --grad-accum one forward/backward per micro-batch ([Note: speculation
    pricing])."""

    def plan(*extra):
        code, out, err = run_plan(
            *("--model", str(config_json), "--seq", "16", "--device", "cpu"),
            *("--device-memory", "1GiB", "--nvme", str(tmp_path), "--optimizer-placement", "nvme"),
            *(*extra, "--json"),
        )
        assert code == 0, err
        return Plan.from_dict(json.loads(out)["plan"])

    plain, clipped = plan(), plan("--clip")
    grads = clipped.predicted_bytes["nvme_write"] - plain.predicted_bytes["nvme_write"]
    assert grads > 0 and clipped.predicted_bytes["nvme_read"] == plain.predicted_bytes["nvme_read"]
    rolled = plan("--clip", "--rollback-rate", "0.5")
    assert rolled.predicted_step_s["rollback"] > 0
    assert rolled.predicted_step_s["total"] > clipped.predicted_step_s["total"]
    accumulated = plan("--grad-accum", "2")
    assert accumulated.predicted_step_s["compute"] == pytest.approx(
        2 * plain.predicted_step_s["compute"], rel=1e-12
    )
    code, _, err = run_plan("--model", str(config_json), "--validate", "--clip")
    assert code == 2 and "drop --clip" in err


def test_plan_with_rank_order_reduction_counts_its_receive_block(run_plan, config_json):
    """``tierwise plan --reduce-order rank --gpus 4`` plans the one more device block a
    reduction in rank order holds ([Note: reduction in rank order])."""
    plans = {}
    for order in ("fast", "rank"):
        code, out, err = run_plan(
            *("--model", str(config_json), "--seq", "16", "--device", "cpu", "--gpus", "4"),
            *("--device-memory", "1GiB", "--param-placement", "host"),
            *("--reduce-order", order, "--json"),
        )
        assert code == 0, err
        plans[order] = Plan.from_dict(json.loads(out)["plan"])
    fast, rank = plans["fast"], plans["rank"]
    assert rank.chunk_size == fast.chunk_size and rank.cache_blocks == fast.cache_blocks
    # the block is as large as the largest chunk, rounded to whole shards of the 4 ranks: at
    # most chunk_size elements
    extra = rank.device_allowance - fast.device_allowance
    assert 0 < extra <= rank.chunk_size * 2 and extra % (4 * 2) == 0  # bf16


def test_plan_command_refuses_a_budget_without_room_for_the_weight_load(run_plan, config_json):
    """``--load-weights``: the refusal setup(weights=...) gives ([Note: the weight load checked
    at plan time]) at a budget one byte under the plan's host data plus the loader's least
    buffers; that budget plans."""
    from tierwise.units import format_gib

    base = ("--model", str(config_json), "--seq", "16", "--device", "cpu", "--precision", "fp32")
    forced = ("--param-placement", "host", "--optimizer-placement", "host")
    code, out, err = run_plan(*base, *forced, "--host-memory", "1GiB", "--json")
    assert code == 0, err
    plan = Plan.from_dict(json.loads(out)["plan"])
    largest = max(p.numel() for p in plan_profile_params(config_json))
    need = plan.host_need + min(plan.io_buffer_bytes, 2 * largest * (4 + 4 + 4))
    assert plan.host_need < need  # training alone fits one byte under it
    code, out, err = run_plan(*base, *forced, "--host-memory", str(need - 1))
    assert code == 0, err  # without --load-weights the training plan is all that is checked
    code, out, err = run_plan(*base, *forced, "--load-weights", "--host-memory", str(need - 1))
    assert code == 2
    assert "host memory binds while weights load" in err
    assert f"raise host_memory to at least {format_gib(need)}" in err.replace(
        "--host-memory", "host_memory"
    )
    code, out, err = run_plan(*base, *forced, "--load-weights", "--host-memory", str(need))
    assert code == 0, err


def test_plan_command_states_the_weight_load_refusal_in_the_nodes_host_memory(
    run_plan, config_json
):
    """Two ranks on one node share ``--host-memory`` ([Note: a rank's host share]): the weight
    load is checked against each rank's half, and the refusal names the node's budget, twice a
    rank's need; that budget plans."""
    from tierwise.units import format_gib

    base = ("--model", str(config_json), "--seq", "16", "--device", "cpu", "--precision", "fp32")
    forced = ("--param-placement", "host", "--optimizer-placement", "host", "--gpus", "2")
    code, out, err = run_plan(*base, *forced, "--host-memory", "1GiB", "--json")
    assert code == 0, err
    plan = Plan.from_dict(json.loads(out)["plan"])  # a rank's plan
    largest = max(p.numel() for p in plan_profile_params(config_json))
    rank_need = plan.host_need + min(plan.io_buffer_bytes, 2 * largest * (4 + 4 + 4))
    node_need = 2 * rank_need
    code, out, err = run_plan(*base, *forced, "--load-weights", "--host-memory", str(node_need - 1))
    assert code == 2
    err = err.replace("--host-memory", "host_memory")
    assert "host memory binds while weights load" in err and "shared by 2 ranks" in err
    assert f"raise host_memory to at least {format_gib(node_need)}" in err
    code, out, err = run_plan(*base, *forced, "--load-weights", "--host-memory", str(node_need))
    assert code == 0, err


def test_plan_command_refuses_a_budget_without_room_for_the_save(run_plan, config_json):
    """``--save-weights``: the refusal setup gives with Config.saves_weights ([Note: the weight
    load checked at plan time]) at one byte under the plan's host data plus the whole load/save
    buffers, which save_pretrained reserves (tests/hf/test_save_checked_at_plan_time.py measures
    that reservation); that budget plans. With --load-weights too the save's room binds."""
    from tierwise.units import format_gib

    base = ("--model", str(config_json), "--seq", "16", "--device", "cpu", "--precision", "fp32")
    forced = ("--param-placement", "host", "--optimizer-placement", "host")
    code, out, err = run_plan(*base, *forced, "--host-memory", "1GiB", "--json")
    assert code == 0, err
    plan = Plan.from_dict(json.loads(out)["plan"])
    need = plan.host_need + plan.io_buffer_bytes
    code, out, err = run_plan(*base, *forced, "--host-memory", str(need - 1))
    assert code == 0, err  # without --save-weights the training plan is all that is checked
    for flags in (("--save-weights",), ("--save-weights", "--load-weights")):
        code, out, err = run_plan(*base, *forced, *flags, "--host-memory", str(need - 1))
        assert code == 2
        assert "host memory binds while weights save" in err
        assert f"raise host_memory to at least {format_gib(need)}" in err.replace(
            "--host-memory", "host_memory"
        )
        code, out, err = run_plan(*base, *forced, *flags, "--host-memory", str(need))
        assert code == 0, err
