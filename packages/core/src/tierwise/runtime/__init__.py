"""The runtime: the engine and its parts, one sub-package each (docs/architecture.md)."""
