"""The runtime: engine, rCache, access hooks."""

from tierwise.runtime.cache import AccessTrace, RCache
from tierwise.runtime.engine import Engine

__all__ = ["AccessTrace", "Engine", "RCache"]
