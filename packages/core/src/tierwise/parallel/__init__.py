"""Parallel patterns and the byte-counting collectives wrapper."""

from tierwise.parallel.base import ParallelPattern
from tierwise.parallel.data_parallel import DataParallel

__all__ = ["DataParallel", "ParallelPattern"]
