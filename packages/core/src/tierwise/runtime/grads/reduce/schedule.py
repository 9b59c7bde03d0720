"""When each chunk's gradient reduction is launched: the due points and their prediction.

[Note: due points predicted from the forward]
Without due points every chunk would wait for the end of the first backward, each in a host
buffer of its own: one whole unsharded gradient per rank in host memory, the step that must not
need more memory than the others. So the forward that precedes the backward is recorded (the
hooked modules in call order, outside backward; ``GradientPath.forward_module``) and the sync
points are predicted from it: backward starts each module once, in the reverse order of its
last forward call, so module m's backward start is sync point 1 + #{modules called last after
m's last call}. A chunk completes once the backward of the *first* forward call touching it is
done, that is after every module whose last call came at or after that first call has started
its backward: it is due at the sync point after those, ``1 + #{m : last(m) >= first(chunk)}``
(``predict_due``). A module that never starts a backward (frozen, no gradient reaches it) only
makes predictions later (the chunk waits, as before); a chunk predicted too early takes the late
path, which stays exact. A static model's prediction is exact: its first backward reduces as
every later one does (``tests/core/test_reduction_order.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable

END = 2**62
"""The due point "end of backward"."""


def predict_due(calls: list[tuple[object, set]], keys: list[Hashable]) -> dict[Hashable, int]:
    """The due sync point of each chunk in ``keys`` that the forward ``calls`` (module, chunk
    keys it touched), in call order, used: [Note: due points predicted from the forward]. A
    chunk no call used gets none (it waits for the end of backward)."""
    last: dict[object, int] = {}
    first: dict[Hashable, int] = {}
    for position, (module, touched) in enumerate(calls):
        last[module] = position
        for key in touched:
            first.setdefault(key, position)
    lasts = sorted(last.values())
    return {key: 1 + len(lasts) - bisect_left(lasts, first[key]) for key in keys if key in first}


def launch_schedule(order: list[Hashable], due: dict[Hashable, int]) -> list[Hashable]:
    """The chunks in launch order: by due point, then in the reduction ``order`` ([Note: one
    collective order])."""
    position = {key: i for i, key in enumerate(order)}
    return sorted(order, key=lambda k: (due[k], position[k]))


class ForwardRecord:
    """The forward's module calls and the reduced chunks each touched, kept while due points
    are to be predicted ([Note: due points predicted from the forward])."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, set]] = []
        """(module, keys of the reduced chunks it touched), in call order."""

    def add(self, module: object, keys: set, *, limit: int) -> None:
        """A hooked module's forward starts; beyond ``limit`` calls (forwards no backward
        followed) only the recent half is kept."""
        if len(self.calls) > limit:
            del self.calls[: len(self.calls) // 2]
        self.calls.append((module, keys))

    def predict(self, keys: list[Hashable]) -> dict[Hashable, int]:
        return predict_due(self.calls, keys)

    def clear(self) -> None:
        self.calls.clear()
