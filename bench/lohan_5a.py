"""LoHan's Figure 5a point (Llama 13B, batch 32 x 1024, bf16, one RTX 4090, 768 GiB of host
memory, an NVMe drive) as ``tierwise plan --activation-offload auto`` counts its activations:
one JSON line per activation choice ([Note: activation peak under a policy]: the bytes, the
moment they peak, the device the choice needs before any model data), among them LoHan's own
scheme, every block recomputed from its inputs swapped to the host (``recompute_host``), then the
same scheme counted from the step profiled with checkpointing (a cross-check), then the plan
``tierwise plan`` makes (the search): its activation policy, allowances and predicted step.

    python bench/lohan_5a.py > bench/results/<dir>/lohan_5a.jsonl
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit  # noqa: E402
from tierwise.planning.activation_peak import activation_peak, uniform_policy  # noqa: E402
from tierwise.target import target_hardware  # noqa: E402
from tierwise_search.activations import activation_choices  # noqa: E402
from tierwise_search.cli import plan_config, plan_profile  # noqa: E402
from tierwise_search.search import search_plan  # noqa: E402

GIB = 2**30


def main() -> None:
    nvme = tempfile.mkdtemp()
    target = target_hardware(spec="rtx4090,pcie4-nvme", device=None, gpus=1, nvme_path=nvme)
    device = target.hardware.device_memory
    for checkpointing in (False, True):
        args = argparse.Namespace(
            model="llama",
            size="13b",
            seq=1024,
            batch=32,
            precision="bf16",
            host_memory="768GiB",
            nvme=nvme,
            checkpointing=checkpointing,
            activation_offload="auto",
            lora=None,
            lora_targets=None,
        )
        config = plan_config(args, target.hardware.device_type)
        profile = plan_profile(args, config)
        if checkpointing:  # the checkpoint keeps each block's inputs: swap those to the host
            name = "recompute from host, counted on the checkpointed profile"
            found = [(name, activation_peak(profile, uniform_policy(profile, "recompute_host")))]
        else:
            found = [
                (c.name, c.peak)
                for c in activation_choices(
                    profile, {}, offload="auto", checkpointing=False, nvme=True
                )
            ]
        for name, peak in found:
            need = config.frag_factor * peak.peak_bytes + profile.buffer_bytes
            emit(
                bench="lohan_5a",
                choice=name,
                activation_gib=round(peak.peak_bytes / GIB, 3),
                moment=peak.moment,
                loss_gib=round(peak.loss_bytes / GIB, 3),
                largest_block_moment_gib=round(max(peak.block_bytes.values()) / GIB, 3),
                held_gib=round(sum(peak.held_bytes.values()) / GIB, 3),
                device_for_activations_gib=round(need / GIB, 3),
                device_gib=round(device / GIB, 3),
                room_left_for_model_data_gib=round(
                    (device - need) * config.alloc_fraction / GIB, 3
                ),
            )
        if not checkpointing:
            plan = search_plan(profile, target.hardware, config)
            policy = list(plan.activation_policy.values())
            emit(
                bench="lohan_5a",
                plan="accepted",
                activation_policy={a: policy.count(a) for a in sorted(set(policy))},
                activation_allowance_gib=round(plan.activation_allowance / GIB, 3),
                device_allowance_gib=round(plan.device_allowance / GIB, 3),
                device_gib=round(device / GIB, 3),
                param_tier=plan.param_tier,
                optim_tier=plan.optim_tier,
                predicted_s={k: round(v, 3) for k, v in plan.predicted_step_s.items()},
                predicted_gib={k: round(v / GIB, 3) for k, v in plan.predicted_bytes.items()},
            )


if __name__ == "__main__":
    main()
