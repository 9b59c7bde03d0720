"""The optimizer step: checks, per-chunk updates, speculation and undo, host updates."""
