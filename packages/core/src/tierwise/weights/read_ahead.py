"""Reading the next item while the current one is used: the reading half of the weight
pipelines ([Note: pipelined weight loading], [Note: pipelined export])."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from concurrent.futures import Executor, Future

Item = TypeVar("Item")
Value = TypeVar("Value")


def read_ahead(
    pool: Executor | None,
    read: Callable[[Item], Value],
    items: Iterable[Item],
    *,
    depth: int = 1,
    may_read_ahead: Callable[[Item], bool] | None = None,
) -> Iterator[Value]:
    """Yield ``read(item)`` for every item, in order, with up to ``depth`` further reads
    running on ``pool`` while the caller uses the value yielded.

    An item ``may_read_ahead`` refuses (one whose buffer does not fit the budget, or one that
    must be read on the caller's thread: a device tensor, [Note: CUDA threading model]) is read
    on the caller's thread when its turn comes, and nothing is read ahead past it until then.
    Without a pool every read runs on the caller's thread. The values yielded are those of the
    serial loop; at most ``depth + 1`` of them are alive at once (the one yielded, those read
    ahead), as long as the caller drops each before asking for the next.
    """
    pending: deque[tuple[Item, Future | None]] = deque()
    source = iter(items)
    exhausted = False
    try:
        while True:
            while not exhausted and len(pending) <= depth:
                if pending and pending[-1][1] is None:
                    break  # read on the caller's thread: nothing runs ahead of it
                item = next(source, _END)
                if item is _END:
                    exhausted = True
                    break
                ahead = pool is not None and (may_read_ahead is None or may_read_ahead(item))
                pending.append((item, pool.submit(read, item) if ahead else None))
            if not pending:
                return
            item, future = pending.popleft()
            value = read(item) if future is None else future.result()
            del future
            yield value
            del value
    finally:
        for _, future in pending:  # the caller stopped early or failed: nothing more is read
            if future is not None:
                future.cancel()
        for _, future in pending:
            if future is not None and not future.cancelled():
                future.exception()  # wait: the read must not outlive the caller's buffers


_END = object()
