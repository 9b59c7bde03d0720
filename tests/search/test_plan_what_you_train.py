"""Issue 38, "planning what you train": per-family --size choices, `tierwise plan --lora`,
remedies that name the flags and the hardware they assume, per-layer lines collapsed to runs,
the `tierwise train` command printed at the end, no made-up prediction without a batch."""

from __future__ import annotations

import json
import re
import shlex

import pytest

pytest.importorskip("tierwise_search")
pytest.importorskip("peft")

import torch  # noqa: E402
import transformers  # noqa: E402
from helpers.models import _config  # noqa: E402
from tierwise.cli import build_parser, main  # noqa: E402
from tierwise.model_presets import family_size_names  # noqa: E402
from tierwise.plan import Plan, collapse_runs  # noqa: E402
from tierwise.train.errors import TrainError  # noqa: E402
from tierwise.train.options import TrainOptions  # noqa: E402


@pytest.fixture
def run_plan(monkeypatch, capsys):
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "profiler")  # the analytic profile

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


# -- --size per family ---------------------------------------------------------------------
def test_llama_8b_is_a_plan_choice_and_plans(run_plan):
    code, out, err = run_plan("--model", "llama", "--size", "8b", "--hardware", "h100-80gb-sxm")
    assert code == 0, err
    assert "8,030,261,248 parameters" in out  # Llama-3.1-8B (its model card)


@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_wrong_size_lists_that_familys_choices(command, capsys):
    argv = [command, "--model", "llama", "--size", "medium"]
    if command == "plan":
        argv += ["--hardware", "rtx4090"]
        assert main(argv) == 2
        err = capsys.readouterr().err
    else:
        with pytest.raises(TrainError) as info:
            TrainOptions(model="llama", size="medium")
        err = str(info.value)
    assert "unknown --size 'medium' for --model llama" in err
    assert "8b (Llama-3.1-8B)" in err and "70b (Llama-3.1-70B)" in err
    choices = err.split("choose one of", 1)[1]
    assert "medium" not in choices and "xl" not in choices  # gpt2's names are not llama's


def test_train_keeps_its_sizes_and_each_family_its_published_names():
    for family, size in [("gpt2", "350m"), ("llama", "tiny"), ("opt", "small"), ("llama", "8b")]:
        TrainOptions(model=family, size=size)
    assert {"medium", "large", "xl"} <= set(family_size_names("gpt2"))
    assert not {"medium", "large", "xl"} & set(family_size_names("llama"))
    assert {"1.3b", "175b"} <= set(family_size_names("opt"))


# -- tierwise plan --lora --------------------------------------------------------------------
def _lora_numel(config, rank: int, targets: tuple[str, ...]) -> int:
    """By hand: A (rank x in) and B (out x rank) on every targeted Linear of the plain model."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(
        rank * (module.in_features + module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )


def test_plan_lora_counts_a_frozen_base_and_trainable_adapters(run_plan, config_json):
    config = _config("llama")
    with torch.device("meta"):
        base = sum(
            p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters()
        )
    rank, targets = 4, ("q_proj", "v_proj")
    adapters = _lora_numel(config, rank, targets)
    code, out, err = run_plan(
        *("--model", str(config_json), "--seq", "16", "--hardware", "a100-40gb"),
        *("--lora", str(rank), "--lora-targets", ",".join(targets), "--json"),
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["n_params"] == base + adapters
    # bf16: the frozen base 2 B/param, no gradients, no optimizer states; the adapters 2 B
    # params (gradients reuse them) + 4 B fp32 master + 8 B Adam m and v
    assert data["model_bytes"] == base * 2 + adapters * (2 + 4 + 8)
    plan = Plan.from_dict(data["plan"])
    frozen = [g for g in plan.param_tiers if g.endswith("frozen")]
    assert frozen and not any(g in plan.optim_tiers for g in frozen)
    assert any(g.endswith("train") for g in plan.optim_tiers)
    assert "--lora 4 --lora-targets q_proj,v_proj" in data["train_command"]


def test_plan_lora_plans_what_train_lora_builds(config_json):
    """The adapters `tierwise plan --lora` profiles are the ones `tierwise train --lora` trains."""
    from tierwise.train.lora import apply_lora
    from tierwise_search.cli import plan_config, plan_profile

    args = build_parser().parse_args(
        ["plan", "--model", str(config_json), "--seq", "16", "--lora", "8"]
    )
    profile = plan_profile(args, plan_config(args, "cpu"))
    torch.manual_seed(0)
    model = apply_lora(
        transformers.AutoModelForCausalLM.from_config(_config("llama")),
        rank=8,
        alpha=None,
        targets=None,
    )
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    planned = {p.name: p.numel for p in profile.params if p.requires_grad}
    assert planned == trained


def test_lora_flags_are_checked(run_plan, config_json):
    code, _, err = run_plan("--model", str(config_json), "--lora-targets", "q_proj")
    assert code == 2 and "--lora-targets needs --lora R" in err
    code, _, err = run_plan(
        "--model", str(config_json), "--lora", "4", "--lora-targets", "nope", "--hardware", "l4"
    )
    assert code == 2 and "--lora-targets nope" in err and "q_proj,v_proj" in err


# -- remedies, tables, the train command -----------------------------------------------------
def test_remedies_name_the_flags_and_the_assumed_nvme_speed(run_plan, config_json):
    code, _, err = run_plan(
        *("--model", str(config_json), "--seq", "16", "--hardware", "a100-40gb"),
        *("--device-memory", "200KiB", "--host-memory", "300KiB"),
    )
    assert code == 2
    assert "nvme_path" not in err and "host_memory" not in err
    remedy = next(line for line in err.splitlines() if line.strip().startswith("--nvme-path DIR:"))
    # a100-40gb has no NVMe figures: the step rests on the search's fallbacks, said so
    assert "GB/s read" in remedy and "assumed" in remedy
    code, _, err = run_plan(
        *("--model", str(config_json), "--seq", "16", "--hardware", "a100-40gb,pcie4-nvme"),
        *("--device-memory", "200KiB", "--host-memory", "300KiB"),
    )
    remedy = next(line for line in err.splitlines() if line.strip().startswith("--nvme-path DIR:"))
    assert "GB/s read" in remedy and "assumed" not in remedy


def test_plan_takes_train_s_nvme_flag():
    for flag in ("--nvme-path", "--nvme"):
        args = build_parser().parse_args(["plan", "--model", "llama", flag, "/x"])
        assert args.nvme == "/x"


def test_per_layer_lines_collapse_to_runs():
    lines = [f"model.layers.{i}\tkeep" for i in range(32)] + ["lm_head\tkeep"]
    assert collapse_runs(lines) == ["model.layers.0–31\tkeep", "lm_head\tkeep"]
    assert collapse_runs(["a.0 x", "a.1 y", "a.2 y", "a.4 y"]) == ["a.0 x", "a.1–2 y", "a.4 y"]
    assert collapse_runs(["a 1.5 MiB", "a 2.5 MiB"]) == ["a 1.5 MiB", "a 2.5 MiB"]
    plan = Plan(
        chunk_size=1024,
        cache_blocks=1,
        activation_policy={f"model.layers.{i}": "keep" for i in range(32)},
        reasons=[f"activations of model.layers.{i}: keep (1 MiB saved)" for i in range(32)],
    )
    table = plan.table()
    assert re.search(r"\n  model\.layers\.0–31 +keep\n", table) and "model.layers.7" not in table
    assert "why: activations of model.layers.0–31: keep (1 MiB saved)" in table


def test_the_printed_train_command_runs_what_was_planned(run_plan, tmp_path):
    code, out, err = run_plan(
        *("--model", "llama", "--size", "tiny", "--seq", "64", "--batch", "2"),
        *("--nvme-path", str(tmp_path), "--host-memory", "1GiB", "--checkpointing"),
        *("--lora", "4", "--optimizer-states", "int8", "--hardware", "rtx4090"),
    )
    assert code == 0, err
    command = out.strip().splitlines()[-1].strip()
    assert command.startswith("tierwise train ")
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert (args.model, args.size, args.seq, args.batch, args.lora) == ("llama", "tiny", 64, 2, 4)
    assert args.config_nvme_path == str(tmp_path) and args.config_host_memory == "1GiB"
    assert args.config_activation_checkpointing is True
    assert args.config_optimizer_states == "int8"


def test_several_gpus_get_a_torchrun_command(run_plan):
    code, out, err = run_plan(
        "--model", "llama", "--size", "tiny", "--hardware", "h100-80gb-sxm", "--gpus", "4"
    )
    assert code == 0, err
    assert (
        out.strip()
        .splitlines()[-1]
        .strip()
        .startswith("torchrun --nproc-per-node 4 -m tierwise.cli train --model llama --size tiny")
    )


def test_no_step_prediction_without_a_batch_shape():
    """setup() without example_batch: the static profile knows no compute, so the plan predicts
    no step time instead of "predicted forward 0 ms"."""
    import tierwise

    model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = tierwise.setup(model, optimizer, device="cpu")
    plan = tierwise.engine_of(model).plan
    try:
        assert plan.planner == "search"
        assert plan.predicted_step_s == {} and plan.predicted_tokens_per_s is None
        assert "predicted forward" not in plan.table()
        assert "example_batch" in plan.table()
    finally:
        tierwise.engine_of(model).close()


def test_setup_with_an_example_batch_predicts_a_step():
    import tierwise

    model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.zeros((2, 16), dtype=torch.long)
    model, optimizer = tierwise.setup(
        model, optimizer, device="cpu", example_batch={"input_ids": ids, "labels": ids}
    )
    plan = tierwise.engine_of(model).plan
    try:
        assert plan.predicted_step_s["forward"] > 0 and plan.predicted_step_s["total"] > 0
    finally:
        tierwise.engine_of(model).close()
