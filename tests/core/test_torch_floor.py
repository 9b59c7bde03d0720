"""The torch floor in package metadata is a version the tests run on (issue 28, defect 11):
tierwise uses device-generic APIs (``torch.accelerator.current_stream``, ``torch.Stream`` as a
context manager) that older releases lack, and CI runs only the version constraints/ci.txt pins,
so the floor is that version; lowering it needs a tox env that tests the lower one."""

from __future__ import annotations

import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", version).group(0).split("."))


def test_the_declared_torch_floor_is_the_tested_version():
    text = (REPO / "packages/core/pyproject.toml").read_text()
    floors = re.findall(r'"torch\s*>=\s*([0-9.]+)', text)
    assert len(floors) == 1, "packages/core/pyproject.toml declares one torch floor"
    floor = _release(floors[0])
    pinned = re.search(r"^torch==(\S+)", (REPO / "constraints/ci.txt").read_text(), re.M)
    assert pinned, "constraints/ci.txt pins the torch CI tests"
    assert floor == _release(pinned.group(1))[: len(floor)]
    assert _release(torch.__version__)[: len(floor)] >= floor
    assert hasattr(torch.accelerator, "current_stream") and hasattr(torch, "Stream")
