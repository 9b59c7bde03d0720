"""``tierwise plan``: search and print the plan for a model, budgets and machine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tierwise.config import Config, ConfigError
from tierwise.hardware import Hardware
from tierwise.plan import PlanError
from tierwise.units import parse_bytes


def add_plan_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="search the best plan for a model",
        description="Profile a Hugging Face causal LM on the meta device and print the plan the "
        "search predicts fastest, with the step-time breakdown and rejected alternatives.",
    )
    parser.add_argument(
        "--model", required=True, help="gpt2 | opt | llama | mixtral | path/to/config.json"
    )
    parser.add_argument("--size", default=None, help="preset size, e.g. 10b for gpt2, 175b for opt")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--batch", type=int, default=1, help="batch size per rank (default 1)")
    parser.add_argument("--device-memory", required=True, help="device capacity, e.g. 40GiB")
    parser.add_argument(
        "--host-memory", default=None, help="host budget, e.g. 64GiB (default: this machine's)"
    )
    parser.add_argument("--nvme", default=None, metavar="PATH", help="directory for the NVMe tier")
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--device", default="cuda", help="compute device type (default cuda)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument(
        "--activation-offload", default="none", choices=("none", "host", "nvme", "auto")
    )
    parser.add_argument(
        "--hardware",
        default=None,
        metavar="JSON",
        help="Hardware fields as a JSON file (bandwidths, velocities); default: probe this machine",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run_plan)


def _profile(args, config: Config):
    """Ask a profiler plugin first; without one (or if it fails) use the analytic profile."""
    import torch
    from tierwise.plugins import get_plugin_host

    from tierwise_search.hf_profile import hf_config, meta_model, profile_hf_config

    cfg = hf_config(args.model, args.size, seq_len=args.seq)
    model = meta_model(cfg)
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
            checkpointing=args.checkpointing,
            model=model,
        )
    return profile


def _hardware(args, config: Config, device_capacity: int) -> Hardware:
    """Probed (or --hardware) facts, with the device's capacity from --device-memory: the search
    subtracts buffers and activations from it (U = F_alloc·(capacity − buffers − F_frag·act))."""
    from tierwise.plugins import get_plugin_host

    if args.hardware:
        facts = json.loads(Path(args.hardware).read_text())
    else:
        facts = get_plugin_host().probe_hardware(config=config)
    facts["device_type"] = config.device.split(":")[0]
    facts["world_size"] = args.gpus
    facts["device_memory"] = device_capacity
    return Hardware.from_dict(facts)


def run_plan(args: argparse.Namespace) -> int:
    from tierwise_search.search import search_plan

    try:
        config = Config(
            device=args.device,
            precision=args.precision,
            host_memory=args.host_memory,
            nvme_path=args.nvme,
            activation_checkpointing=args.checkpointing,
            activation_offload=args.activation_offload,
        )
        profile = _profile(args, config)
        capacity = parse_bytes(args.device_memory, what="--device-memory")
        plan = search_plan(profile, _hardware(args, config, capacity), config)
    except (ConfigError, PlanError, ValueError) as err:
        print(f"tierwise plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(plan.to_json())
    else:
        print(
            f"model {args.model} {args.size or ''} · {profile.total_numel:,} parameters · "
            f"batch {args.batch} x seq {args.seq} · {args.gpus} rank(s) · profile {profile.source}"
        )
        print(plan.table())
    return 0


__all__ = ["add_plan_command", "run_plan"]
