"""``tierwise plan``: search and print the plan for a model, budgets and machine."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from tierwise.config import REDUCE_ORDERS, Config, ConfigError, config_flags, name_flags
from tierwise.hardware import HardwareError
from tierwise.plan import Plan, PlanError, fill_io_buffer_bytes
from tierwise.units import parse_bytes


def add_plan_command(subparsers) -> None:
    from tierwise.hardware import preset_names
    from tierwise.model_presets import FAMILIES, size_help

    parser = subparsers.add_parser(
        "plan",
        help="search the best plan for a model",
        description="Profile a Hugging Face causal LM on the meta device and print the plan the "
        "search predicts fastest, with the step-time breakdown and rejected alternatives. "
        "Plan for another machine with --hardware; without it the probe runs for a device this "
        "machine has.",
    )
    parser.add_argument(
        "--model", required=True, help=f"{' | '.join(FAMILIES)} | path/to/config.json"
    )
    parser.add_argument("--size", default="125m", help=size_help())
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--batch", type=int, default=1, help="batch size per rank (default 1)")
    parser.add_argument(
        "--hardware",
        default=None,
        metavar="NAME|FILE",
        help=f"the machine to plan for: presets {', '.join(preset_names())}, or a JSON file of "
        "tierwise.hardware.Hardware fields; comma-separate to combine (a100-80gb,pcie4-nvme). "
        "Default: probe this machine's --device",
    )
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="ranks on one node, sharing its host memory, CPU and NVMe (default min(--gpus, 8))",
    )
    parser.add_argument(
        "--device-memory",
        default=None,
        help="device capacity, e.g. 40GiB (default: the "
        "preset's, or the probed device's free memory)",
    )
    parser.add_argument(
        "--host-memory",
        default=None,
        help="host budget of one node, shared by its ranks, e.g. 64GiB (default: this "
        "machine's when probing, unlimited with --hardware)",
    )
    parser.add_argument(
        "--nvme-path",
        "--nvme",
        dest="nvme",
        default=None,
        metavar="DIR",
        help="directory for the NVMe tier (the same flag as tierwise train's)",
    )
    parser.add_argument(
        "--device", default=None, help="device to probe without --hardware (default cuda)"
    )
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument(
        "--optimizer-states",
        default="fp32",
        choices=("fp32", "bf16", "int8"),
        help="how the Adam moments are stored (Config.optimizer_states; default fp32)",
    )
    parser.add_argument(
        "--reduce-order",
        default="fast",
        choices=REDUCE_ORDERS,
        help="how gradients are summed across ranks (Config.reduce_order; default fast): "
        "rank counts one more device block with --gpus > 1",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=None,
        metavar="R",
        help="plan a LoRA fine-tune: PEFT adapters of rank R on the frozen model, as tierwise "
        "train --lora builds it (the base gets no gradients and no optimizer states)",
    )
    parser.add_argument(
        "--lora-targets",
        default=None,
        metavar="NAMES",
        help="comma-separated module names LoRA adapts (e.g. q_proj,v_proj); default: PEFT's "
        "choice for the model type",
    )
    parser.add_argument(
        "--load-weights",
        action="store_true",
        help="the run loads pretrained weights (tierwise train --from-pretrained, "
        "setup(weights=...)): refuse a host budget without room for the load buffers' minimum "
        "beside the plan's host data, as setup does",
    )
    parser.add_argument(
        "--save-weights",
        action="store_true",
        help="the run calls save_pretrained (Config.saves_weights, TierwiseTrainer's default): "
        "refuse a host budget without room for the whole load/save buffers beside the plan's "
        "host data, as setup does",
    )
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument(
        "--clip",
        action="store_true",
        help="the run clips gradients: price the gradient writes in-backward NVMe updates keep "
        "for a redo (README, 'Optimizer overlap')",
    )
    parser.add_argument(
        "--rollback-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="expected share of steps whose in-backward updates roll back (default 0)",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        metavar="K",
        help="backward passes per step (Config.accumulation_steps; default 1)",
    )
    parser.add_argument(
        "--activation-offload", default="none", choices=("none", "host", "nvme", "auto")
    )
    for kind in ("param", "optimizer"):
        parser.add_argument(
            f"--{kind}-placement",
            default="auto",
            choices=("auto", "device", "host", "nvme"),
            help=f"force where {kind} chunks live (default auto)",
        )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="run the plan on this machine (random weights and tokens) and print predicted "
        "against measured time per phase (see 'How to read and validate a plan' in the README)",
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps for --validate (default 3)"
    )
    parser.add_argument("--json", action="store_true", help="print totals and the plan as JSON")
    parser.set_defaults(func=run_plan)


PLAN_FLAGS = {
    **config_flags(
        (
            "device_memory",
            "host_memory",
            "nvme_path",
            "activation_offload",
            "param_placement",
            "optimizer_placement",
            "optimizer_states",
            "reduce_order",
        )
    ),
    "activation_checkpointing": "--checkpointing",
    "accumulation_steps": "--grad-accum",
}
"""Config fields ``tierwise plan`` takes as flags: its messages name the flag
([tierwise.cli.name_flags])."""


def plan_profile(args, config: Config):
    """The Profile to plan with. A deep model of identical layers is profiled as two short copies
    and replicated, as ``tierwise profile`` does ([Note: layer replication] in tierwise.planning.replicate);
    anything else whole."""
    from tierwise.planning.replicate import profile_by_replication, replicable

    from tierwise_search.hf_profile import hf_config

    cfg = hf_config(args.model, args.size, seq_len=args.seq)
    if replicable(cfg):
        replicated = profile_by_replication(cfg, lambda short: _profile_of(args, config, short))
        if replicated is not None:
            return replicated
    return _profile_of(args, config, cfg)[0]


def _profile_of(args, config: Config, cfg):
    """The Profile of the meta model ``cfg`` describes and the name of its list of layers: a
    profiler plugin's first; without one (or if it fails) the analytic profile."""
    import torch
    from tierwise.planning.replicate import layer_list
    from tierwise.plugins import get_plugin_host

    from tierwise_search.hf_profile import meta_model, profile_hf_config

    model = meta_model(cfg)
    if getattr(args, "lora", None) is not None:  # as tierwise train --lora builds it
        from tierwise.model_presets import ModelError, add_lora

        try:
            model = add_lora(model, rank=args.lora, targets=args.lora_targets)
        except ModelError as err:
            raise ValueError(str(err)) from None
    ids = torch.zeros((args.batch, args.seq), dtype=torch.long, device="meta")
    try:
        profile = get_plugin_host().profile_model(
            model=model, example_batch={"input_ids": ids, "labels": ids}, config=config
        )
    except Exception as err:  # noqa: BLE001 - a profiler failure must not stop planning
        print(
            f"tierwise plan: profiler plugin failed ({err}); using the analytic profile",
            file=sys.stderr,
        )
        profile = None
    if profile is None:
        profile = profile_hf_config(
            cfg,
            batch=args.batch,
            seq_len=args.seq,
            precision=args.precision,
            checkpointing=config.activation_checkpointing,
            model=model,
        )
    return profile, layer_list(model, cfg.num_hidden_layers)


def plan_config(args, device_type: str, **overrides) -> Config:
    return Config(
        device=device_type,
        precision=args.precision,
        host_memory=args.host_memory,
        nvme_path=args.nvme,
        activation_checkpointing=args.checkpointing,
        activation_offload=args.activation_offload,
        param_placement=getattr(args, "param_placement", "auto"),
        optimizer_placement=getattr(args, "optimizer_placement", "auto"),
        optimizer_states=getattr(args, "optimizer_states", "fp32"),
        reduce_order=getattr(args, "reduce_order", "fast"),
        accumulation_steps=getattr(args, "grad_accum", None),
        saves_weights=getattr(args, "save_weights", False),
        **overrides,
    )


def run_validation(args: argparse.Namespace) -> int:
    """``tierwise plan --validate``: see [Note: plan validation] in tierwise_search.validate."""
    import tierwise
    import torch
    import transformers

    from tierwise_search.hf_profile import hf_config
    from tierwise_search.validate import validate_plan

    if args.hardware is not None or args.gpus != 1:
        raise ValueError(
            "--validate runs the plan on this machine: drop --hardware and --gpus (validate a "
            "plan for other hardware on that hardware)"
        )
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be ≥ 1")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    capacity = (
        parse_bytes(args.device_memory, what="--device-memory") if args.device_memory else None
    )
    config = plan_config(args, device, device_memory=capacity)
    cfg = hf_config(args.model, args.size, seq_len=args.seq)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(cfg.vocab_size, (args.batch, args.seq), device=device)
    batch = {"input_ids": ids, "labels": ids}
    model, optimizer = tierwise.setup(model, optimizer, config, example_batch=batch)
    engine = tierwise.engine_of(model)
    try:
        result = validate_plan(model, optimizer, batch, steps=args.steps)
    finally:
        engine.close()
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(engine.plan.table())
        print(result.table())
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tierwise.planning.host_minimum import plan_for_weight_load
    from tierwise.planning.totals import plan_totals
    from tierwise.precision import PARAM_BYTES
    from tierwise.target import target_hardware

    from tierwise_search.remedies import remedies
    from tierwise_search.search import search_plan

    try:
        if args.seq < 1 or args.batch < 1:
            raise ValueError(f"--seq {args.seq} --batch {args.batch}: both must be ≥ 1")
        if args.lora is not None and args.lora < 1:
            raise ValueError(f"--lora {args.lora}: the adapter rank must be at least 1")
        if args.lora is None and args.lora_targets is not None:
            raise ValueError("--lora-targets needs --lora R (the adapter rank)")
        if args.lora is not None and args.validate:
            raise ValueError("--validate runs full training: drop --lora to validate")
        if args.validate:
            if args.clip or args.rollback_rate or args.grad_accum not in (None, 1):
                raise ValueError(
                    "--validate measures steps of one backward without clipping: drop --clip, "
                    "--rollback-rate and --grad-accum to validate"
                )
            return run_validation(args)
        capacity = (
            parse_bytes(args.device_memory, what="--device-memory") if args.device_memory else None
        )
        target = target_hardware(
            spec=args.hardware,
            device=args.device,
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            device_memory=capacity,
            nvme_path=args.nvme,
            precision=args.precision,
        )
        config = plan_config(args, target.hardware.device_type)
        profile = plan_profile(args, config)

        def plan_at(budget: int | None) -> Plan:
            plan = search_plan(
                profile,
                target.hardware,
                replace(config, host_memory=budget),
                clipping=args.clip,
                rollback_rate=args.rollback_rate,
            )
            fill_io_buffer_bytes(plan, profile)
            return plan

        try:
            if args.load_weights or args.save_weights:  # as setup: [Note: the weight load
                plan = plan_for_weight_load(  # checked at plan time]
                    plan_at,
                    config.host_memory,
                    largest_numel=max((p.numel for p in profile.params), default=0),
                    itemsize=PARAM_BYTES[args.precision],
                    ranks_per_node=target.hardware.ranks_per_node,
                    loads=args.load_weights,
                    saves=args.save_weights,
                )
            else:
                plan = plan_at(config.host_memory)
        except PlanError as err:
            print(f"tierwise plan: {name_flags(str(err), PLAN_FLAGS)}", file=sys.stderr)
            for line in remedies(args, target.hardware, err):
                print(f"  {name_flags(line, PLAN_FLAGS)}", file=sys.stderr)
            return 2
    except (ConfigError, HardwareError, PlanError, ValueError) as err:
        print(f"tierwise plan: {name_flags(str(err), PLAN_FLAGS)}", file=sys.stderr)
        return 2
    plan.reasons += target.notes
    fill_io_buffer_bytes(plan, profile)  # the host buffers loading and saving weights take
    if args.json:
        print(
            json.dumps(
                {
                    **plan_totals(
                        profile,
                        plan,
                        args.precision,
                        args.optimizer_states,
                        ranks=target.hardware.world_size,
                    ),
                    "plan": plan.to_dict(),
                    "train_command": train_command(args),
                },
                indent=1,
            )
        )
    else:
        print(
            f"model {args.model} {args.size if args.model in _families() else ''} · "
            f"{profile.total_numel:,} parameters · batch {args.batch} x seq {args.seq} · "
            f"{args.gpus} rank(s) on {target.hardware.nodes} node(s) · profile {profile.source}"
        )
        print(plan.table())
        where = " (on the machine planned for)" if args.hardware else ""
        print(f"\ntrain with this plan{where}:\n  {train_command(args)}")
    return 0


def train_command(args: argparse.Namespace) -> str:
    """The ``tierwise train`` command that runs what ``args`` planned: the same model, batch,
    budgets and settings, as train's flags (torchrun for several ranks on a node)."""
    from tierwise.model_presets import FAMILIES

    if args.model in FAMILIES:
        parts = ["--model", args.model, "--size", args.size]
    else:
        parts = ["--model-config", args.model]
    parts += ["--seq", str(args.seq), "--batch", str(args.batch)]
    optional = [
        ("--lora", args.lora, None),
        ("--lora-targets", args.lora_targets, None),
        ("--grad-accum", args.grad_accum, None),
        ("--precision", args.precision, "bf16"),
        ("--optimizer-states", args.optimizer_states, "fp32"),
        ("--device", args.device, None),
        ("--device-memory", args.device_memory, None),
        ("--host-memory", args.host_memory, None),
        ("--nvme-path", args.nvme, None),
        ("--activation-offload", args.activation_offload, "none"),
        ("--param-placement", args.param_placement, "auto"),
        ("--optimizer-placement", args.optimizer_placement, "auto"),
        ("--reduce-order", args.reduce_order, "fast"),
    ]
    parts += [
        str(x) for flag, value, default in optional if value != default for x in (flag, value)
    ]
    if args.checkpointing:
        parts.append("--activation-checkpointing")
    ranks = min(args.gpus, args.gpus_per_node or 8)
    if args.gpus > 1:
        launch = f"torchrun --nproc-per-node {ranks}"
        if args.gpus > ranks:
            launch += f" --nnodes {-(-args.gpus // ranks)} --node-rank N --master-addr HOST"
        head = f"{launch} -m tierwise.cli train"
    else:
        head = "tierwise train"
    return " ".join([head, *(shlex.quote(p) for p in parts)])


def _families():
    from tierwise.model_presets import FAMILIES

    return FAMILIES


__all__ = ["add_plan_command", "plan_config", "plan_profile", "run_plan", "train_command"]
