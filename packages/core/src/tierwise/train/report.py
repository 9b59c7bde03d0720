"""What `tierwise train` prints: notes, the plan, progress, the sample and the summary.

Only rank 0 prints. Three modes: a tqdm bar on a terminal; one plain line every few steps when
stdout is not a terminal (logs, CI); ``--json``: one JSON object per line and nothing else.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from tierwise.units import format_bytes

TIER_ORDER = ("device", "host", "nvme")


def short_bytes(n: float) -> str:
    """1536 -> '1.5K' (for the progress bar)."""
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def tier_summary(bytes_by_tier: Mapping[str, int]) -> str:
    """'device 3.1M host 9.2M' in tier order."""
    names = sorted(bytes_by_tier, key=lambda t: (TIER_ORDER + (t,)).index(t))
    return " ".join(f"{name} {short_bytes(bytes_by_tier[name])}" for name in names)


CELL_WIDTH = 64
"""Cells longer than this wrap onto continuation lines (the summary's notes ran to ~190)."""


def table(rows: Sequence[tuple[str, ...]], *, cell_width: int = CELL_WIDTH) -> str:
    """Left-aligned columns, the first row a header underlined with dashes; a long cell wraps
    within its column."""
    wrapped = [[_wrap(cell, cell_width) for cell in row] for row in rows]
    widths = [max(len(line) for row in wrapped for line in row[i]) for i in range(len(rows[0]))]
    lines = []
    for row in wrapped:
        for k in range(max(len(cell) for cell in row)):
            parts = [cell[k] if k < len(cell) else "" for cell in row]
            lines.append("  ".join(p.ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _wrap(cell: str, width: int) -> list[str]:
    """A cell's lines: broken at spaces only (paths and hyphenated words stay whole)."""
    return textwrap.wrap(cell, width, break_on_hyphens=False, break_long_words=False) or [""]


MIN_BAR_COLUMNS = 20
"""Narrower terminals get plain progress lines: a bar there would show nothing readable."""


def usable_terminal(stream) -> bool:
    """Whether ``stream`` is a terminal a progress bar can draw on: a tty that reports a width
    (some CI and IDE consoles are pseudo-terminals of 0 x 0, where tqdm prints nothing)."""
    try:
        if not stream.isatty():
            return False
        return os.get_terminal_size(stream.fileno()).columns >= MIN_BAR_COLUMNS
    except (AttributeError, OSError, ValueError):  # no fileno, closed, not a terminal after all
        return False


class Console:
    """Rank 0's voice. Every method is a no-op on other ranks."""

    def __init__(self, *, enabled: bool, json_mode: bool, stream=None):
        self.enabled = enabled
        self.json_mode = json_mode
        self.stream = stream or sys.stdout
        self.interactive = usable_terminal(self.stream)
        self._bar = None
        self._log_every = 1

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def event(self, name: str, /, **data: Any) -> None:
        """A machine-readable line {"event": name, ...} (--json mode only)."""
        if self.enabled and self.json_mode:
            print(json.dumps({"event": name, **data}), file=self.stream, flush=True)

    def note(self, text: str, /, **data: Any) -> None:
        """A line for people; in --json mode a {"event": "note"} line."""
        if not self.enabled:
            return
        if self.json_mode:
            self.event("note", text=text, **data)
        else:
            self._print(text)

    def block(self, title: str, body: str, /, **data: Any) -> None:
        """A titled multi-line block (plan, summary, sample)."""
        if not self.enabled:
            return
        if self.json_mode:
            self.event(title, **data)
        else:
            self._print(f"\n== {title} ==\n{body}\n")

    # -- progress ---------------------------------------------------------------------------
    def start_progress(self, *, start: int, total: int) -> None:
        if not self.enabled or self.json_mode:
            return
        self._log_every = max(1, (total - start) // 20)
        if self.interactive:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=start, unit="step", file=self.stream, dynamic_ncols=True
            )

    def progress(self, record: Mapping[str, Any], *, last: bool) -> None:
        """One optimizer step done."""
        if not self.enabled:
            return
        if self.json_mode:
            self.event("step", **record)
            return
        memory = tier_summary(record["bytes_by_tier"])
        tokens_per_s = record["tokens_per_s"] or 0.0
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"loss {record['loss']:.3f} | {tokens_per_s:,.0f} tok/s | {memory}", refresh=False
            )
            self._bar.update(1)
        elif record["step"] % self._log_every == 0 or last:
            self._print(
                f"step {record['step']:>6}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                f"{tokens_per_s:,.0f} tok/s  {record['time_s']['total'] * 1e3:.0f} ms  {memory}"
            )

    def stop_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def overlap_row(lines: Sequence[Mapping[str, Any]], overlap: Mapping[str, Any]) -> tuple:
    """Where the optimizer updates ran: steps per mode, speculation hits and rollbacks, and
    why the last step ran where it did ([Note: speculative updates])."""
    modes = Counter(line.get("optimizer_mode") or "after-backward" for line in lines)
    value = ", ".join(f"{mode} {n}" for mode, n in modes.most_common())
    note = (
        f"{overlap.get('speculation_hits', 0)} speculations kept, "
        f"{overlap.get('rollbacks', 0)} rolled back; last: {overlap.get('reason', '-')}"
    )
    return ("optimizer updates", value or "-", note)


def summary_rows(
    *,
    peak_bytes_by_tier: Mapping[str, int],
    budgets: Mapping[str, int | None],
    moved_bytes: Mapping[str, int],
) -> list[tuple[str, str, str]]:
    """Peak model data per tier against its budget, then bytes moved per direction."""
    rows = [("tier", "peak model data", "budget")]
    for tier in sorted(
        set(peak_bytes_by_tier) | set(budgets), key=lambda t: (TIER_ORDER + (t,)).index(t)
    ):
        budget = budgets.get(tier)
        peak = peak_bytes_by_tier.get(tier, 0)
        share = f" ({100 * peak / budget:.0f}%)" if budget else ""
        rows.append(
            (tier, format_bytes(peak) + share, format_bytes(budget) if budget else "machine")
        )
    for direction, moved in sorted(moved_bytes.items()):
        rows.append((f"moved {direction}", format_bytes(moved), ""))
    return rows
