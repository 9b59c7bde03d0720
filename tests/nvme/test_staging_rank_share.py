"""NVMe pools without a host_memory are sized against the rank's share of the RAM available
([Note: a rank's host share]; issue 36): ``ranks_per_node`` ranks on a node each size their
staged-read and optimizer-pipeline pools against 1/ranks_per_node of what the node has free,
and the planners (core's ``storage_tier_host_bytes``, the search's ``storage_host_bytes``)
count what a tier made on such a node holds."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_nvme")

import tierwise_nvme.staging as staging  # noqa: E402
from tierwise.config import Config  # noqa: E402
from tierwise.planning.host_minimum import storage_tier_host_bytes  # noqa: E402
from tierwise.probe import ranks_on_this_node  # noqa: E402
from tierwise_nvme import NVMeOptions, NVMeTier  # noqa: E402
from tierwise_nvme.staging import HOST_FRACTION, host_bytes  # noqa: E402

BLOCK = NVMeOptions().block_size
AVAILABLE = int(4 * BLOCK / HOST_FRACTION)
"""The node's free RAM, stubbed: one rank's staged-read pool fits 4 blocks in it, each of two
ranks' 2 (both fewer than queue_depth + 2, so the share decides)."""


@pytest.fixture
def node(monkeypatch):
    """``node(ranks)``: this process sees AVAILABLE bytes free on a node of ``ranks`` ranks."""
    monkeypatch.setattr(staging, "available_host_memory", lambda: AVAILABLE)

    def on(ranks: int) -> None:
        monkeypatch.setattr(staging, "ranks_on_this_node", lambda: ranks)

    return on


def test_a_rank_sizes_against_its_share_of_the_available_ram(node, nvme_dir):
    config = Config(nvme_path=str(nvme_dir), device="cpu")
    assert host_bytes(config, ranks_per_node=1) == AVAILABLE
    assert host_bytes(config, ranks_per_node=2) == AVAILABLE // 2
    # a host_memory (already the rank's share: rank_config) still bounds it
    assert host_bytes(Config(host_memory=1 << 20), ranks_per_node=2) == 1 << 20
    node(2)  # a tier being made counts its node's ranks as the probe does
    assert host_bytes(config) == AVAILABLE // 2
    assert ranks_on_this_node() == 1  # outside torch.distributed: one rank


@pytest.mark.parametrize("ranks", [1, 2])
def test_what_a_tier_holds_is_what_the_planners_count(node, make_tier, ranks):
    """A tier made on a node of ``ranks`` ranks holds (staged reads, an optimizer pipeline)
    what core's planner counts for the plan's hardware of ``ranks`` per node; two ranks' read
    pools together hold what one rank's does alone."""
    node(ranks)
    tier = make_tier("threads")
    assert tier.staging.count * ranks * BLOCK == 4 * BLOCK
    buffer_bytes = 4 * 250_000
    held = tier.host_buffer_bytes(optimizer_buffer_bytes=buffer_bytes)
    planned = storage_tier_host_bytes(NVMeTier, tier.config, buffer_bytes, ranks_per_node=ranks)
    assert planned == held
    # the pipeline the engine makes holds what was counted
    pipeline = tier.optimizer_pipeline(buffer_bytes=buffer_bytes)
    assert pipeline.pool.count * buffer_bytes == held - tier.host_buffer_bytes()
