"""Bytes and transfers moved between tiers, counted by whichever part moves them
(``Engine.stats`` reports them)."""

from __future__ import annotations

from collections import Counter


class Traffic:
    """Bytes and transfers moved between tiers, by direction (``"host->device"``)."""

    def __init__(self) -> None:
        self.moved_bytes: Counter[str] = Counter()
        self.moves: Counter[str] = Counter()

    def count(self, direction: str, nbytes: int, moves: int = 1) -> None:
        self.moved_bytes[direction] += nbytes
        self.moves[direction] += moves
