"""``tierwise profile`` and ``tierwise probe``."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tierwise.planning.totals import model_data_bytes
from tierwise.units import format_bytes

TOP = 5
"""Rows in the "top layers" tables."""


def add_commands(subparsers: Any) -> None:
    from tierwise.model_presets import size_help

    from tierwise_profiler.presets import FAMILIES

    profile = subparsers.add_parser(
        "profile",
        help="profile a model before runtime (on fake tensors: no model memory)",
        description="Profile one training step of a preset or HF-config model on the meta "
        "device: parameters, model-data bytes, peak activation memory, top layers.",
    )
    profile.add_argument(
        "--model",
        required=True,
        help=f"a preset family ({', '.join(FAMILIES)}) or the path of an HF config.json",
    )
    profile.add_argument("--size", default="125m", help=size_help())
    profile.add_argument("--seq", type=int, default=1024, help="sequence length")
    profile.add_argument("--batch", type=int, default=1, help="batch size")
    profile.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    profile.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing of each block"
    )
    profile.add_argument(
        "--hardware",
        default=None,
        metavar="NAME|FILE",
        help="also predict TFLOPS and tokens/s on this machine (a preset such as a100-80gb or a "
        "JSON file of Hardware fields; see tierwise plan --help), through the planner",
    )
    profile.add_argument("--gpus", type=int, default=1, help="data-parallel ranks (default 1)")
    profile.add_argument(
        "--json", action="store_true", help="print totals and the Profile (under 'profile') as JSON"
    )
    profile.set_defaults(func=run_profile)

    probe = subparsers.add_parser(
        "probe",
        help="measure this machine's bandwidths and velocities (cached)",
        description="Host<->device bandwidth by size, AdamW velocity, matmul throughput, free "
        "memory, plus what other plugins probe. Measured once per machine, then cached.",
    )
    probe.add_argument("--device", default=None, help="compute device (default: cuda if any)")
    probe.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    probe.add_argument(
        "--nvme-path",
        default=None,
        metavar="DIR",
        help="also measure the NVMe tier's bandwidth in DIR (tierwise-nvme); cached per path and "
        "used by tierwise plan --nvme DIR",
    )
    probe.add_argument("--refresh", action="store_true", help="measure again, replace the cache")
    probe.add_argument("--json", action="store_true", help="machine-readable output")
    probe.set_defaults(func=run_probe)


# -- profile ----------------------------------------------------------------------------------
def run_profile(args: argparse.Namespace) -> int:
    from tierwise.model_presets import ModelError

    from tierwise_profiler.model_profile import MetaProfileError
    from tierwise_profiler.presets import model_config, profile_config

    if args.seq < 1 or args.batch < 1 or args.gpus < 1:
        print("tierwise profile: --seq, --batch and --gpus must be ≥ 1")
        return 2
    started = time.perf_counter()
    try:
        config = model_config(args.model, size=args.size, seq=args.seq)
    except ModelError as err:
        print(f"tierwise profile: {err}")
        return 2
    try:
        profile = profile_config(
            config,
            batch=args.batch,
            seq=args.seq,
            precision=args.precision,
            checkpointing=args.checkpointing,
        )
    except MetaProfileError as err:
        print(f"tierwise profile: {err}")
        return 1
    build_seconds = time.perf_counter() - started - profile.seconds
    prediction = None
    if args.hardware:
        try:
            prediction = predict(profile, args)
        except ValueError as err:  # HardwareError, ConfigError
            print(f"tierwise profile: {err}")
            return 2
    plan = prediction if prediction is not None and not isinstance(prediction, str) else None
    if args.json:
        from tierwise.planning.totals import totals

        figures = totals(
            profile,
            args.precision,
            tflops=plan.predicted_tflops if plan else None,
            tokens_per_s=plan.predicted_tokens_per_s if plan else None,
        )
        print(json.dumps({**figures, "profile": profile.to_dict()}, indent=1))
        return 0
    name = args.model if args.model.endswith(".json") else f"{args.model}-{args.size}"
    print(profile_table(profile, title=name, precision=args.precision, build_seconds=build_seconds))
    if prediction is not None:
        print(prediction_line(prediction, args))
    return 0


def predict(profile, args):
    """The plan the installed planner makes for ``profile`` on ``--hardware`` (its prediction
    is the profile's), or the reason there is none (a string)."""
    from tierwise.config import Config
    from tierwise.plan import PlanError
    from tierwise.plugins import get_plugin_host
    from tierwise.target import target_hardware

    target = target_hardware(
        spec=args.hardware, device=None, gpus=args.gpus, precision=args.precision
    )
    config = Config(
        device=target.hardware.device_type,
        precision=args.precision,
        activation_checkpointing=args.checkpointing,
    )
    try:
        return get_plugin_host().make_plan(profile=profile, hardware=target.hardware, config=config)
    except PlanError as err:
        return f"does not fit on {args.gpus} x {args.hardware}: {err}"


def prediction_line(prediction, args) -> str:
    if isinstance(prediction, str):
        return f"prediction: {prediction}"
    if prediction.predicted_tflops is None:
        return (
            f"prediction: the {prediction.planner} planner predicts no step time; install "
            "tierwise-search (tierwise plan) for TFLOPS and tokens/s"
        )
    return (
        f"prediction on {args.gpus} x {args.hardware}: {prediction.predicted_tflops:.1f} TFLOPS "
        f"per GPU, {prediction.predicted_tokens_per_s:,.0f} tokens/s, step "
        f"{prediction.predicted_step_s['total']:.3g} s (tierwise plan shows the plan)"
    )


def profile_table(profile, *, title: str, precision: str, build_seconds: float) -> str:
    trainable = sum(p.numel for p in profile.params if p.requires_grad)
    saved = sum(profile.layer_activation_bytes.values())
    flops = sum(profile.layer_flops.values())
    rows: list[tuple[str, str]] = [
        ("model", title),
        ("batch × sequence", f"{profile.batch_size} × {profile.seq_len}"),
        (
            "parameters",
            f"{profile.total_numel:,} ({trainable:,} trainable, {len(profile.params)} tensors)",
        ),
    ]
    rows += [
        (f"  {kind}", format_bytes(n))
        for kind, n in model_data_bytes(profile.total_numel, trainable, precision)
    ]
    rows += [
        ("tied / multiply used", ", ".join(profile.multi_use) or "-"),
        ("buffers", format_bytes(profile.buffer_bytes)),
        ("activations saved for backward", format_bytes(saved)),
        ("peak activation memory", format_bytes(profile.peak_activation_bytes)),
        ("checkpoint blocks", str(len(profile.checkpoint_blocks))),
        ("forward FLOPs", f"{flops:.3e}"),
        ("time", f"profile {profile.seconds:.2f} s, building the meta model {build_seconds:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += _top("top layers by saved activations", profile.layer_activation_bytes, format_bytes)
    lines += _top("top layers by forward FLOPs", profile.layer_flops, lambda v: f"{v:.3e}")
    return "\n".join(lines)


def _top(title: str, values: dict[str, float], fmt) -> list[str]:
    ranked = sorted(values.items(), key=lambda item: item[1], reverse=True)[:TOP]
    if not ranked:
        return []
    width = max(len(name or "(root)") for name, _ in ranked)
    return [title + ":"] + [
        f"  {name or '(root)':<{width}}  {fmt(value)}" for name, value in ranked
    ]


# -- probe ------------------------------------------------------------------------------------
def run_probe(args: argparse.Namespace) -> int:
    from tierwise.config import Config, ConfigError
    from tierwise.hardware import Hardware
    from tierwise.plugins import get_plugin_host
    from tierwise.probe import cached_nvme, device_present, forget_nvme

    from tierwise_profiler.hardware_probe import probe

    try:
        config = Config(
            precision=args.precision,
            nvme_path=args.nvme_path,
            **({"device": args.device} if args.device else {}),
        )
    except ConfigError as err:
        print(f"tierwise probe: {err}")
        return 2
    host = get_plugin_host()
    if not device_present(config.device):
        from tierwise.hardware import preset_names

        print(
            f"tierwise probe: no {config.device} device on this machine to measure; pass --device "
            "cpu to measure this one, or plan for another machine with tierwise plan/profile "
            f"--hardware NAME or FILE.json (presets: {', '.join(preset_names())})"
        )
        return 2
    if args.nvme_path:
        if "nvme" not in host.tier_classes():
            print(
                "tierwise probe: --nvme-path needs the tierwise-nvme plugin: pip install tierwise-nvme"
            )
            return 2
        if args.refresh:
            forget_nvme(args.nvme_path)
    entry = probe(config.device, config.precision, refresh=args.refresh)  # fills the cache
    try:
        hardware = Hardware(**host.probe_hardware(config=config))
    except OSError as err:
        print(f"tierwise probe: cannot measure --nvme-path {args.nvme_path}: {err}")
        return 2
    nvme = cached_nvme(args.nvme_path) if args.nvme_path else None
    if args.json:
        result = {
            "hardware": hardware.to_dict(),
            "curves": entry["curves"],
            "measured_at": entry["measured_at"],
            "key": entry["key"],
        }
        if nvme is not None:
            result["nvme"] = {"path": args.nvme_path, **nvme}
        print(json.dumps(result, indent=1))
        return 0
    print(hardware_table(hardware, entry))
    if nvme is not None:
        print(f"nvme measured {nvme['measured_at']}; cached for {args.nvme_path}")
    return 0


def hardware_table(hardware, entry: dict[str, Any]) -> str:
    def rate(value, unit):
        return "-" if value is None else f"{value:.3g} {unit}"

    def size(value):
        return "-" if value is None else format_bytes(value)

    rows = [
        ("device", hardware.device_type),
        ("free device memory", size(hardware.device_memory)),
        ("available host memory", size(hardware.host_memory)),
        ("host->device", rate(hardware.h2d_bandwidth, "B/s")),
        ("device->host", rate(hardware.d2h_bandwidth, "B/s")),
        ("AdamW on device", rate(hardware.device_adam_velocity, "elements/s")),
        ("AdamW on host", rate(hardware.host_adam_velocity, "elements/s")),
        ("matmul", rate(hardware.device_flops, "FLOP/s")),
        ("nvme read", rate(hardware.nvme_read_bandwidth, "B/s")),
        ("nvme write", rate(hardware.nvme_write_bandwidth, "B/s")),
        ("nvme free", size(hardware.nvme_free)),
        ("world size", str(hardware.world_size)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for name, curve in entry["curves"].items():
        ordered = sorted(curve.items(), key=lambda item: int(item[0]))
        points = ", ".join(f"{format_bytes(int(s))}: {bw:.3g}" for s, bw in ordered)
        lines.append(f"{name} (B/s by size)  {points}")
    lines.append(
        f"measured {entry['measured_at']} in {entry['seconds']:.2f} s; cached for {entry['key']}"
    )
    return "\n".join(lines)
