"""LoHan's Figure 5a point (Llama 13B, batch 32 x 1024, bf16, one RTX 4090, 768 GiB of host
memory, an NVMe drive) as ``tierwise plan --activation-offload auto`` counts its activations:
one JSON line per activation choice ([Note: activation peak under a policy]: the bytes, the
moment they peak, the device the choice needs before any model data), plus LoHan's own scheme
(blocks recomputed from inputs swapped to the host), which tierwise's runtime cannot run, counted
from the step profiled with checkpointing.

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
        if checkpointing:  # LoHan: recompute every block from its inputs, swapped to the host
            peaks = [("LoHan: recompute from inputs on the host (no runtime action)", "host")]
            found = [
                (name, activation_peak(profile, uniform_policy(profile, a))) for name, a in peaks
            ]
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


if __name__ == "__main__":
    main()
