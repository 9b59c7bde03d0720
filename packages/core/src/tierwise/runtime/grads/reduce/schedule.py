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


class DuePoints:
    """The reduction order and each chunk's due point ([Note: one collective order]): predicted
    from the forward until a backward has shown them ([Note: due points predicted from the
    forward]), learnt from each backward after."""

    def __init__(self) -> None:
        self.order: list[Hashable] = []
        """The reduction order (chunk keys), the same on every rank."""
        self.due: dict[Hashable, int] = {}
        """Per chunk: the sync point its reduction is launched at (``END``: end of backward)."""
        self.forward = ForwardRecord()
        """This step's forward, from which due points are predicted."""
        self.predicted = False
        """Whether this backward's due points come from a last backward or an agreed
        prediction (False: predict them at the first sync point)."""
        self._schedule: list[Hashable] = []
        self._next = 0

    def reset(self, order: list[Hashable]) -> None:
        """A new reduction ``order``: every chunk due at the end of the next backward, unless
        predicted."""
        self.order = order
        self.due = dict.fromkeys(order, END)
        self.predicted = False
        self.restart()

    def restart(self) -> None:
        """A backward starts over the launch schedule."""
        self._schedule = launch_schedule(self.order, self.due)
        self._next = 0

    def agree_on_predicted(self, all_reduce_max) -> None:
        """The first backward without a last one to learn from: every rank predicts the due
        points from its forward, and the latest prediction of each chunk is taken (``all_reduce_max``
        returns the maximum over the world of a list of ints, None with one rank)."""
        self.predicted = True
        if not self.order:
            return
        mine = self.forward.predict(self.order)
        due = [mine.get(key, END) for key in self.order]
        if all_reduce_max is not None:
            due = all_reduce_max(due)
        self.due = {key: int(d) for key, d in zip(self.order, due, strict=True)}
        self.restart()

    def take_due(self, limit: int):
        """(due point, keys due there, in launch order) of every due point up to ``limit`` not
        taken yet in this backward, in order."""
        schedule = self._schedule
        while self._next < len(schedule) and self.due[schedule[self._next]] <= limit:
            due = self.due[schedule[self._next]]
            keys = []
            while self._next < len(schedule) and self.due[schedule[self._next]] == due:
                keys.append(schedule[self._next])
                self._next += 1
            yield due, keys
