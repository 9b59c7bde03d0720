"""``no_sync`` on two gloo ranks at core's planner's stated device minimum: each whole-chunk sum
is uploaded into a reduction block the plan already counts, never through the host, the device
tier stays within the minimum, and the run is bitwise DDP's ``no_sync`` ([Note: no_sync
buffers]). The search planner's counterpart: ``tests/search/test_no_sync_budget_search.py``."""

from __future__ import annotations

import pytest
from helpers.multiproc import run_ranks
from helpers.no_sync_runs import at_the_minimum, check_at_the_minimum

pytestmark = pytest.mark.multiprocess


def test_no_sync_at_core_planners_device_minimum_uploads_into_counted_blocks(monkeypatch):
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "search")  # core's planner answers
    results = run_ranks(at_the_minimum, 2, True)
    assert results[0]["need"] == results[1]["need"]
    for rank, result in enumerate(results):
        assert result["ours"]["planner"] == "core"
        check_at_the_minimum(rank, result)
