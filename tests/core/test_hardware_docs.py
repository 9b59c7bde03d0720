"""The hardware presets and the README's "Hardware fields" table: every Hardware field is
documented with its unit, and every number a preset ships carries its source in a comment."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from tierwise.hardware import PRESET_DIR, Hardware, preset_names

README = Path(__file__).parents[2] / "README.md"
UNITS = {  # the unit each kind of figure is given in (issue 16)
    "device_memory": "bytes",
    "host_memory": "bytes",
    "nvme_free": "bytes",
    "h2d_bandwidth": "bytes/s",
    "d2h_bandwidth": "bytes/s",
    "nvme_read_bandwidth": "bytes/s",
    "nvme_write_bandwidth": "bytes/s",
    "interconnect_bandwidth": "bytes/s",
    "device_adam_velocity": "elements/s",
    "host_adam_velocity": "elements/s",
    "device_flops": "FLOP/s",
}


def _readme_units() -> dict[str, str]:
    """Field -> unit, from the rows of the README table headed `Hardware` field | unit."""
    text = README.read_text()
    table = text[text.index("| `Hardware` field | unit |") :]
    table = table[: table.index("\n\n")]
    units = {}
    for row in table.splitlines()[2:]:
        names, unit, meaning = (cell.strip() for cell in row.strip("|").split("|"))
        assert meaning, row
        for name in re.findall(r"`(\w+)`", names):
            units[name] = unit
    return units


def test_readme_documents_every_hardware_field_with_its_unit():
    units = _readme_units()
    assert set(units) == {f.name for f in fields(Hardware)}
    for name, unit in UNITS.items():
        assert units[name] == unit, name


def test_every_preset_number_carries_its_source():
    assert preset_names()
    for name in preset_names():
        lines = (PRESET_DIR / f"{name}.toml").read_text().splitlines()
        for i, line in enumerate(lines):
            if "=" not in line or line.startswith("#") or line.startswith("device_type"):
                continue
            j = i - 1  # the comment above, past figures that share it (h2d and d2h)
            while j > 0 and "=" in lines[j] and not lines[j].startswith("#"):
                j -= 1
            assert lines[j].startswith("# ") and len(lines[j]) > 10, (name, line)
