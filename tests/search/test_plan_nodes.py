"""Plans for whole nodes ([Note: shared per node]): a node's ranks share its host memory, CPU
and NVMe; PCIe is per GPU; collectives cross the network between nodes; gradients in flight
take a fixed number of device blocks whatever the world size ([Note: bounded gradient blocks])."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_search")

from search_helpers import gpu_hardware, make_profile  # noqa: E402
from tierwise import Config, PlanError  # noqa: E402
from tierwise.cli import main  # noqa: E402
from tierwise.planning.planner import REDUCTION_BLOCKS, default_plan  # noqa: E402
from tierwise_search.rates import resolve_rates  # noqa: E402
from tierwise_search.search import search_plan  # noqa: E402


def test_a_nodes_cpu_and_nvme_are_shared_and_pcie_is_per_gpu():
    one = resolve_rates(gpu_hardware(world_size=1))
    node = resolve_rates(gpu_hardware(world_size=8))  # gpus_per_node: min(8, 8)
    assert node.ranks_per_node == 8
    assert node.host_adam == one.host_adam / 8
    assert (node.nvme_read, node.nvme_write) == (one.nvme_read / 8, one.nvme_write / 8)
    assert (node.h2d, node.d2h) == (one.h2d, one.d2h)
    assert node.interconnect == one.interconnect  # NVLink inside the node
    two_nodes = resolve_rates(gpu_hardware(world_size=16, network_bandwidth=25e9))
    assert two_nodes.ranks_per_node == 8
    assert two_nodes.interconnect == 25e9  # the ring crosses the network
    spread = resolve_rates(gpu_hardware(world_size=8, gpus_per_node=2))
    assert spread.host_adam == one.host_adam / 2


def test_each_rank_plans_with_its_share_of_the_node_and_prints_both():
    profile = make_profile([[4096] * 4 for _ in range(4)])
    # 65,536 parameters over 4 ranks: 16,384 per rank, 224 KiB at 14 B/param ([Note: gradients
    # in the parameter payload]). 400 kB of device memory now holds all of a rank's model data
    # ([Note: the device margin in the minimum plan]), leaving nothing for host memory to
    # refuse; 100 kB holds 96 KiB of it, so host memory must hold the rest: at least 154 KiB
    # per rank in the smallest plan
    config = Config(device="cuda", device_memory=100_000, host_memory=600_000)
    # 600 kB of host memory holds one rank's share alone (one rank per node) ...
    search_plan(profile, gpu_hardware(world_size=4, gpus_per_node=1), config)
    # ... but not four ranks' shares on one node (146 KiB each, under 154 KiB)
    with pytest.raises(PlanError, match="host memory binds"):
        search_plan(profile, gpu_hardware(world_size=4), config)
    config = Config(device="cuda", device_memory=400_000, host_memory=4_000_000)
    plan = search_plan(profile, gpu_hardware(world_size=4), config)
    line = next(r for r in plan.reasons if r.startswith("model data per rank"))
    assert "per node (4 ranks)" in line
    assert any("4 ranks per node share its host memory" in r for r in plan.reasons)


@pytest.mark.parametrize("world", [2, 8, 64])
def test_gradient_blocks_do_not_grow_with_ranks_or_chunks(world):
    profile = make_profile([[4096] * 4 for _ in range(8)])  # 32 trainable chunks of 4096
    config = Config(device="cuda", chunk_size=4096, param_placement="host")
    one_rank = default_plan(profile=profile, hardware=gpu_hardware(world_size=1), config=config)
    ranks = default_plan(profile=profile, hardware=gpu_hardware(world_size=world), config=config)
    block = 4096 * 2  # bf16
    assert ranks.device_allowance - one_rank.device_allowance <= REDUCTION_BLOCKS * block


@pytest.mark.parametrize("chunk_size", [4096, 4099])
@pytest.mark.parametrize("world", [1, 4])
def test_both_planners_count_the_receive_block_of_a_reduction_in_rank_order(world, chunk_size):
    """[Note: reduction in rank order]: one more device block of the largest chunk with
    ``reduce_order="rank"`` and several ranks (the runtime's ``peak_blocks`` stays within
    ``reduction_blocks``: tests/core/test_reduction_order.py), none on one rank. Blocks are
    the chunks setup builds: 4099 elements sharded over 4 ranks are 4100."""
    profile = make_profile([[4096] * 4 for _ in range(8)])
    hardware = gpu_hardware(world_size=world)
    allowances = {}
    for order in ("fast", "rank"):
        config = Config(
            device="cuda",
            chunk_size=chunk_size,
            cache_blocks=4,
            param_placement="host",
            optimizer_placement="host",
            reduce_order=order,
        )
        core = default_plan(profile=profile, hardware=hardware, config=config)
        search = search_plan(profile, hardware, config)
        assert core.device_allowance == search.device_allowance
        allowances[order] = core.device_allowance
    block = -(-chunk_size // world) * world * 2  # bf16
    assert allowances["rank"] - allowances["fast"] == (block if world > 1 else 0)
    assert allowances["fast"] % block == 0  # cache and reduction blocks, nothing else on it


def test_gpus_per_node_must_divide_the_gpus(capsys):
    code = main(["plan", "--model", "gpt2", "--hardware", "a100-40gb", "--gpus", "6",
                 "--gpus-per-node", "4"])  # fmt: skip
    assert code == 2
    assert "--gpus-per-node 4" in capsys.readouterr().err
