"""metrics.jsonl: one JSON object per line, written by rank 0 and flushed line by line.

Train lines: {"kind": "train", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s",
"time_s": {"data", "forward", "backward", "optimizer", "total"}, "bytes_by_tier",
"peak_bytes_by_tier", "moved_bytes" (this step, per direction), "moved_bytes_total", "moves"
(this step), "comm_bytes" (this step)}. Eval lines: {"kind": "eval", "step", "eval_loss"}.
Byte counts come from ``tierwise.engine_of(model).stats()``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def counter_delta(now: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    """Per-key difference of two cumulative counters (keys missing before count from 0)."""
    return {key: value - before.get(key, 0) for key, value in now.items()}


def step_record(
    *,
    step: int,
    loss: float,
    lr: float,
    grad_norm: float | None,
    tokens: int,
    times: Mapping[str, float],
    stats: Mapping[str, Any],
    stats_before: Mapping[str, Any],
) -> dict[str, Any]:
    """The metrics.jsonl line of one optimizer step."""
    total = times["total"]
    return {
        "kind": "train",
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_per_s": tokens / total if total > 0 else None,
        "time_s": dict(times),
        "bytes_by_tier": dict(stats.get("bytes_by_tier", {})),
        "peak_bytes_by_tier": dict(stats.get("peak_bytes_by_tier", {})),
        "moved_bytes": counter_delta(
            stats.get("moved_bytes", {}), stats_before.get("moved_bytes", {})
        ),
        "moved_bytes_total": dict(stats.get("moved_bytes", {})),
        "moves": counter_delta(stats.get("moves", {}), stats_before.get("moves", {})),
        "comm_bytes": counter_delta(
            stats.get("comm_bytes", {}), stats_before.get("comm_bytes", {})
        ),
        "optimizer_mode": stats.get("optimizer_mode"),
        "optimizer_overlap": dict(stats.get("optimizer_overlap") or {}),
    }


class MetricsLog:
    """Appends lines to ``run_dir/metrics.jsonl``.

    On resume from step ``keep_through``, lines of later steps (written after the checkpoint by a
    run that then stopped) are dropped first, so the file reads as one uninterrupted run.
    """

    def __init__(self, run_dir: Path, *, keep_through: int | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        if keep_through is not None and self.path.exists():
            kept = [line for line in read_metrics(self.path) if line["step"] <= keep_through]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(line) + "\n" for line in kept))
            os.replace(tmp, self.path)
        self._file = open(self.path, "a")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics.jsonl (a torn last line from a crash is skipped)."""
    lines = []
    for text in Path(path).read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    return lines


def train_losses(path: str | Path) -> dict[int, float]:
    """Step -> training loss from a metrics.jsonl."""
    return {line["step"]: line["loss"] for line in read_metrics(path) if line["kind"] == "train"}
