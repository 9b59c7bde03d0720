"""The chunk access trace: the order of the warm-up step's chunk accesses, replayed after it.

What the rCache's Belady replacement ([Note: rCache replacement]) and prefetch ([Note: prefetch
overlap]) read: recorded during the first training step, then followed access by access.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable

NEVER = float("inf")


class ChunkAccessTrace:
    """Records chunk keys in access order during warm-up; answers "when is it used next"."""

    def __init__(self) -> None:
        self.recording = True
        self.keys: list[Hashable] = []
        self._positions: dict[Hashable, list[int]] = {}
        self.cursor = 0

    def touch(self, key: Hashable) -> None:
        if self.recording:
            if not self.keys or self.keys[-1] != key:
                self.keys.append(key)
            return
        positions = self._positions.get(key)
        if not positions or (self.cursor > 0 and self.keys[self.cursor - 1] == key):
            return  # unknown, or a repeat of the access just matched (recorded once)
        # advance to this key's next recorded occurrence (wrapping to the next iteration)
        i = bisect.bisect_left(positions, self.cursor)
        self.cursor = (positions[i] if i < len(positions) else positions[0]) + 1

    def freeze(self) -> None:
        """End of warm-up: the recorded order drives replacement and prefetch from now on."""
        if not self.recording:
            return
        self.recording = False
        for pos, key in enumerate(self.keys):
            self._positions.setdefault(key, []).append(pos)
        self.cursor = 0

    def restart(self) -> None:
        """A new iteration begins (its first access matches the trace start)."""
        self.cursor = 0

    def next_use(self, key: Hashable) -> float:
        positions = self._positions.get(key)
        if self.recording or not positions:
            return NEVER
        i = bisect.bisect_left(positions, self.cursor)
        if i < len(positions):
            return positions[i] - self.cursor
        return positions[0] + len(self.keys) - self.cursor  # next iteration

    def upcoming(self, count: int) -> list[Hashable]:
        """The next ``count`` distinct keys after the cursor."""
        if self.recording or count <= 0:
            return []
        out: list[Hashable] = []
        pos = self.cursor
        for _ in range(len(self.keys)):
            if pos >= len(self.keys):
                break
            key = self.keys[pos]
            if key not in out:
                out.append(key)
                if len(out) == count:
                    break
            pos += 1
        return out
