"""ExtentAllocator: first-fit free list over one file's byte range, with coalescing."""

from __future__ import annotations

import bisect


class ExtentAllocator:
    """Hands out byte ranges of a file of ``size`` bytes; ``grow`` adds room at the end.

    Offsets and sizes are whatever the caller passes (the NVMe tier passes multiples of 4096).
    Free extents are kept sorted by offset and merged with their neighbours on release.
    """

    def __init__(self) -> None:
        self.size = 0
        self._free: list[tuple[int, int]] = []  # sorted (offset, length), never adjacent

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    def tail_free(self) -> int:
        """Length of the free extent that ends at ``size`` (0 if the end is in use)."""
        if self._free and sum(self._free[-1]) == self.size:
            return self._free[-1][1]
        return 0

    def grow(self, new_size: int) -> None:
        """Extend the range to ``new_size`` bytes; the new room is free."""
        if new_size < self.size:
            raise ValueError(f"cannot shrink from {self.size} to {new_size} bytes")
        if new_size > self.size:
            self._insert(self.size, new_size - self.size)
            self.size = new_size

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a free run of ``nbytes`` (first fit), or None when none is large enough."""
        if nbytes <= 0:
            raise ValueError(f"allocate needs a positive size, got {nbytes}")
        for index, (offset, length) in enumerate(self._free):
            if length >= nbytes:
                if length == nbytes:
                    del self._free[index]
                else:
                    self._free[index] = (offset + nbytes, length - nbytes)
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Give ``[offset, offset + nbytes)`` back (it must be allocated now)."""
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.size:
            raise ValueError(f"free of [{offset}, {offset + nbytes}) is outside [0, {self.size})")
        self._insert(offset, nbytes)

    def _insert(self, offset: int, nbytes: int) -> None:
        index = bisect.bisect_left(self._free, (offset, 0))
        end = offset + nbytes
        if (
            index > 0
            and sum(self._free[index - 1]) > offset
            or (index < len(self._free) and self._free[index][0] < end)
        ):
            raise ValueError(f"[{offset}, {end}) overlaps a free extent: released twice?")
        if index < len(self._free) and self._free[index][0] == end:  # merge right
            end += self._free.pop(index)[1]
        if index > 0 and sum(self._free[index - 1]) == offset:  # merge left
            index -= 1
            offset = self._free.pop(index)[0]
        self._free.insert(index, (offset, end - offset))


__all__ = ["ExtentAllocator"]
