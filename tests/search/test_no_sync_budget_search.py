"""``no_sync`` on two gloo ranks at the search planner's stated device minimum: the sums are
uploaded into the reduction blocks its cost model counts (``staging_blocks``), never through
the host, within the minimum, bitwise DDP's ``no_sync`` ([Note: no_sync buffers] in core).
Core's planner: ``tests/core/test_no_sync_budget.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_search")

from helpers.multiproc import run_ranks  # noqa: E402
from helpers.no_sync_runs import at_the_minimum, check_at_the_minimum  # noqa: E402

pytestmark = pytest.mark.multiprocess


def test_no_sync_at_the_search_planners_device_minimum_uploads_into_counted_blocks(monkeypatch):
    monkeypatch.delenv("TIERWISE_DISABLE_PLUGINS", raising=False)  # the search answers
    results = run_ranks(at_the_minimum, 2, False)
    assert results[0]["need"] == results[1]["need"]
    for rank, result in enumerate(results):
        assert result["ours"]["planner"] == "search"
        check_at_the_minimum(rank, result)
