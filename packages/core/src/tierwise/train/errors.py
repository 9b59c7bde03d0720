"""The one error type `tierwise train` shows to people as a single line."""

from __future__ import annotations


class TrainError(Exception):
    """Bad input or an impossible request; the message says what was asked and what to change."""
