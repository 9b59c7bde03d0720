"""The headline figures of a profile or plan, for ``--json`` output and tables (one source for
``tierwise profile`` and ``tierwise plan``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierwise.precision import MOMENT_BYTES, PARAM_BYTES, STATE_BYTES

if TYPE_CHECKING:
    from tierwise.plan import Plan
    from tierwise.profile import Profile


def model_data_bytes(
    numel: int, trainable: int, precision: str, optimizer_states: str = "fp32"
) -> list[tuple[str, int]]:
    """Model-data bytes by kind: compute-precision parameters (gradients reuse their chunks)
    and the optimizer states of the trainable ones (fp32 master copy unless fp32, Adam m and v
    stored as ``optimizer_states``)."""
    low = precision != "fp32"
    rows = [(f"parameters ({precision}, gradients reuse them)", numel * PARAM_BYTES[precision])]
    if low:
        rows.append(("fp32 master parameters", trainable * STATE_BYTES))
    moments = int(trainable * 2 * MOMENT_BYTES[optimizer_states])
    rows.append((f"Adam m and v ({optimizer_states})", moments))
    rows.append(("total", sum(n for _, n in rows)))
    return rows


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
    profile: Profile, plan: Plan, precision: str, optimizer_states: str = "fp32"
) -> dict[str, Any]:
    return totals(
        profile,
        precision,
        optimizer_states,
        tflops=plan.predicted_tflops,
        tokens_per_s=plan.predicted_tokens_per_s,
    )


__all__ = ["model_data_bytes", "plan_totals", "totals"]
