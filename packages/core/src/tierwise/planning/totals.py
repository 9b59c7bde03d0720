"""The headline figures of a profile or plan, for ``--json`` output and tables (one source for
``tierwise profile`` and ``tierwise plan``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierwise.chunks.payload import MOMENT_KINDS, PayloadSpec, model_data_by_tier
from tierwise.planning.planner import chunk_layout
from tierwise.precision import MOMENT_BYTES

if TYPE_CHECKING:
    from tierwise.plan import Plan
    from tierwise.profile import Profile


def model_data_bytes(
    numel: int, trainable: int, precision: str, optimizer_states: str = "fp32"
) -> list[tuple[str, int]]:
    """Model-data bytes by kind, as ``PayloadSpec`` counts a chunk whose gradients are in its
    parameter payload ([Note: gradients in the parameter payload]): compute-precision
    parameters, which take the gradients in bf16/fp16 (14 bytes per trainable parameter with
    fp32 Adam states), the fp32 master of the trainable ones (in fp32 the master is the
    parameter payload, and the gradients have their own fp32 shard) and Adam m and v stored as
    ``optimizer_states`` (per element, before the padding of int8 blocks in each chunk).
    Placements that keep a separate gradient shard (one device computing in the parameter
    payload without ``Plan.grads_in_device_home``, an NVMe home with host states without
    ``Plan.grads_in_nvme_home``) have one
    more, and NVMe states a second copy: ``model_data_by_tier`` counts those per tier."""
    spec = PayloadSpec(precision=precision, optimizer_states=optimizer_states)
    if spec.master_may_be_home:
        rows = [
            (f"parameters ({precision}, the fp32 master)", numel * spec.param_bytes),
            (f"gradients ({precision})", spec.slab_bytes("grad", trainable)),
        ]
    else:
        rows = [
            (f"parameters ({precision}, gradients reuse them)", numel * spec.param_bytes),
            ("fp32 master parameters", spec.slab_bytes("master", trainable)),
        ]
    moments = int(trainable * len(MOMENT_KINDS) * MOMENT_BYTES[optimizer_states])  # unpadded
    rows.append((f"Adam m and v ({optimizer_states})", moments))
    rows.append(("total", sum(n for _, n in rows)))
    return rows


def plan_model_bytes(
    profile: Profile,
    plan: Plan,
    precision: str,
    optimizer_states: str = "fp32",
    *,
    ranks: int = 1,
) -> dict[str, int]:
    """Tier -> bytes of model data one rank holds under ``plan`` (its chunks packed from
    ``profile``, sharded over ``ranks`` when the plan shards), counted by
    ``chunks.payload.model_data_by_tier`` as setup allocates them; a storage tier's
    ``STATE_COPIES`` are not known here and count once."""
    shards = ranks if plan.shard and ranks > 1 else 1
    out: dict[str, int] = {}
    for group, chunks in chunk_layout(profile, plan.chunk_size).items():
        for index, (capacity, trainable, _) in enumerate(chunks):
            by_tier = model_data_by_tier(
                [(-(-capacity // shards), trainable, shards > 1)],
                precision=precision,
                optimizer_states=optimizer_states,
                param_tier=plan.param_tier_of(group, index),
                optim_tier=plan.optim_tier_of(group, index),
                grads_in_device_home=plan.grads_in_device_home,  # [Note: the 14-byte device home]
                grads_in_nvme_home=plan.grads_in_nvme_home,  # [Note: the 14-byte NVMe home]
            )
            for tier, nbytes in by_tier.items():
                out[tier] = out.get(tier, 0) + nbytes
    return out


def totals(
    profile: Profile,
    precision: str,
    optimizer_states: str = "fp32",
    *,
    tflops: float | None = None,
    tokens_per_s: float | None = None,
) -> dict[str, Any]:
    """``n_params``, ``model_bytes`` (parameters, fp32 master and Adam states, see
    :func:`model_data_bytes`), ``peak_activation_bytes``, ``predicted_tflops`` (per rank) and
    ``predicted_tokens_per_s`` (all ranks; None when nothing was predicted)."""
    trainable = sum(p.numel for p in profile.params if p.requires_grad)
    return {
        "n_params": profile.total_numel,
        "model_bytes": model_data_bytes(
            profile.total_numel, trainable, precision, optimizer_states
        )[-1][1],
        "peak_activation_bytes": profile.peak_activation_bytes,
        "predicted_tflops": tflops,
        "predicted_tokens_per_s": tokens_per_s,
    }


def plan_totals(
    profile: Profile,
    plan: Plan,
    precision: str,
    optimizer_states: str = "fp32",
    *,
    ranks: int = 1,
) -> dict[str, Any]:
    """``totals`` with the plan's predictions, and ``model_bytes_by_tier`` (per rank,
    :func:`plan_model_bytes`) with ``model_bytes_per_param`` (each tier's bytes over the
    model's parameters)."""
    by_tier = plan_model_bytes(profile, plan, precision, optimizer_states, ranks=ranks)
    n = max(profile.total_numel, 1)
    return {
        **totals(
            profile,
            precision,
            optimizer_states,
            tflops=plan.predicted_tflops,
            tokens_per_s=plan.predicted_tokens_per_s,
        ),
        "model_bytes_by_tier": by_tier,
        "model_bytes_per_param": {tier: nbytes / n for tier, nbytes in by_tier.items()},
    }


__all__ = ["model_data_bytes", "plan_model_bytes", "plan_totals", "totals"]
