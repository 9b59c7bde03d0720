"""``tierwise plan --validate``: the plan runs on this machine and every phase is reported with
its prediction; the bytes the plan predicts per link are the bytes the engine moves (no timing
is asserted: times are machine noise, see bench/plan_accuracy.py)."""

from __future__ import annotations

import json
import statistics

import pytest

pytest.importorskip("tierwise_search")

from tierwise.cli import main  # noqa: E402
from tierwise_search.validate import LINKS  # noqa: E402

PHASES = ["forward", "backward", "recompute", "fwd_bwd_phase", *LINKS, "optimizer_phase", "total"]


def _validate(capsys, *args: str) -> dict:
    code = main(
        ["plan", "--model", "llama", "--size", "tiny", "--seq", "16", "--batch", "2", "--device",
         "cpu", "--precision", "fp32", "--validate", "--steps", "2", "--json", *args]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_validate_reports_every_phase_and_the_predicted_traffic(capsys):
    result = _validate(capsys, "--param-placement", "host", "--optimizer-placement", "host")
    rows = {row["phase"]: row for row in result["rows"]}
    assert list(rows) == PHASES
    assert result["plan"]["param_tier"] == "host" and result["plan"]["optim_tier"] == "host"
    assert len(result["measured_steps_s"]) == 2
    assert rows["total"]["measured_s"] == pytest.approx(
        statistics.median(result["measured_steps_s"])
    )
    assert result["predicted_over_measured"] == pytest.approx(
        rows["total"]["predicted_s"] / rows["total"]["measured_s"]
    )
    # parameters fetched from host and gradients sent there: the bytes the cost model predicts
    # (it counts whole chunk capacities; the engine moves the used part: the padding differs)
    for link in ("h2d", "d2h"):
        assert rows[link]["predicted_bytes"] > 0
        assert rows[link]["measured_bytes"] == pytest.approx(
            rows[link]["predicted_bytes"], rel=1e-3
        )


def test_validate_refuses_other_hardware(capsys):
    code = main(["plan", "--model", "llama", "--size", "tiny", "--hardware", "a100-40gb",
                 "--validate"])  # fmt: skip
    assert code == 2
    assert "this machine" in capsys.readouterr().err
