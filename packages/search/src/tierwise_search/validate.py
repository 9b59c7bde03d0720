"""``tierwise plan --validate``: run the chosen plan on this machine and set what it predicted
beside what a step measures, phase by phase.

[Note: plan validation] The model is built for real (random weights) and set up with the same
Config the plan was searched with, so the engine asks the search for its plan (its profile is
measured on this machine). After ``warmup`` steps (the first records the access order and
re-packs chunks) each of ``steps`` steps is timed in the training loop itself: the forward call,
``backward()``, and ``optimizer.step()`` with ``zero_grad()``; the medians are reported. Bytes per
link come from the engine's own counters (``engine.stats()["moved_bytes"]`` and the NVMe tier's),
as a delta over the measured steps. Transfers run inside the forward, backward and optimizer
calls (on CPU on the same cores), so their time is not measured apart: a link's "measured"
seconds are its measured bytes at the rate the plan assumed (predicted seconds / predicted
bytes), which checks the traffic the plan expects; the phase times check the time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

LINKS = ("h2d", "d2h", "nvme_read", "nvme_write")
COMPUTE_PHASES = ("forward", "backward", "recompute")
PHASES = ("fwd_bwd_phase", "optimizer_phase", "total")


@dataclass(frozen=True)
class Validation:
    """Predicted and measured figures of one plan on this machine."""

    rows: list[dict]
    """{"phase", "predicted_s", "measured_s", "how"} per phase, and per link with bytes."""
    measured_steps_s: list[float]
    plan_summary: dict
    cpu_steps_s: list[float]
    """Process CPU seconds of each timed step (all threads): on a shared machine the load
    stretches wall time, much less the CPU time a compute-bound step needs."""

    @property
    def step_ratio(self) -> float:
        """Predicted over measured step time."""
        row = next(r for r in self.rows if r["phase"] == "total")
        return row["predicted_s"] / row["measured_s"]

    def to_dict(self) -> dict:
        return {
            "rows": self.rows,
            "measured_steps_s": self.measured_steps_s,
            "predicted_over_measured": self.step_ratio,
            "cpu_steps_s": self.cpu_steps_s,
            "plan": self.plan_summary,
        }

    def table(self) -> str:
        lines = [f"{'phase':<16}{'predicted':>12}{'measured':>12}  how measured"]
        for row in self.rows:
            measured = row["measured_s"]
            lines.append(
                f"{row['phase']:<16}{row['predicted_s'] * 1e3:>9.4g} ms"
                + (f"{measured * 1e3:>9.4g} ms" if measured is not None else f"{'—':>12}")
                + f"  {row['how']}"
            )
        lines.append(f"predicted / measured step: {self.step_ratio:.3f}")
        return "\n".join(lines)


def _link_bytes(stats: dict, nvme_tier) -> dict[str, float]:
    moved = stats["moved_bytes"]
    out = {
        "h2d": sum(v for k, v in moved.items() if k.endswith("host->device")),
        "d2h": sum(v for k, v in moved.items() if k.endswith("device->host")),
    }
    if nvme_tier is not None:
        out["nvme_read"] = nvme_tier.moved_bytes.get("nvme->host", 0)
        out["nvme_write"] = nvme_tier.moved_bytes.get("host->nvme", 0)
    else:
        out["nvme_read"] = sum(v for k, v in moved.items() if ":nvme->" in f":{k}")
        out["nvme_write"] = sum(v for k, v in moved.items() if k.endswith("->nvme"))
    return {k: float(v) for k, v in out.items()}


def validate_plan(model, optimizer, batch: dict, *, steps: int = 3, warmup: int = 2) -> Validation:
    """Run ``steps`` timed steps (after ``warmup``) of a model tierwise.setup returned and
    compare them with its plan (see [Note: plan validation])."""
    import tierwise

    engine = tierwise.engine_of(model)
    plan = engine.plan
    if not plan.predicted_step_s:
        raise ValueError(
            f"the plan was made by the {plan.planner!r} planner, which predicts no step time; "
            "install tierwise-search to validate plans"
        )
    nvme_tier = engine.tiers.get("nvme")
    times: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    cpu_steps: list[float] = []
    before = None
    for index in range(warmup + steps):
        if index == warmup:
            before = _link_bytes(engine.stats(), nvme_tier)
        cpu_started = time.process_time()
        started = time.perf_counter()
        loss = model(**batch).loss
        forwarded = time.perf_counter()
        loss.backward()
        backwarded = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        stepped = time.perf_counter()
        if index >= warmup:
            times["forward"].append(forwarded - started)
            times["backward"].append(backwarded - forwarded)
            times["optimizer"].append(stepped - backwarded)
            cpu_steps.append(time.process_time() - cpu_started)
    stats = engine.stats()
    after = _link_bytes(stats, nvme_tier)
    recomputed = (stats.get("activations") or {}).get("recomputed_blocks", 0)
    measured_bytes = {k: (after[k] - before[k]) / steps for k in LINKS}
    median = {k: statistics.median(v) for k, v in times.items()}
    steps_s = [sum(parts) for parts in zip(*times.values(), strict=True)]
    predicted = plan.predicted_step_s
    rows = [
        {
            "phase": "forward",
            "predicted_s": predicted["forward"],
            "measured_s": median["forward"],
            "how": "model(**batch) wall time (compute and the fetches it waits for)",
        },
        {
            "phase": "backward",
            "predicted_s": predicted["backward"] + predicted["recompute"],
            "measured_s": median["backward"],
            "how": "loss.backward() wall time (with recompute, fetches, offload, in-backward "
            "updates); predicted: backward + recompute",
        },
        {
            "phase": "recompute",
            "predicted_s": predicted["recompute"],
            "measured_s": None,
            "how": f"inside backward: {recomputed} block(s) re-ran their forward",
        },
        {
            "phase": "fwd_bwd_phase",
            "predicted_s": predicted["fwd_bwd_phase"],
            "measured_s": median["forward"] + median["backward"],
            "how": "forward + loss.backward() wall time",
        },
    ]
    for link in LINKS:
        seconds, nbytes = predicted.get(link, 0.0), plan.predicted_bytes.get(link, 0.0)
        rate = seconds / nbytes if nbytes else None
        rows.append(
            {
                "phase": link,
                "predicted_s": seconds,
                "measured_s": measured_bytes[link] * rate if rate else None,
                "predicted_bytes": nbytes,
                "measured_bytes": measured_bytes[link],
                "how": "measured bytes at the plan's rate"
                if rate
                else f"{measured_bytes[link]:.4g} bytes moved, none predicted",
            }
        )
    rows += [
        {
            "phase": "optimizer_phase",
            "predicted_s": predicted["optimizer_phase"],
            "measured_s": median["optimizer"],
            "how": "optimizer.step() + zero_grad() wall time",
        },
        {
            "phase": "total",
            "predicted_s": predicted["total"],
            "measured_s": statistics.median(steps_s),
            "how": f"median of {steps} steps after {warmup} warm-up",
        },
    ]
    summary = {
        "chunk_size": plan.chunk_size,
        "cache_blocks": plan.cache_blocks,
        "param_tier": plan.param_tier,
        "optim_tier": plan.optim_tier,
        "activation_policy": dict(
            sorted(
                (action, list(plan.activation_policy.values()).count(action))
                for action in set(plan.activation_policy.values())
            )
        ),
    }
    return Validation(rows, steps_s, summary, cpu_steps)


__all__ = ["LINKS", "Validation", "validate_plan"]
