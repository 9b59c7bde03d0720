"""The errors `tierwise train` shows to people as a single line."""

from __future__ import annotations


class TrainError(Exception):
    """Bad input or an impossible request; the message says what was asked and what to change."""


class RunFailed(Exception):
    """The run stopped part way on a failure outside its inputs (a disk error under the NVMe
    tier or while writing a checkpoint); the message says what failed and how to resume."""
